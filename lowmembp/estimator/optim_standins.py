"""Stand-ins for the optimizers whose step cannot run on fake tensors, so that estimates can follow them.

    opt = standin(params, "apollo-adamw@rank=256")   # None for an optimizer whose own step runs on fake tensors

APOLLO's limiter and Adafactor's relative step read a value back, torchao's low-bit step is compiled over tensor
subclasses, torchao's CPU offload needs a CUDA device: a fake tensor has no value and is no CUDA tensor. A stand-in
(:data:`STANDINS`) holds the states each package makes, with its layout, shapes and dtypes
(:mod:`lowmembp.methods.optim_levers` has the byte formulas; the tests check them against the packages' own states),
and its step allocates, one parameter at a time, the temporaries the package's step allocates at its largest, the
parameters left as they are. What each one holds and allocates: docs/methods/optim-levers.md#stand-ins.

May import: torch, :mod:`lowmembp.methods.optim_levers`.
"""
from __future__ import annotations

import math

import torch

from lowmembp.methods import optim_levers as levers

__all__ = ["standin", "StandIn", "STANDINS"]

STANDINS = ("apollo-adamw", "adafactor", "adamw8bit-torchao", "adamw4bit-torchao", "adamw-fp8-torchao",
            "adamw-cpu-offload")


class StandIn(torch.optim.Optimizer):
    """An optimizer that makes the states and temporaries of ``name`` (docs/methods/optim-levers.md#stand-ins) and
    leaves the parameters."""

    def __init__(self, params, spec: str, targets=None, lr: float = 1e-4, weight_decay: float = 0.0):
        super().__init__(list(params), dict(lr=lr, weight_decay=weight_decay))
        self.name, opts = levers.split_optimizer(spec)
        self.rank = {**levers.LEVERS[self.name].options, **opts}.get("rank")
        self._proj = {id(t) for t in targets} if targets is not None else None

    def _projected(self, p) -> bool:
        return p.dim() == 2 and (self._proj is None or id(p) in self._proj)

    def _states(self, p) -> dict:
        z = dict(device=p.device)
        n, name = name_numel(p), self.name
        if name == "apollo-adamw":
            if self._projected(p):
                m, k = p.shape
                shape = (m, self.rank) if m >= k else (self.rank, k)
                proj = (self.rank, k) if m >= k else (m, self.rank)
                return {"exp_avg": torch.zeros(shape, dtype=p.dtype, **z),
                        "exp_avg_sq": torch.zeros(shape, dtype=p.dtype, **z),
                        "projection": torch.zeros(proj, dtype=p.dtype, **z),
                        "scaled_grad": torch.zeros((), dtype=p.dtype, **z)}
            return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        if name == "adafactor":
            out = {"step": torch.zeros((), dtype=torch.float32, **z)}
            if p.dim() >= 2:
                out["row_var"] = torch.zeros((*p.shape[:-1], 1), dtype=p.dtype, **z)
                out["col_var"] = torch.zeros((*p.shape[:-2], 1, p.shape[-1]), dtype=p.dtype, **z)
            else:
                out["variance"] = torch.zeros_like(p)
            return out
        if name in levers.TORCHAO_BLOCK:
            block = levers.TORCHAO_BLOCK[name]
            out = {"step": torch.zeros((), dtype=torch.float32, **z)}
            if n < levers.TORCHAO_MIN_SIZE or n % block:
                out.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                return out
            codes = n * levers.TORCHAO_BITS[name] // 8
            qmap = {"adamw8bit-torchao": 256, "adamw4bit-torchao": 16, "adamw-fp8-torchao": 0}[name]
            for s in ("exp_avg", "exp_avg_sq"):
                out[s + ".codes"] = torch.zeros(codes, dtype=torch.uint8, **z)
                out[s + ".scale"] = torch.zeros(n // block, dtype=torch.float32, **z)
                if qmap:
                    out[s + ".qmap"] = torch.zeros(qmap, dtype=torch.float32, **z)
            return out
        if name == "adamw-cpu-offload":
            if n >= levers.TORCHAO_MIN_SIZE:
                return {}
            return {"step": torch.zeros((), dtype=torch.float32, **z), "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p)}
        raise ValueError(f"no stand-in for optimizer {name!r}")

    def _temporaries(self, p) -> list[tuple]:
        if self.name == "apollo-adamw":
            if self._projected(p):
                m, k = p.shape
                shape = (m, self.rank) if m >= k else (self.rank, k)
                return [shape, shape, shape, tuple(p.shape)]
            return [tuple(p.shape)] * 2
        if self.name == "adafactor":
            return [tuple(p.shape)]
        return []

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p].update(self._states(p))
                temps = [torch.empty(s, dtype=p.dtype, device=p.device) for s in self._temporaries(p)]
                del temps
        return loss


def name_numel(p: torch.Tensor) -> int:
    return math.prod(p.shape)


def standin(params, spec: str, *, targets=None, lr: float = 1e-4, weight_decay: float = 0.0) -> StandIn | None:
    """A :class:`StandIn` for ``spec`` when its own step cannot run on fake tensors (:data:`STANDINS`), else None."""
    name = levers.split_optimizer(spec)[0]
    if name not in STANDINS:
        return None
    return StandIn(params, spec, targets=targets, lr=lr, weight_decay=weight_decay)

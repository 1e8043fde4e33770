"""``compact``: CompAct (Shamshoum et al., NAACL 2025): each trained linear of the blocks saves a random projection of
its input for the backward, and forms its weight gradient in the projected space (:mod:`lowmembp.ops.compact_linear`).

A lever for full fine-tuning: what a linear keeps falls from ``d_in`` to ``r`` values per row, at the price of an
unbiased random estimate of the weight gradient (its error falling as ``1/√r``); the forward, the input gradient and
the bias gradient stay exact. Options: ``ratio`` (``r = ⌈ratio · d_in⌉``; default 0.25) or ``rank`` (one ``r`` for
all; wins over ``ratio``), ``seed``. The layout's projections with a trained weight are converted (not the head, the
embeddings or frozen linears), their ``forward`` replaced on the instance for training with grad enabled; linears of
one input share one projection. Composes with ``lowmembp`` (the pair gains what lowmembp's activations save and loses
nothing), ``checkpointing`` and ``tiled-mlp``; not with ``mesa``. In full, with measured figures:
docs/methods/compact.md.

May import: torch, :mod:`lowmembp.ops.compact_linear`, :mod:`lowmembp.models`.
"""
from __future__ import annotations

import itertools
import math
import types

import torch.nn as nn

from lowmembp.methods.registry import register

__all__ = ["apply_compact", "check_compact", "compact_layers", "rank_of"]

DEFAULT_RATIO = 0.25


def check_compact(ratio=DEFAULT_RATIO, rank=None, seed=0):
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"compact: ratio must be in (0, 1], got {ratio!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"compact: rank must be a positive integer or None, got {rank!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"compact: seed must be an integer, got {seed!r}")


def rank_of(d_in: int, ratio: float = DEFAULT_RATIO, rank: int | None = None) -> int:
    """The projection's columns for a linear of input width ``d_in``."""
    return min(d_in, rank) if rank is not None else max(1, math.ceil(ratio * d_in))


@register("compact", "CompAct: each trained block linear saves a random projection x·P of its input (r = ratio·d_in) "
                     "and forms its weight gradient from it (unbiased estimate; forward, input and bias gradients "
                     "exact)",
          options={"ratio": DEFAULT_RATIO, "rank": None, "seed": 0}, order=25, kinds={"rank": (int,)},
          excludes={"mesa": "mesa replaces the same linears with its own 8-bit ones"}, check=check_compact)
def apply_compact(model: nn.Module, ratio: float = DEFAULT_RATIO, rank: int | None = None, seed: int = 0) -> nn.Module:
    from lowmembp.models import get_layout

    check_compact(ratio, rank, seed)
    layout = get_layout(model)
    done = 0
    for i, s in enumerate(layout.projections):
        m = s.get()
        if type(m) is not nn.Linear or not m.weight.requires_grad:
            continue
        counter = itertools.count()
        m._compact = {"rank": rank_of(m.in_features, ratio, rank), "seed": seed, "layer": i, "calls": counter}
        m.forward = types.MethodType(_forward, m)
        done += 1
    if not done:
        raise ValueError(f"compact: no trained nn.Linear among the blocks' linears of {type(layout.base).__name__} "
                         "(frozen base weights, e.g. under LoRA, save no input: nothing to compress)")
    return model


_LAST: dict = {}  # the last projection made: {"x", "z": weak references, "key": (rank, d_in), "seed"}


def _forward(self: nn.Linear, x):
    import weakref

    import torch

    if not (self.training and torch.is_grad_enabled()):
        return nn.Linear.forward(self, x)
    from lowmembp.ops.compact_linear import compact_linear, project

    c = self._compact
    last = _LAST.get("x")
    z = _LAST["z"]() if last is not None and last() is x and _LAST["key"] == (c["rank"], x.shape[-1]) else None
    if z is not None:
        seed = _LAST["seed"]   # q, k, v (gate, up) of one input: one projection between them
    else:
        seed = (c["seed"] * 1_000_003 + c["layer"] * 10_007 + next(c["calls"])) % (2 ** 62)
        xz = x.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else x
        z = project(xz, c["rank"], seed)
        _LAST.update(x=weakref.ref(x), key=(c["rank"], x.shape[-1]), z=weakref.ref(z), seed=seed)
    try:
        return compact_linear(x, self.weight, self.bias, rank=c["rank"], seed=seed, z=z)
    finally:
        del z


def compact_layers(model: nn.Module) -> list[nn.Linear]:
    """The linears ``compact`` converted."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and hasattr(m, "_compact")]

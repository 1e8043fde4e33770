"""The full-fine-tuning optimizer levers of the packages practitioners install, beside AdamW and its two levers of
:mod:`lowmembp.methods.optimizers` (which lists them all in ``OPTIMIZERS`` and builds them with ``make_optimizer``).

    from lowmembp.methods.optimizers import make_optimizer
    opt = make_optimizer(model.parameters(), "galore-adamw-layerwise@rank=64", lr=1e-5, model=model)

Each name of :data:`LEVERS` is the package's own optimizer class, most of them one flag away in the Hugging Face
``Trainer``: GaLore (plain and layer-wise), APOLLO, ``torch.optim.Adafactor``, torchao's CPU-offload and low-bit
AdamWs, bitsandbytes' paged AdamWs. Options are written into the name (``galore-adamw@rank=64,update_proj_gap=500``;
:data:`OPTIONS`), their defaults transformers'. GaLore and APOLLO project the blocks' attention and MLP linears (the
layout's projections). The ``*_state_bytes`` functions give the bytes each package's states take, for the estimates.
What each one keeps and how it behaves: docs/methods/optim-levers.md.

May import: torch; on first use galore-torch, apollo-torch, torchao, bitsandbytes; lowmembp.models (the layout's
projections).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["LEVERS", "OPTIONS", "Lever", "split_optimizer", "check_optimizer", "steps_in_backward",
           "projection_weights", "build_lever", "torchao_state_bytes", "galore_state_bytes", "apollo_state_bytes",
           "adafactor_state_bytes", "svd_workspace_bytes", "OPTION_MARK", "missing_package"]

OPTION_MARK = "@"  # as the method specs': "galore-adamw@rank=64"
# transformers' defaults for optim_args (trainer.py: galore rank 128, update_proj_gap 200, scale 0.25;
# apollo rank 128, update_proj_gap 200, scale 1.0, proj random, scale_type channel)
_GALORE = {"rank": 128, "update_proj_gap": 200, "scale": 0.25}
_APOLLO = {"rank": 128, "update_proj_gap": 200, "scale": 1.0}
TORCHAO_MIN_SIZE = 4096  # torchao (following bitsandbytes): smaller tensors keep states in the parameter's dtype
TORCHAO_BLOCK = {"adamw8bit-torchao": 256, "adamw4bit-torchao": 128, "adamw-fp8-torchao": 256}
TORCHAO_BITS = {"adamw8bit-torchao": 8, "adamw4bit-torchao": 4, "adamw-fp8-torchao": 8}
PAGED_MIN_SIZE = 100_000  # bitsandbytes: smaller tensors' paged states are ordinary (device) tensors


@dataclass(frozen=True)
class Lever:
    """One optimizer lever: its description, the pip requirement of its package (``None``: torch itself), its
    options (name -> default), whether it steps inside the backward (and frees each gradient), and whether it
    needs an accelerator."""
    description: str
    package: str | None
    options: dict[str, Any] = field(default_factory=dict)
    in_backward: bool = False
    needs_accelerator: bool = False


LEVERS: dict[str, Lever] = {
    "galore-adamw": Lever("galore-torch GaLoreAdamW: AdamW states of the gradient projected to rank r (SVD refreshed "
                          "every T steps); stepped after the backward", "galore-torch==1.0", dict(_GALORE)),
    "galore-adamw-layerwise": Lever("GaLoreAdamW per parameter inside the backward, each gradient freed (GaLore's "
                                    "layer-wise recipe, its memory figure)", "galore-torch==1.0", dict(_GALORE),
                                    in_backward=True),
    "apollo-adamw": Lever("apollo-torch APOLLOAdamW: AdamW states of a rank-r random projection, channel-wise "
                          "scaling of the raw gradient", "apollo-torch==1.0.3", dict(_APOLLO)),
    "adafactor": Lever("torch.optim.Adafactor: factored second moment (a row and a column per matrix), no first "
                       "moment", None),
    "adamw-cpu-offload": Lever("torchao CPUOffloadOptimizer(AdamW): states and fp32 master weights on the host, the "
                               "step on the CPU (CUDA only)", "torchao==0.18.0", needs_accelerator=True),
    "adamw8bit-torchao": Lever("torchao AdamW8bit: block-wise 8-bit states (256 a block)", "torchao==0.18.0"),
    "adamw4bit-torchao": Lever("torchao AdamW4bit: block-wise 4-bit states (128 a block)", "torchao==0.18.0"),
    "adamw-fp8-torchao": Lever("torchao AdamWFp8: block-wise fp8 (e4m3) states (256 a block)", "torchao==0.18.0"),
    "paged-adamw": Lever("bitsandbytes PagedAdamW: 32-bit states in CUDA unified memory (QLoRA's paged_adamw_32bit)",
                         "bitsandbytes>=0.45,<0.51"),
    "paged-adamw8bit": Lever("bitsandbytes PagedAdamW8bit: 8-bit states in CUDA unified memory",
                             "bitsandbytes>=0.45,<0.51"),
}
OPTIONS: dict[str, dict[str, Any]] = {name: lever.options for name, lever in LEVERS.items() if lever.options}
_IMPORTS = {"galore-torch==1.0": "galore_torch", "apollo-torch==1.0.3": "apollo_torch", "torchao==0.18.0": "torchao",
            "bitsandbytes>=0.45,<0.51": "bitsandbytes"}
_EXTRA = {"galore-torch==1.0": "galore", "apollo-torch==1.0.3": "apollo", "torchao==0.18.0": "torchao",
          "bitsandbytes>=0.45,<0.51": "optim"}


def split_optimizer(spec: str) -> tuple[str, dict[str, Any]]:
    """``"galore-adamw@rank=64,update_proj_gap=500"`` -> ``("galore-adamw", {"rank": 64, "update_proj_gap": 500})``
    (values read by their default's type); ValueError for an option the optimizer does not take or a bad value.
    The name is not checked here (:func:`check_optimizer` does)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"optimizer must be a non-empty name, got {spec!r}")
    name, mark, rest = spec.strip().partition(OPTION_MARK)
    opts: dict[str, Any] = {}
    if not mark:
        return name, opts
    takes = LEVERS[name].options if name in LEVERS else {}
    for item in rest.split(","):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in takes:
            raise ValueError(f"optimizer {spec!r}: cannot read {item.strip()!r}; {name!r} takes "
                             f"{', '.join(f'{k}=<{type(v).__name__}>' for k, v in takes.items()) or 'no options'}")
        try:
            opts[key] = type(takes[key])(value)
        except ValueError:
            raise ValueError(f"optimizer {spec!r}: {key} must be a {type(takes[key]).__name__}, got {value!r}") \
                from None
    if opts.get("rank", 1) < 1 or opts.get("update_proj_gap", 1) < 1:
        raise ValueError(f"optimizer {spec!r}: rank and update_proj_gap must be positive")
    return name, opts


def check_optimizer(spec: str, known: Iterable[str]) -> str:
    """The optimizer name of ``spec`` when it is one of ``known`` and its options read; ValueError naming the
    choices otherwise."""
    known = list(known)
    name, _ = split_optimizer(spec) if isinstance(spec, str) and spec.strip() else (spec, None)
    if name not in known:
        raise ValueError(f"optimizer must be one of {', '.join(known)} (GaLore / APOLLO options written into the name, "
                         f"e.g. 'galore-adamw@rank=64,update_proj_gap=200'), got {spec!r}")
    return name


def steps_in_backward(spec: str) -> bool:
    """Whether the optimizer ``spec`` steps each parameter inside the backward and frees its gradient."""
    name = split_optimizer(spec)[0]
    return name == "adamw-fused-backward" or (name in LEVERS and LEVERS[name].in_backward)


def missing_package(name: str) -> str | None:
    """The install line for the package optimizer ``name`` needs when it is missing here, else None."""
    lever = LEVERS.get(name)
    if lever is None or lever.package is None:
        return None
    import importlib.util

    if importlib.util.find_spec(_IMPORTS[lever.package]) is not None:
        return None
    return f"pip install '{lever.package}' (the project's extra '{_EXTRA[lever.package]}')"


def _need(name: str):
    import importlib

    why = missing_package(name)
    if why:
        raise ImportError(f"optimizer {name!r} needs {LEVERS[name].package}: {why}")
    return importlib.import_module(_IMPORTS[LEVERS[name].package]) if LEVERS[name].package else None


def projection_weights(model: nn.Module) -> list[torch.Tensor]:
    """The matrices GaLore / APOLLO project: the weights of the blocks' attention and MLP linears (the layout's
    ``projections``, transformers' ``optim_target_modules=["attn", "mlp"]``) that are trained; every other trained
    tensor (embeddings, norms, biases, the head) gets the plain AdamW of the same optimizer. A model the layouts do
    not know: every trained 2-D parameter except the embeddings'."""
    module = getattr(model, "module", model) if isinstance(
        model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else model
    try:
        from lowmembp.models.layout import get_layout

        sites = get_layout(module).projections
        out = [getattr(s.get(), "weight", None) for s in sites]
        out = [w for w in out if isinstance(w, torch.Tensor) and w.dim() == 2 and w.requires_grad]
        if out:
            return list({id(w): w for w in out}.values())
    except Exception:  # noqa: BLE001  no layout: the structural fallback below
        pass
    skip = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return [p for p in module.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in skip]


def _groups(params: list[torch.Tensor], targets, opts: dict, extra: dict) -> list[dict]:
    ids = {id(t) for t in targets} if targets is not None else {id(p) for p in params if p.dim() == 2}
    proj = [p for p in params if id(p) in ids]
    rest = [p for p in params if id(p) not in ids]
    groups = []
    if rest:
        groups.append({"params": rest})
    if proj:
        groups.append({"params": proj, **opts, **extra})
    return groups


def build_lever(params: list[torch.Tensor], spec: str, *, lr: float, weight_decay: float,
                betas: tuple[float, float], eps: float, model: nn.Module | None = None, targets=None, **kw):
    """The optimizer ``spec`` (a name of :data:`LEVERS`, options written in) over ``params`` (trainable tensors).
    ``targets``: the tensors GaLore / APOLLO project (default: :func:`projection_weights` of ``model``, else every
    2-D tensor of ``params``). ``kw`` goes to the package's class."""
    name, opts = split_optimizer(spec)
    lever = LEVERS[name]
    full = {**lever.options, **opts}
    if targets is None and model is not None and name.startswith(("galore", "apollo")):
        targets = projection_weights(model)
    common = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    if lever.needs_accelerator and not any(p.device.type in ("cuda", "xpu") for p in params):
        _need(name)
        raise RuntimeError(f"optimizer {name!r} (torchao CPUOffloadOptimizer) needs the parameters on a CUDA or XPU "
                           f"device (it moves their states to the host); here they are on "
                           f"{params[0].device.type}: use it on a GPU, or 'adamw' on the CPU")
    if name in ("galore-adamw", "galore-adamw-layerwise"):
        galore = _need(name)
        extra = dict(proj_type="std")
        if name == "galore-adamw":
            return galore.GaLoreAdamW(_groups(params, targets, full, extra), no_deprecation_warning=True,
                                      **common, **kw)
        from lowmembp.methods.optimizers import FusedBackwardOptimizer

        ids = {id(t) for t in targets} if targets is not None else {id(p) for p in params if p.dim() == 2}

        def inner(p, **hyper):
            group = {"params": [p], **(dict(full, **extra) if id(p) in ids else {})}
            return galore.GaLoreAdamW([group], no_deprecation_warning=True, **hyper, **kw)

        return FusedBackwardOptimizer(params, inner, **common)
    if name == "apollo-adamw":
        apollo = _need(name)
        extra = dict(proj="random", scale_type="channel", proj_type="std")
        return apollo.APOLLOAdamW(_groups(params, targets, full, extra), **common, **kw)
    if name == "adafactor":  # the single-tensor form: the foreach one (CUDA's default) holds every estimate at once
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay, **{"foreach": False, **kw})
    if name == "adamw-cpu-offload":
        _need(name)
        import torchao.optim as aoo

        return aoo.CPUOffloadOptimizer(params, torch.optim.AdamW, **common, **kw)
    if name in TORCHAO_BLOCK:
        _need(name)
        import torchao.optim as aoo

        cls = {"adamw8bit-torchao": aoo.AdamW8bit, "adamw4bit-torchao": aoo.AdamW4bit,
               "adamw-fp8-torchao": aoo.AdamWFp8}[name]
        return cls(params, **common, **kw)
    if name in ("paged-adamw", "paged-adamw8bit"):
        bnb = _need(name)
        cls = bnb.optim.PagedAdamW if name == "paged-adamw" else bnb.optim.PagedAdamW8bit
        return cls(params, **common, **kw)
    raise ValueError(f"unknown optimizer lever {name!r}")  # pragma: no cover - LEVERS and this function agree


# -- state bytes, as each package lays its states out (checked against the packages in the tests) -----------------

def torchao_state_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
    """Bytes of torchao ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8``'s two states of one parameter: quantised
    (codes of ``bits`` each and one fp32 scale per block) when it has at least 4096 elements and a whole number of
    blocks, else two tensors in the parameter's dtype. The 8- and 4-bit states also hold a small code map each (256
    or 16 fp32 values), counted; the ``step`` counter is not."""
    numel = math.prod(shape)
    block = TORCHAO_BLOCK[name]
    if numel < TORCHAO_MIN_SIZE or numel % block:
        return 2 * numel * torch.empty((), dtype=dtype).element_size()
    codes = numel * TORCHAO_BITS[name] // 8
    qmap = {"adamw8bit-torchao": 256 * 4, "adamw4bit-torchao": 16 * 4, "adamw-fp8-torchao": 0}[name]
    return 2 * (codes + 4 * (numel // block) + qmap)


def _proj_shape(shape: tuple[int, int], rank: int) -> tuple[int, int]:
    """The projected gradient's shape under GaLore's proj_type 'std': the shorter side is projected (m >= n: G·Pᵀ is
    m × r; else Pᵀ·G is r × n), r the rank capped at that side (the SVD has no more singular vectors)."""
    m, n = shape
    return (m, min(rank, n)) if m >= n else (min(rank, m), n)


def galore_state_bytes(shape: tuple[int, ...], rank: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes GaLoreAdamW keeps for one parameter: for a projected matrix AdamW's two states of the projected
    gradient plus the projection; otherwise AdamW's two. The projection of an fp32 matrix is a view of the SVD's
    whole ``Vh`` (or ``U``), so it keeps ``min(m, n)²`` fp32 values alive; of another dtype, a cast copy of
    ``rank × min(m, n)`` (galore-torch 1.0's ``get_orthogonal_matrix``)."""
    size = torch.empty((), dtype=dtype).element_size()
    if len(shape) != 2:
        return 2 * math.prod(shape) * size
    m, n = shape
    r, c = _proj_shape((m, n), rank)
    k = min(rank, min(m, n))
    proj = min(m, n) ** 2 * 4 if dtype == torch.float32 else k * min(m, n) * size
    return 2 * r * c * size + proj


def apollo_state_bytes(shape: tuple[int, ...], rank: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes APOLLOAdamW keeps for one projected matrix: AdamW's two states of the rank-``rank`` projection plus the
    random projection (rank × the shorter side) and one 0-d norm of the limiter; otherwise AdamW's two."""
    size = torch.empty((), dtype=dtype).element_size()
    if len(shape) != 2:
        return 2 * math.prod(shape) * size
    m, n = shape
    r, c = (m, rank) if m >= n else (rank, n)
    return (2 * r * c + rank * min(m, n)) * size + 4


def adafactor_state_bytes(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
    """Bytes ``torch.optim.Adafactor`` keeps for one parameter: a row and a column vector of the second moment for
    a tensor of 2 or more dimensions (the last two factored), a full variance for a vector; the 0-d step counter
    (4 bytes) included."""
    size = torch.empty((), dtype=dtype).element_size()
    if len(shape) < 2:
        return math.prod(shape) * size + 4
    lead = math.prod(shape[:-2])
    return lead * (shape[-2] + shape[-1]) * size + 4


def svd_workspace_bytes(shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
    """What GaLore's projection refresh allocates for one matrix beyond its state: the outputs of
    ``torch.linalg.svd(G, full_matrices=False)`` in fp32 (U: m × k, S: k, Vh: k × n, k = min(m, n)), plus an fp32
    copy of the gradient when it is not fp32. LAPACK's own scratch (inside the op) is not counted."""
    m, n = shape
    k = min(m, n)
    out = 4 * (m * k + k + k * n)
    return out + (4 * m * n if dtype != torch.float32 else 0)

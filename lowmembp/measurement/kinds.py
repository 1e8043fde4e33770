"""Which op kind a saved-for-backward tensor belongs to, decided by the module that is running when it is saved.

The kinds (:data:`KINDS`) are the paper's slices of activation memory, so that measured bytes compare with its
breakdown of a block (docs/design.md#papers): ``act`` (activation functions), ``norm``, ``attention`` (what an
attention module saves beyond its linears and norms), ``linear`` (a linear layer's input), ``product`` (what an MLP
module saves itself: the Hadamard product of gated MLPs) and ``other``. A module declares its kind with an attribute
``memory_kind``, or is classified by its type or class name; the innermost classified module of the running stack
decides, and attention and MLP modules claim what their unclassified children save. A storage saved under several
kinds counts under the first of :data:`PRIORITY`. The table of kinds and the rules in full: docs/measuring.md#op-kinds.
"""
from __future__ import annotations

import re

import torch.nn as nn

from lowmembp._compat import batch_norm_types, conv_types

KINDS = ("act", "norm", "attention", "linear", "product", "other")

# When one storage is saved by several ops (an MS-norm output that is also the next linear's input, an attention
# output that is also the projection's input) it is counted once, under the first kind in this order. Linear first
# matches the paper, which counts a shared norm output as the following linear's input.
PRIORITY = ("linear", "attention", "act", "norm", "product", "other")

_ACT_NAME = re.compile(r"(gelu\d*|silu\d*|swish|relu\d*|mish|sigmoid|tanh|softplus|elu|activation|gelutanh)$", re.I)
_NORM_NAME = re.compile(r"norm(\dd)?$", re.I)
_LINEAR_NAME = re.compile(r"(linear\w{0,8}|conv1d|conv2d)$", re.I)
_ATTN_NAME = re.compile(r"attention|attn$", re.I)
_MLP_NAME = re.compile(r"(mlp|feedforward|ffn|glu)$", re.I)
_NOT_ACT = ("Softmax", "Softmin", "LogSoftmax", "Softmax2d", "MultiheadAttention", "Identity")
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, *batch_norm_types(), nn.LocalResponseNorm,
               getattr(nn, "RMSNorm", nn.LayerNorm))
_LINEAR_TYPES = (nn.Linear, *conv_types(), nn.Bilinear)


def module_kind(module: nn.Module) -> str | None:
    """The kind a module stands for: one of ``KINDS``, ``"mlp"`` (a container that may save a product), or None."""
    declared = getattr(module, "memory_kind", None)
    if declared is not None:
        if declared not in KINDS and declared != "mlp":
            raise ValueError(f"{type(module).__name__}.memory_kind={declared!r} is not one of {KINDS + ('mlp',)}")
        return declared
    cls = type(module)
    name = cls.__name__
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    if name in _NOT_ACT:
        return None
    if isinstance(module, _LINEAR_TYPES) or _LINEAR_NAME.search(name):
        return "linear"
    if isinstance(module, _NORM_TYPES) or _NORM_NAME.search(name):
        return "norm"
    mod = cls.__module__
    if (mod == "torch.nn.modules.activation" or mod.startswith("transformers.activations")
            or mod.startswith("timm.layers.activations") or _ACT_NAME.search(name)):
        return "act"
    if _ATTN_NAME.search(name):
        return "attention"
    if _MLP_NAME.search(name):
        return "mlp"
    return None


def classify(stack: list[nn.Module], kind_cache: dict | None = None) -> str:
    """The kind of a tensor saved while the modules in ``stack`` (outermost first) are running."""
    for depth, module in enumerate(reversed(stack)):
        if kind_cache is not None:
            key = id(module)
            if key not in kind_cache:
                kind_cache[key] = module_kind(module)
            kind = kind_cache[key]
        else:
            kind = module_kind(module)
        if kind is None:
            continue
        if kind == "mlp":
            return "product" if depth == 0 else "other"
        return kind
    return "other"


def rank(kind: str) -> int:
    return PRIORITY.index(kind)

"""Which op kind a saved-for-backward tensor belongs to, decided by the module that is running when it is saved.

Kinds (the paper's slices of activation memory):

- ``act``       activation functions: GELU, SiLU, ReLU, ..., ReGELU2/ReSiLU2, timm and transformers activation classes
- ``norm``      LayerNorm / RMSNorm / LlamaRMSNorm / MSLayerNorm / MSRMSNorm / GroupNorm / BatchNorm
- ``attention`` everything saved inside an attention module except by its linears / norms (q, k, v, softmax,
                SDPA output and log-sum-exp, dropout masks, rotary cos/sin)
- ``linear``    the input a linear layer saves (nn.Linear, peft LoRA layers, convolutions, transformers Conv1D,
                quantised linears: any class whose name ends in ``Linear``)
- ``product``   tensors saved directly by an MLP module's own forward, i.e. not by one of its children: the
                Hadamard product ``act(gate(x)) * up(x)`` of LLaMA / SwiGLU MLPs
- ``other``     everything else (embeddings, dropout masks outside attention, residual scalings, the loss)

Rules, applied to the stack of modules running at the moment of the save, innermost first:

1. A module may declare its kind with an attribute ``memory_kind`` (one of the kinds above); that wins. Method
   modules that do not follow the naming rules below should set it.
2. Activation, norm and linear modules classify by type or class name (table below); the first such module from
   the inside decides. So a dropout inside a peft LoRA layer counts as ``linear``, and the qkv projection inside an
   attention module counts as ``linear``.
3. An attention module (class name contains ``Attention``) claims whatever its unclassified children save.
4. An MLP module (class name ends in ``Mlp``/``MLP``/``FeedForward``/``GLU``) claims what it saves *itself* as
   ``product``; what its unclassified children save (dropout masks) is ``other``.
5. Otherwise ``other``.
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

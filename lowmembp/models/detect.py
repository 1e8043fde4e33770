"""Small structural predicates shared by the architecture adapters: what kind of norm, activation or linear a module is.

A leaf module (imports nothing from lowmembp): ``layout.py``, the adapters and the data-flow tracer use it.

- :func:`act_kind`: ``"gelu"`` (erf), ``"gelu_tanh"``, ``"quick_gelu"``, ``"silu"``, ``"relu"``, ``"relu2"`` or None.
- :func:`norm_spec`: (kind, eps, γ offset) of a norm over the last dimension — ``"layernorm"`` or ``"rmsnorm"``;
  the offset is 1 for Gemma's ``x̂·(1 + w)`` form. Known classes by name/attributes; an unknown class with a 1-D
  ``weight`` whose name says "Norm" is probed numerically on a tiny float64 input (real tensors only).
- :func:`is_linear_like`: ``nn.Linear``, transformers ``Conv1D`` (GPT-2: ``x @ W + b``, W is in×out), or a peft
  wrapper around one.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

_GELU_ERF = {"GELU", "GELUActivation", "ReGELU2"}
_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation", "GELUPytorchTanh"}
_QUICK_GELU = {"QuickGELUActivation", "QuickGELU"}
_SILU = {"SiLU", "SiLUActivation", "Swish", "ReSiLU2"}
_RELU = {"ReLU"}
_RELU2 = {"ReLUSquaredActivation", "ReLUSquared"}
ACT_KINDS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu", "relu2")


def act_kind(m: nn.Module) -> str | None:
    """The element-wise activation ``m`` computes (one of :data:`ACT_KINDS`), or None when it is not one of them."""
    if not isinstance(m, nn.Module):
        return None
    name = type(m).__name__
    own = getattr(m, "kind", None)
    if (type(m).__module__ or "").startswith("lowmembp.ops") and isinstance(own, str) and own in ACT_KINDS:
        return own  # an already-converted approximate activation
    if name in _GELU_ERF:
        approx = getattr(m, "approximate", "none")
        return "gelu" if approx == "none" else ("gelu_tanh" if approx == "tanh" else None)
    if name in _GELU_TANH:
        return "gelu_tanh"
    if name in _QUICK_GELU:
        return "quick_gelu"
    if name in _SILU:
        return "silu"
    if name in _RELU:
        return "relu"
    if name in _RELU2:
        return "relu2"
    return None


def norm_eps(m: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _weight_1d(m: nn.Module):
    w = getattr(m, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.dim() == 1 else None


def norm_spec(m: nn.Module) -> tuple[str, float, float] | None:
    """``(kind, eps, gamma_offset)`` for a LayerNorm / RMSNorm over the last dimension, else None.

    The effective scale is ``weight + gamma_offset`` (``1 + w`` in Gemma 1/2/3); MS norms (already converted) are
    reported with their kind. Unknown classes are probed numerically (see the module docstring)."""
    if not isinstance(m, nn.Module):
        return None
    name = type(m).__name__
    if name == "MSLayerNorm":
        return "layernorm", float(m.eps), 0.0
    if name == "MSRMSNorm":
        return "rmsnorm", float(m.eps), 0.0
    if isinstance(m, nn.LayerNorm):
        if len(m.normalized_shape) != 1:
            return None
        return "layernorm", float(m.eps), 0.0
    if isinstance(m, nn.RMSNorm):
        if len(m.normalized_shape) != 1:
            return None
        eps = m.eps if m.eps is not None else torch.finfo(torch.float32).eps
        return "rmsnorm", float(eps), 0.0
    w = _weight_1d(m)
    if "Norm" not in name or w is None or norm_eps(m) is None:
        return None
    if name.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and getattr(m, "bias", None) is None \
            and "Gemma" not in name:
        return "rmsnorm", float(m.variance_epsilon), 0.0
    return _probe(m)


def _probe(m: nn.Module) -> tuple[str, float, float] | None:
    """Run a float64 copy of ``m`` on a random input and match it against the LayerNorm / RMSNorm formulas."""
    w = _weight_1d(m)
    if w is None or w.is_meta or type(w).__name__ == "FakeTensor":
        return None
    eps = norm_eps(m)
    try:
        probe = copy.deepcopy(m).double()
        g = torch.Generator().manual_seed(0)
        n = w.shape[0]
        with torch.no_grad():
            for p in probe.parameters():
                p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float64) + 0.5)
            x = torch.randn(3, n, generator=g, dtype=torch.float64) * 2 + 0.7
            y = probe(x)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                return None
            wt = probe.weight.detach()
            b = getattr(probe, "bias", None)
            b = b.detach() if isinstance(b, torch.Tensor) else 0.0
            xc = x - x.mean(-1, keepdim=True)
            ln = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
            rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            for kind, xhat in (("layernorm", ln), ("rmsnorm", rms)):
                for off in (0.0, 1.0):
                    if torch.allclose(y, xhat * (wt + off) + b, rtol=1e-6, atol=1e-8):
                        return kind, float(eps), off
    except Exception:  # a module that does not run on a bare 2-D input is not a plain norm
        return None
    return None


def norm_kind(m: nn.Module) -> str | None:
    """``"layernorm"`` / ``"rmsnorm"`` for a norm over the last dimension (see :func:`norm_spec`), else None."""
    spec = norm_spec(m)
    return spec[0] if spec else None


def is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): ``y = x @ W + b`` with W of shape in×out."""
    return type(m).__name__ == "Conv1D" and isinstance(getattr(m, "weight", None), torch.Tensor) \
        and m.weight.dim() == 2 and hasattr(m, "nf")


def is_plain_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def is_linear_like(m: nn.Module) -> bool:
    """``nn.Linear`` / ``Conv1D``, or a peft wrapper around one (LoRA layer with ``base_layer``,
    ``ModulesToSaveWrapper``)."""
    if is_plain_linear(m):
        return True
    inner = getattr(m, "base_layer", None) or getattr(m, "original_module", None)
    return isinstance(inner, nn.Module) and is_linear_like(inner)


def in_features(m: nn.Module) -> int | None:
    """The input width of a linear-like module."""
    while not is_plain_linear(m):
        m = getattr(m, "base_layer", None) or getattr(m, "original_module", None)
        if m is None:
            return None
    return m.in_features if isinstance(m, nn.Linear) else m.weight.shape[0]

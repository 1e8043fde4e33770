"""The MS-norms' PyTorch reference: forward statistics in fp32 and the backward from the output.

``ms_norm_fwd_ref(x, kind, eps, out_dtype=None) -> (y of x's shape, rstd [rows] fp32)`` and
``ms_norm_bwd_ref(g, y, rstd, kind, dx_dtype) -> dx of y's shape`` over the last dimension (``kind`` is
``"layernorm"`` or ``"rmsnorm"``; the formulas: :mod:`lowmembp.ops.ms_norm`). The oracle of the other backends: the
CPU fast path (:mod:`~lowmembp.ops.ms_norm_cpu`) gives its bits, the Triton kernels
(:mod:`~lowmembp.ops.ms_norm_triton`) its values to rounding.
"""
from __future__ import annotations

import math

import torch

from lowmembp._compat import fused_rms_norm

KINDS = ("layernorm", "rmsnorm")


def _check_kind(kind: str) -> bool:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind == "rmsnorm"


def ms_norm_fwd_ref(x: torch.Tensor, kind: str, eps: float, out_dtype: torch.dtype | None = None):
    """PyTorch forward over the last dim, statistics in fp32: (y of x's shape in out_dtype, rstd [rows] fp32).

    float64 input is computed (and rstd returned) in float64: the tests check the formulas that way."""
    is_rms = _check_kind(kind)
    out_dtype = out_dtype or x.dtype
    n = x.shape[-1]
    n_rows = math.prod(x.shape[:-1])
    if x.numel() == 0:
        return (torch.empty(x.shape, dtype=out_dtype, device=x.device),
                torch.full((n_rows,), float(eps) ** -0.5, dtype=torch.promote_types(x.dtype, torch.float32),
                           device=x.device))
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if not is_rms:
        y, _, rstd = torch.native_layer_norm(xf, [n], None, None, eps)
    else:  # torch's fused kernel where it has the expected signature, else the same math in plain ops
        y, rstd = fused_rms_norm(xf, eps)
    return y.to(out_dtype), rstd.reshape(n_rows)


def ms_norm_bwd_ref(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, kind: str, dx_dtype: torch.dtype):
    """PyTorch backward from the output, in fp32 (float64 for float64 inputs): dx of y's shape in dx_dtype."""
    is_rms = _check_kind(kind)
    n = y.shape[-1]
    if y.numel() == 0:
        return torch.empty(y.shape, dtype=dx_dtype, device=y.device)
    acc = torch.promote_types(torch.promote_types(y.dtype, rstd.dtype), torch.float32)
    gf, yf = g.to(acc), y.to(acc)
    buf = gf * yf
    mgy = buf.sum(-1, keepdim=True).div_(n)
    dx = torch.addcmul(gf, yf, mgy, value=-1.0, out=buf)  # g - y*mean(g*y), reusing the g*y buffer
    if not is_rms:
        dx.sub_(gf.mean(-1, keepdim=True))
    dx.mul_(rstd.reshape(mgy.shape))
    return dx.to(dx_dtype)

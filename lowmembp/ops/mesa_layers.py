"""Mesa layers: modules whose forward is exact and whose backward runs on 8-bit copies of what it needs.

Each layer keeps, for backward, what :mod:`lowmembp.ops.mesa_quant` saves — 1 byte per element plus 8 bytes per
group — instead of the full-precision tensor, and runs the exact backward on the dequantised copy:

| layer | saves (8-bit) | also saves | groups |
|---|---|---|---|
| :class:`MesaLinear` (an ``nn.Linear``) | input (only when the weight is trained) | weight (a parameter) | channel |
| :class:`MesaAct` (GELU erf/tanh, SiLU) | input | — | channel |
| :class:`MesaLayerNorm` (an ``nn.LayerNorm``) | input | mean, rstd (fp32, one per row) | channel |
| :class:`MesaRMSNorm` (LLaMA-style RMSNorm) | input | rstd (fp32, one per row) | channel |
| :class:`MesaSoftmax` | output | — | head |
| :class:`MesaMatMul` | both operands | — | head ([B, H, ·, ·]) |

A frozen linear (a LoRA base layer) needs no input for backward and saves nothing but its weight reference.
Without grad (eval, ``torch.no_grad``) every layer runs the plain op. Under autocast each layer computes in the
dtype autocast would use (linear / matmul: the autocast dtype; norms and softmax: fp32), so outputs match.
Every layer has its own :class:`~lowmembp.ops.mesa_quant.EMAQuantizer` (non-persistent buffers).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function

from lowmembp.ops.backend import autocast_dtype, device_type
from lowmembp.ops.mesa_quant import EMAQuantizer, QTensor, channel_groups, dequantize

DEFAULT_GROUPS = 8


def _autocast_off(x: torch.Tensor, cd: torch.dtype | None):
    """Autocast turned off for the block where it is on (``cd``: :func:`lowmembp.ops.backend.autocast_dtype`); else
    nothing to do."""
    return torch.autocast(device_type(x), enabled=False) if cd is not None else contextlib.nullcontext()


def _needs_graph(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _save(ctx, qts: list[QTensor], *extra):
    ctx.qmeta = [(q.inner, q.groups, q.dtype) for q in qts]
    flat = [t for q in qts for t in q.tensors()]
    ctx.save_for_backward(*flat, *extra)


def _load(ctx):
    saved = ctx.saved_tensors
    n = 3 * len(ctx.qmeta)
    qts = [QTensor(*saved[3 * i:3 * i + 3], *meta) for i, meta in enumerate(ctx.qmeta)]
    return [dequantize(q) for q in qts], saved[n:]


# ------------------------------------------------------------------------------------------------------------ Linear
class _LinearFn(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quant):
        cd = autocast_dtype(x)
        with _autocast_off(x, cd):
            xc = x.to(cd) if cd else x
            w = weight.to(cd) if cd else weight
            b = bias.to(cd) if (cd and bias is not None) else bias
            y = F.linear(xc, w, b)
        ctx.cd, ctx.x_dtype, ctx.has_bias = cd, x.dtype, bias is not None
        ctx.b_dtype = bias.dtype if bias is not None else None
        _save(ctx, [quant.pack(xc)] if ctx.needs_input_grad[1] else [], weight)
        return y

    @staticmethod
    def backward(ctx, g):
        (xh, *_), (weight,) = _load(ctx) if ctx.needs_input_grad[1] else ([None], ctx.saved_tensors)
        w = weight.to(g.dtype)
        gx = gw = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[0]:
            gx = g.matmul(w).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gw = g2.t().matmul(xh.reshape(-1, xh.shape[-1]).to(g.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(ctx.b_dtype)
        return gx, gw, gb, None


class MesaLinear(nn.Linear):
    """``nn.Linear`` saving an 8-bit input (channel groups) when its weight is trained. Shares the parameters."""

    # its forward is F.linear(x, weight, bias) exactly (only what backward saves differs), so a method that computes
    # the layer itself from its weight (chunked-ce's lm_head) may take it as a plain linear
    computes_linear = True

    @classmethod
    def from_linear(cls, lin: nn.Linear, groups: int = DEFAULT_GROUPS) -> "MesaLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias
        new.quant = EMAQuantizer(channel_groups(lin.in_features, groups)).to(lin.weight.device)
        return new

    def forward(self, x):
        if not _needs_graph(x, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        return _LinearFn.apply(x, self.weight, self.bias, self.quant)


# ------------------------------------------------------------------------------------------------------- activations
def _approx(kind: str) -> str:
    return "tanh" if kind == "gelu_tanh" else "none"


class _ActFn(Function):
    @staticmethod
    def forward(ctx, x, kind, quant):
        y = F.silu(x) if kind == "silu" else F.gelu(x, approximate=_approx(kind))
        ctx.kind = kind
        _save(ctx, [quant.pack(x)])
        return y

    @staticmethod
    def backward(ctx, g):
        (xh,), _ = _load(ctx)
        xh = xh.to(g.dtype)
        if ctx.kind == "silu":
            gx = torch.ops.aten.silu_backward(g, xh)
        else:
            gx = torch.ops.aten.gelu_backward(g, xh, approximate=_approx(ctx.kind))
        return gx, None, None


class MesaAct(nn.Module):
    """GELU (``kind="gelu"`` erf, ``"gelu_tanh"``) or SiLU (``"silu"``) saving an 8-bit input."""

    def __init__(self, kind: str = "gelu", groups: int = DEFAULT_GROUPS):
        super().__init__()
        if kind not in ("gelu", "gelu_tanh", "silu"):
            raise ValueError(f"MesaAct kind must be 'gelu', 'gelu_tanh' or 'silu', got {kind!r}")
        self.kind = kind
        self.quant = EMAQuantizer(groups)  # shrinks to gcd(channels, groups) on the first call

    def extra_repr(self):
        return f"kind={self.kind}"

    def forward(self, x):
        if not _needs_graph(x):
            return F.silu(x) if self.kind == "silu" else F.gelu(x, approximate=_approx(self.kind))
        return _ActFn.apply(x, self.kind, self.quant)


# ------------------------------------------------------------------------------------------------------------- norms
class _LayerNormFn(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, quant):
        cd = autocast_dtype(x)
        xc = x.float() if cd is not None else x
        with _autocast_off(x, cd):
            y, mean, rstd = torch.native_layer_norm(xc, shape, weight, bias, eps)
        ctx.shape, ctx.x_dtype = shape, x.dtype
        _save(ctx, [quant.pack(xc)], mean, rstd, weight, bias)
        return y

    @staticmethod
    def backward(ctx, g):
        (xh,), (mean, rstd, weight, bias) = _load(ctx)
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(g.to(xh.dtype), xh, ctx.shape, mean, rstd,
                                                               weight, bias, mask)
        return (gx.to(ctx.x_dtype) if gx is not None else None), gw, gb, None, None, None


class MesaLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim, saving an 8-bit input plus mean/rstd. Shares the parameters."""

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, groups: int = DEFAULT_GROUPS) -> "MesaLayerNorm":
        if len(ln.normalized_shape) != 1:
            raise ValueError(f"MesaLayerNorm supports normalisation over the last dim only, got {ln.normalized_shape}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = ln.normalized_shape, ln.eps, ln.elementwise_affine
        new.weight, new.bias = ln.weight, ln.bias
        dev = ln.weight.device if ln.weight is not None else None
        new.quant = EMAQuantizer(channel_groups(ln.normalized_shape[0], groups)).to(dev)
        return new

    def forward(self, x):
        if not _needs_graph(x, self.weight, self.bias):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return _LayerNormFn.apply(x, self.weight, self.bias, list(self.normalized_shape), self.eps, self.quant)


class _RMSNormFn(Function):
    @staticmethod
    def forward(ctx, x, weight, eps, quant):
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        y = weight * (h * rstd).to(x.dtype)
        ctx.x_dtype = x.dtype
        _save(ctx, [quant.pack(x)], rstd, weight)
        return y

    @staticmethod
    def backward(ctx, g):
        (xh,), (rstd, weight) = _load(ctx)
        n = xh.float() * rstd
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g * n.to(ctx.x_dtype)).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        gn = (g * weight).float()
        gx = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx.to(ctx.x_dtype), gw, None, None


class MesaRMSNorm(nn.Module):
    """LLaMA-style RMSNorm ``γ·(x·rsqrt(mean(x²)+eps)).to(x.dtype)`` saving an 8-bit input plus rstd."""

    def __init__(self, weight: nn.Parameter, eps: float, groups: int = DEFAULT_GROUPS):
        super().__init__()
        self.weight, self.variance_epsilon = weight, float(eps)
        self.quant = EMAQuantizer(channel_groups(weight.shape[-1], groups)).to(weight.device)

    @classmethod
    def from_rmsnorm(cls, norm: nn.Module, groups: int = DEFAULT_GROUPS) -> "MesaRMSNorm":
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None or getattr(norm, "weight", None) is None:
            raise ValueError(f"{type(norm).__name__} is not a LLaMA-style RMSNorm (needs weight and variance_epsilon)")
        return cls(norm.weight, eps, groups)

    def forward(self, x):
        if not _needs_graph(x, self.weight):
            h = x.float()
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)
        return _RMSNormFn.apply(x, self.weight, self.variance_epsilon, self.quant)


# --------------------------------------------------------------------------------------------------------- attention
class _SoftmaxFn(Function):
    @staticmethod
    def forward(ctx, x, out_dtype, quant):
        y = torch.softmax(x.float(), dim=-1).to(out_dtype)
        ctx.x_dtype = x.dtype
        _save(ctx, [quant.pack(y)])
        return y

    @staticmethod
    def backward(ctx, g):
        (yh,), _ = _load(ctx)
        yh, gf = yh.float(), g.float()
        gx = yh * (gf - (gf * yh).sum(-1, keepdim=True))
        return gx.to(ctx.x_dtype), None, None


class MesaSoftmax(nn.Module):
    """Softmax over the last dim of [B, H, N, M] scores, computed in fp32, saving an 8-bit output (per head).

    The output dtype is ``out_dtype`` when given, else the input's dtype.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.quant = EMAQuantizer(num_heads, mode="head")

    def forward(self, x, out_dtype: torch.dtype | None = None):
        out_dtype = out_dtype or x.dtype
        if not _needs_graph(x):
            return torch.softmax(x.float(), dim=-1).to(out_dtype)
        return _SoftmaxFn.apply(x, out_dtype, self.quant)


class _MatMulFn(Function):
    @staticmethod
    def forward(ctx, a, b, qa, qb):
        cd = autocast_dtype(a)
        with _autocast_off(a, cd):
            ac, bc = (a.to(cd), b.to(cd)) if cd else (a, b)
            y = ac.matmul(bc)
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        # dA needs B, dB needs A
        qts = ([qb.pack(bc)] if ctx.need[0] else []) + ([qa.pack(ac)] if ctx.need[1] else [])
        _save(ctx, qts)
        return y

    @staticmethod
    def backward(ctx, g):
        deq, _ = _load(ctx)
        ga = gb = None
        i = 0
        if ctx.need[0]:
            ga = g.matmul(deq[i].to(g.dtype).transpose(-2, -1)).to(ctx.dtypes[0])
            i += 1
        if ctx.need[1]:
            gb = deq[i].to(g.dtype).transpose(-2, -1).matmul(g).to(ctx.dtypes[1])
        return ga, gb, None, None


class MesaMatMul(nn.Module):
    """``a @ b`` for [B, H, ·, ·] operands of equal batch shape, saving each operand in 8 bits (per head)."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.quant_a = EMAQuantizer(num_heads, mode="head")
        self.quant_b = EMAQuantizer(num_heads, mode="head")

    def forward(self, a, b):
        if not _needs_graph(a, b):
            return a.matmul(b)
        if a.dim() != 4 or b.dim() != 4 or a.shape[:2] != b.shape[:2]:
            raise ValueError(f"MesaMatMul needs [B, H, ., .] operands with equal B, H; got {tuple(a.shape)} "
                             f"and {tuple(b.shape)}")
        return _MatMulFn.apply(a, b, self.quant_a, self.quant_b)

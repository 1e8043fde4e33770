"""A linear layer that saves a random projection of its input (CompAct, Shamshoum et al., NAACL 2025).

    y = compact_linear(x, weight, bias, rank=r, seed=s)

The forward ``y = x·Wᵀ + b`` is exact. For the backward it keeps ``z = x·P`` (``N × r`` for the ``N`` rows of ``x``)
instead of ``x`` (``N × d_in``), with ``P`` a ``d_in × r`` Gaussian matrix of entries ``N(0, 1/r)``, so
``E[P·Pᵀ] = I``; ``P`` is not kept but drawn again from ``seed`` in the backward. ``dx = dy·W`` and ``db = Σ dy`` are
exact; ``dW = (dyᵀ·z)·Pᵀ`` is an unbiased estimate of ``dyᵀ·x`` whose variance falls as ``1/r``. Linears reading the
same input can share one ``z`` (``z=``), each weight gradient staying unbiased; a frozen weight keeps nothing of the
input. What is saved, autocast, and the method built on it: docs/methods/compact.md.

May import: torch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["compact_linear", "projection", "project", "CompActLinearFn"]


def projection(d_in: int, rank: int, seed: int, device, dtype=torch.float32) -> torch.Tensor:
    """The ``d_in × rank`` matrix of entries ``N(0, 1/rank)`` drawn from ``seed`` (the same on every call)."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    p = torch.randn((d_in, rank), generator=g, dtype=torch.float32) / math.sqrt(rank)
    return p.to(device=device, dtype=dtype)


class CompActLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, z, rank: int, seed: int):
        y = F.linear(x, weight, bias)
        ctx.rank, ctx.seed, ctx.x_shape, ctx.has_bias = rank, seed, x.shape, bias is not None
        ctx.weight_grad = z is not None
        ctx.save_for_backward(*((z, weight) if z is not None else (weight,)))
        return y

    @staticmethod
    def backward(ctx, gy):
        if ctx.weight_grad:
            z, weight = ctx.saved_tensors
        else:
            (weight,) = ctx.saved_tensors
        gx = gw = gb = None
        g2 = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[0]:
            dt = torch.promote_types(gy.dtype, weight.dtype)
            gx = (g2.to(dt) @ weight.to(dt)).to(gy.dtype).reshape(*ctx.x_shape[:-1], weight.shape[1])
        if ctx.weight_grad and ctx.needs_input_grad[1]:
            p = projection(weight.shape[1], ctx.rank, ctx.seed, gy.device)
            gw = ((g2.float().t() @ z.float()) @ p.t()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.float().sum(0).to(weight.dtype)
        return gx, gw, gb, None, None, None


def project(x: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    """``x·P`` over the last dimension, as the ``N × rank`` rows a CompAct linear keeps (no graph)."""
    with torch.no_grad():
        x2 = x.reshape(-1, x.shape[-1])
        return x2 @ projection(x.shape[-1], rank, seed, x.device, x2.dtype)


def compact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, rank: int,
                   seed: int, z: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` that saves ``x·P`` (module doc) for the weight gradient. ``z``: that projection
    already made (by :func:`project` with the same ``rank`` and ``seed``) for another linear reading the same ``x``:
    shared, so the linears of one input keep one projection between them."""
    if torch.is_autocast_enabled(x.device.type):
        dt = torch.get_autocast_dtype(x.device.type)
        x = x.to(dt)
        weight, bias = _cast(weight, dt), _cast(bias, dt)
    if weight.requires_grad and z is None:
        z = project(x, rank, seed)
    with torch.autocast(x.device.type, enabled=False):
        return CompActLinearFn.apply(x, weight, bias, z if weight.requires_grad else None, rank, seed)


def _cast(t, dt):
    return t if t is None or t.dtype == dt else t.to(dt)

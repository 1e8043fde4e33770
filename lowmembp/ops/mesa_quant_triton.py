"""The Mesa quantiser's Triton kernels and their launches (CUDA tensors; CPU ones under Triton's interpreter).

One element per lane, 1024 per program, launched from :mod:`lowmembp.ops.launch`'s cache. The quantiser's seed is an
int, or a 0-d integer tensor on x's device that the kernel reads there (no host synchronisation; a CUDA graph replays
it with a new value). The formulas and the counter-based uniforms are the reference's
(:mod:`~lowmembp.ops.mesa_quant_reference`).
"""
from __future__ import annotations

import torch

from lowmembp.ops.launch import Launcher

try:  # pragma: no cover - triton is optional on CPU machines
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None


_BLOCK = 1024

if triton is not None:
    @triton.jit
    def _index_block(n, BLOCK: tl.constexpr):
        """This program's BLOCK element offsets (64-bit) and the mask of those below n."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        return offs, offs < n

    @triton.jit
    def _mesa_quant_kernel(X, Q, SCALE, BETA, n, inner, G, seed, SEED_PTR: tl.constexpr, BLOCK: tl.constexpr):
        offs, mask = _index_block(n, BLOCK)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        g = (offs // inner) % G
        s = tl.load(SCALE + g, mask=mask, other=1.0)
        b = tl.load(BETA + g, mask=mask, other=0.0)
        # counter-based uniform: lowbias32(i * golden + seed), 24 high bits -> [0, 1)
        h = (offs & 0xFFFFFFFF).to(tl.uint32)
        if SEED_PTR:  # a 0-d int64 tensor on the device (drawn there: a CUDA graph replays it with a new value)
            s32 = tl.load(seed).to(tl.uint32)
        else:
            s32 = tl.cast(seed, tl.uint32)
        h = h * tl.cast(0x9E3779B9, tl.uint32) + s32
        h = h ^ (h >> 16)
        h = h * tl.cast(0x7FEB352D, tl.uint32)
        h = h ^ (h >> 15)
        h = h * tl.cast(0x846CA68B, tl.uint32)
        h = h ^ (h >> 16)
        u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08
        y = (x - b) * s
        q = tl.floor(y + u)
        q = tl.minimum(tl.maximum(q, 0.0), 255.0)
        tl.store(Q + offs, q.to(tl.uint8), mask=mask)

    @triton.jit
    def _mesa_dequant_kernel(Q, Y, STEP, BETA, n, inner, G, BLOCK: tl.constexpr):
        offs, mask = _index_block(n, BLOCK)
        q = tl.load(Q + offs, mask=mask, other=0).to(tl.float32)
        g = (offs // inner) % G
        st = tl.load(STEP + g, mask=mask, other=0.0)
        b = tl.load(BETA + g, mask=mask, other=0.0)
        y = q * st + b
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    _QUANT = Launcher(_mesa_quant_kernel)
    _DEQUANT = Launcher(_mesa_dequant_kernel)


def _quantize_triton(x, scale, beta, inner, groups, seed):
    """``seed``: an int, or a 0-d integer tensor on x's device that the kernel reads (graph-safe)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("the Triton backend needs triton installed; set LOWMEMBP_BACKEND=torch")
    codes = torch.empty_like(x, dtype=torch.uint8)
    n = x.numel()
    if n:
        on_device = isinstance(seed, torch.Tensor)
        if on_device and seed.device != x.device:
            seed, on_device = int(seed), False  # a CPU seed: read here (no device sync)
        _QUANT(-(-n // _BLOCK), (x, codes, scale, beta, n, inner, groups,
                                seed if on_device else int(seed) & 0x7FFFFFFF), (on_device, _BLOCK), 4,
               x.get_device())
    return codes


def _dequantize_triton(codes, step, beta, inner, groups, dtype):
    if triton is None:  # pragma: no cover
        raise RuntimeError("the Triton backend needs triton installed; set LOWMEMBP_BACKEND=torch")
    out = torch.empty_like(codes, dtype=dtype)
    n = codes.numel()
    if n:
        _DEQUANT(-(-n // _BLOCK), (codes, out, step, beta, n, inner, groups), (_BLOCK,), 4, codes.get_device())
    return out

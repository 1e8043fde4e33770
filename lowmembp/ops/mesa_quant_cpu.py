"""The Mesa quantiser's CPU fast path (the default on CPU tensors) and its eager fallback.

The reference's arithmetic, bit for bit, in one pass of the C kernels (:mod:`lowmembp.ops.cpu_kernels`, compiled on
first use: the hash in wrapping uint32 arithmetic, each group's scale and β per row of ``inner`` elements). Without them
(no compiler, ``LOWMEMBP_CPU_KERNELS=0``) eager ATen ops give the same bits: blocks of whole group rows (``inner``
consecutive elements share a group) that stay in the core's cache, each group's scale and β broadcast over its row (no
per-element index or gather), and the hash in 32-bit integers (wrapping multiplies and adds are the reference's
arithmetic modulo 2³²; a masked arithmetic shift is its logical shift), in place in preallocated buffers.
The reference is :mod:`~lowmembp.ops.mesa_quant_reference`'s.
"""
from __future__ import annotations

import torch

from lowmembp.ops import cpu_kernels
from lowmembp.ops.backend import CPU_BLOCK, SUPPORTED_FLOAT_DTYPES, cpu_block, cpu_parallel, is_shape_only
from lowmembp.ops.mesa_quant_reference import _GOLDEN, _H1, _H2, _MASK32

_CPU_BLOCK = CPU_BLOCK  # elements per block; the blocks are spread over threads by cpu_parallel


def _s32(v: int) -> int:
    """``v`` modulo 2³² as a signed 32-bit value (what an int32 tensor holds for it)."""
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _golden_ramp(m: int) -> torch.Tensor:
    """``i·0x9E3779B9 mod 2³²`` for i < m (int32): the part of the hash's first step that is the same in every block."""
    return torch.arange(m, dtype=torch.int32).mul_(_s32(_GOLDEN))


def _hash_uniform_into(u: torch.Tensor, h: torch.Tensor, t: torch.Tensor, golden_ramp: torch.Tensor, start: int,
                       seed: int) -> torch.Tensor:
    """:func:`hash_uniform` for indices ``start .. start + len(u) - 1`` written into fp32 ``u`` (``h``, ``t``: int32
    scratch of u's length; ``golden_ramp``: :func:`_golden_ramp` of that length)."""
    torch.add(golden_ramp, _s32(start * _GOLDEN + (int(seed) & _MASK32)), out=h)
    for shift, mul in ((16, _H1), (15, _H2), (16, None)):
        torch.bitwise_right_shift(h, shift, out=t)
        t.bitwise_and_((1 << (32 - shift)) - 1)  # the arithmetic shift's sign copies cleared: a logical shift
        h.bitwise_xor_(t)
        if mul is not None:
            h.mul_(_s32(mul))
    torch.bitwise_right_shift(h, 8, out=t)
    t.bitwise_and_(0xFFFFFF)
    return u.copy_(t).mul_(2.0 ** -24)


def _group_rows(start_row: int, rows: int, groups: int, table: torch.Tensor) -> torch.Tensor:
    """``table[(start_row + r) % groups]`` for r < rows, as a [rows, 1] column (one group per row of ``inner``)."""
    g = torch.arange(start_row, start_row + rows) % groups
    return table.index_select(0, g).reshape(rows, 1)


def _blocks(lo: int, hi: int, inner: int, block: int):
    """(start, rows, row length) of blocks covering ``[lo, hi)``: whole rows of ``inner`` elements (``lo`` a multiple
    of ``inner``), or pieces of one row where a row is longer than a block."""
    if inner <= block:
        step = (block // inner) * inner
        for s in range(lo, hi, step):
            e = min(s + step, hi)
            yield s, (e - s) // inner, inner
    else:
        s = lo
        while s < hi:
            length = min(block, inner - s % inner, hi - s)
            yield s, 1, length
            s += length


def _spread(n: int, inner: int, work) -> None:
    """``work(lo, hi, block)`` over ``[0, n)`` on the threads, the ranges made of whole rows (or of blocks)."""
    block = cpu_block(_CPU_BLOCK)
    align = min(inner, block)
    cpu_parallel(n, align, lambda lo, hi: work(lo, hi, block), 2 * block)


def quantize_cpu(x: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                 seed: int) -> torch.Tensor:
    """CPU fast path of :func:`quantize_ref` (same arguments, the same codes bit for bit)."""
    flat = x.reshape(-1)
    n = flat.numel()
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    if is_shape_only(x) or n == 0:
        return out.reshape(x.shape)
    scale, beta = scale.float().reshape(-1).contiguous(), beta.float().reshape(-1).contiguous()
    if cpu_kernels.quantize8(flat, inner, groups, scale, beta, seed, out) == 0:  # one C pass (None: unavailable)
        return out.reshape(x.shape)  # (1: a NaN before the clamp, whose code is ATen's conversion: the eager ops)

    def work(lo, hi, block):
        m = min(block, hi - lo)  # every block is at most this long
        y, u = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.float32)
        h, t = torch.empty(m, dtype=torch.int32), torch.empty(m, dtype=torch.int32)
        ramp = _golden_ramp(m)
        for s, rows, length in _blocks(lo, hi, inner, block):
            e = rows * length
            yb = y[:e].view(rows, length)
            xb = flat[s:s + e].view(rows, length)
            row = s // inner
            if xb.dtype == torch.float32:
                torch.sub(xb, _group_rows(row, rows, groups, beta), out=yb)
            else:
                yb.copy_(xb).sub_(_group_rows(row, rows, groups, beta))  # x in fp32, then x − β
            yb.mul_(_group_rows(row, rows, groups, scale))  # (x − β)·scale
            ub = _hash_uniform_into(u[:e], h[:e], t[:e], ramp[:e], s, seed)
            yb = y[:e].add_(ub).floor_().clamp_(0, 255)
            out[s:s + e].copy_(yb)

    _spread(n, inner, work)
    return out.reshape(x.shape)


def _plain_groups(t: torch.Tensor, groups: int) -> bool:
    """Whether ``t`` is what the C kernels read as per-group values: a contiguous fp32 CPU tensor of ``groups``."""
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() and t.numel() == groups


def dequantize_cpu(codes: torch.Tensor, step: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """CPU fast path of :func:`dequantize_ref` (same arguments, the same values bit for bit)."""
    n = codes.numel()
    if n == 0 or codes.is_meta or (type(codes) is not torch.Tensor and is_shape_only(codes)):
        return torch.empty(codes.shape, dtype=dtype, device=codes.device)
    if codes.is_contiguous() and codes.is_cpu and codes.dtype == torch.uint8 and dtype in SUPPORTED_FLOAT_DTYPES:
        out = torch.empty_like(codes, dtype=dtype)  # contiguous as the codes
        # one C pass (None: unavailable) with step and β of any shape with G entries, read as contiguous fp32
        st = step if _plain_groups(step, groups) else step.float().reshape(-1).contiguous()
        be = beta if _plain_groups(beta, groups) else beta.float().reshape(-1).contiguous()
        nan = None
        if st.numel() == groups and be.numel() == groups and st.is_cpu and be.is_cpu:
            nan = cpu_kernels.dequantize8_trusted(codes, n, inner, groups, st, be, out)
        if nan == 0 or (nan == 1 and dtype == torch.float32):  # a NaN in fp16 / bf16: ATen's rounding, the eager ops
            return out
    else:
        out = torch.empty(codes.shape, dtype=dtype)
    flat, out_shape, out = codes.reshape(-1), out.shape, out.reshape(-1)
    step, beta = step.float().reshape(-1).contiguous(), beta.float().reshape(-1).contiguous()

    def work(lo, hi, block):
        y = torch.empty(min(block, hi - lo), dtype=torch.float32)
        for s, rows, length in _blocks(lo, hi, inner, block):
            e = rows * length
            yb = y[:e].view(rows, length).copy_(flat[s:s + e].view(rows, length))  # q in fp32
            row = s // inner
            yb.mul_(_group_rows(row, rows, groups, step))
            ob = out[s:s + e].view(rows, length)
            if dtype == torch.float32:
                torch.add(yb, _group_rows(row, rows, groups, beta), out=ob)
            else:
                ob.copy_(yb.add_(_group_rows(row, rows, groups, beta)))

    _spread(n, inner, work)
    return out.reshape(out_shape)

"""Approx-BP activations ReGELU2 and ReSiLU2 (Yang et al., ICML 2024, arXiv 2406.16282; DESIGN.md §2.1).

Forward is exact: GELU in its erf form ``0.5·x·(1 + erf(x/√2))`` or SiLU ``x·sigmoid(x)``, computed in fp32 and cast
back to the input dtype. Alongside, each element gets a 2-bit code ``[x > c1] + [x > c2] + [x > c3]`` (compared in
fp32 against the constants rounded to fp32), packed four per ``uint8``: element i sits in byte i // 4, bits 2·(i % 4)
and 2·(i % 4) + 1, least significant first.

Saved for backward: the packed codes only, ``ceil(N / 4)`` bytes, i.e. 0.25 byte per element (against 2 for a bf16 or 4
for an fp32 input that ``F.gelu`` / ``F.silu`` save). Shape and dtype are kept on ``ctx`` as Python values.
Backward: ``dx = dy · s[code]`` with ``s = (0, a1, a1 + a2, a1 + a2 + a3)`` in fp32, cast back to dy's dtype. It is
the derivative of the piecewise-linear ``h̃(x) = Σ a_i·max(x − c_i, 0)`` fitted to the activation, not of the
activation itself: that approximation is the method.

Backends (``lowmembp._backend.backend_for``): Triton kernels on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1`` with ``LOWMEMBP_BACKEND=triton``), the PyTorch reference otherwise, and always for fake / meta
tensors (paper-scale memory estimates under FakeTensorMode; the reference saves the same ceil(N/4) bytes). Both give bitwise-equal
codes and gradients; forward outputs agree to fp32 rounding of erf/exp.
"""
from __future__ import annotations

import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowmembp._backend import backend_for, check_float_input, is_shape_only

try:  # triton is optional on CPU-only installs; the reference path needs none of it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing or broken
    triton = None
    tl = None

__all__ = [
    "REGELU2_C", "REGELU2_A", "RESILU2_C", "RESILU2_A", "slopes",
    "regelu2", "resilu2", "ReGELU2", "ReSiLU2",
    "pack_codes", "unpack_codes", "codes_reference", "forward_reference", "backward_reference",
]

# Published constants: the authors' released reference implementation of arXiv 2406.16282
# (github.com/yyyyychen/LowMemoryBP, ReGELU2 / ReSiLU2), copied in DESIGN.md §2.1. They minimise
# ∫ (h − Σ a_i·max(x − c_i, 0))² dx over [−6.07, 6.07] (GELU) / [−38.2, 38.2] (SiLU) with Σ a_i = 1, Σ a_i·c_i = 0;
# tests/test_approx_act.py re-minimises that objective from these values and checks they do not move.
REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
RESILU2_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)
RESILU2_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)

_GELU, _SILU = 0, 1
_CONSTS = {_GELU: (REGELU2_C, REGELU2_A), _SILU: (RESILU2_C, RESILU2_A)}
_NAMES = {_GELU: "regelu2", _SILU: "resilu2"}


def slopes(a) -> tuple[float, float, float, float]:
    """The backward's slope per code, ``s = (0, a1, a1 + a2, a1 + a2 + a3)``, summed in float64."""
    return (0.0, a[0], a[0] + a[1], a[0] + a[1] + a[2])


def _fp32(v: float) -> float:
    """Round a Python float to the nearest fp32 value (what both backends compare and multiply with).

    Pure Python (no tensor), so it also works under FakeTensorMode."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


_C32 = {k: tuple(_fp32(c) for c in cs) for k, (cs, _) in _CONSTS.items()}
_S32 = {k: tuple(_fp32(s) for s in slopes(a)) for k, (_, a) in _CONSTS.items()}


# ----------------------------------------------------------------------------------------------- PyTorch reference


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in {0..3} (any shape, read in flat order) four per byte: returns ``ceil(N/4)`` uint8."""
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    nbytes = (n + 3) // 4
    buf = torch.zeros(nbytes * 4, dtype=torch.uint8, device=flat.device)
    buf[:n] = flat
    if sys.byteorder != "little":  # pragma: no cover - every torch platform today is little-endian
        q = buf.view(-1, 4).to(torch.int32)
        return (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).to(torch.uint8)
    # Read four code bytes as one little-endian int32 (byte j at bits 8j, 8j+1) and move byte j to bits 2j, 2j+1.
    v = buf.view(torch.int32)
    return ((v | (v >> 6) | (v >> 12) | (v >> 18)) & 0xFF).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``n`` codes as a flat uint8 tensor."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != (n + 3) // 4:
        raise ValueError(f"unpack_codes: expected a 1-D uint8 tensor of {(n + 3) // 4} bytes for n={n}, "
                         f"got {packed.dtype} of shape {tuple(packed.shape)}")
    if sys.byteorder != "little":  # pragma: no cover
        shifts = torch.arange(0, 8, 2, device=packed.device, dtype=torch.int32)
        return ((packed.to(torch.int32)[:, None] >> shifts) & 3).to(torch.uint8).reshape(-1)[:n]
    v = packed.to(torch.int32)
    v = (v | (v << 6) | (v << 12) | (v << 18)) & 0x03030303  # bits 2j, 2j+1 -> byte j
    return v.view(torch.uint8)[:n]


def codes_reference(x: torch.Tensor, c) -> torch.Tensor:
    """Unpacked codes ``[x > c1] + [x > c2] + [x > c3]`` (uint8, x's shape), compared in fp32."""
    xf = x.float()
    c32 = [_fp32(v) for v in c]
    return (xf > c32[0]).to(torch.uint8) + (xf > c32[1]).to(torch.uint8) + (xf > c32[2]).to(torch.uint8)


def _packed_codes(xf: torch.Tensor, c) -> torch.Tensor:
    """Packed codes of fp32 ``xf`` in few whole-tensor passes: the compare results (bool bytes) of four consecutive
    elements are read as one little-endian int32 lane and summed over the thresholds (byte j = code of element j), then
    one multiply by 2^24 + 2^18 + 2^12 + 2^6 moves byte j to bits 24 + 2j (every other product lands below bit 24 in
    its own 2-bit field, or beyond bit 31 and wraps away), and a shift by 24 leaves the packed byte."""
    flat = xf.reshape(-1)
    n = flat.numel()
    n4 = n - n % 4
    c32 = [_fp32(v) for v in c]
    packed = torch.empty((n + 3) // 4, dtype=torch.uint8, device=flat.device)
    if n4 and sys.byteorder == "little":
        main = flat[:n4]
        acc = torch.gt(main, c32[0])
        hit = torch.gt(main, c32[1])
        lanes, v = hit.view(torch.uint8).view(torch.int32), acc.view(torch.uint8).view(torch.int32)
        v += lanes
        torch.gt(main, c32[2], out=hit)
        v += lanes
        v *= (1 << 24) + (1 << 18) + (1 << 12) + (1 << 6)  # int32 arithmetic wraps modulo 2^32
        v >>= 24
        packed[: n4 // 4] = v  # the low byte (int32 -> uint8 keeps it)
    else:
        n4 = 0
    if n4 < n:
        packed[n4 // 4:] = pack_codes(codes_reference(flat[n4:], c))
    return packed


def forward_reference(x: torch.Tensor, kind: int, with_codes: bool = True):
    """Exact activation (fp32 compute, cast back) and, if asked, the packed codes."""
    xf = x.float()
    y = (F.gelu(xf) if kind == _GELU else F.silu(xf)).to(x.dtype)
    if not with_codes:
        return y, None
    return y, _packed_codes(xf, _CONSTS[kind][0])


_BYTE_TABLES: dict = {}


def _byte_table(kind: int, like: torch.Tensor) -> torch.Tensor:
    """[256, 4] fp32 on ``like``'s device: the four slopes s[code] encoded by each possible code byte.

    Cached per device for real tensors; built afresh (never cached) for fake / meta ones."""
    fake = is_shape_only(like)
    key = (kind, str(like.device))
    if not fake and key in _BYTE_TABLES:
        return _BYTE_TABLES[key]
    s = _S32[kind]
    table = torch.tensor([[s[(b >> (2 * j)) & 3] for j in range(4)] for b in range(256)], dtype=torch.float32)
    table = table.to(like.device)
    if not fake and not is_shape_only(table):
        _BYTE_TABLES[key] = table
    return table


def backward_reference(dy: torch.Tensor, packed: torch.Tensor, kind: int) -> torch.Tensor:
    """``dx = dy · s[code]`` in fp32, cast back to dy's dtype (four slopes per code byte from a 256-row table)."""
    flat = dy.reshape(-1)
    n = flat.numel()
    n4 = n - n % 4
    dx = torch.empty(n, dtype=torch.float32, device=dy.device)
    if n4:
        dx4 = dx[:n4].view(-1, 4)
        torch.index_select(_byte_table(kind, dy), 0, packed[: n4 // 4].to(torch.int32), out=dx4)
        dx4.mul_(flat[:n4].view(-1, 4))  # fp32 slopes times dy (any float dtype), in fp32
    if n4 < n:
        s = torch.tensor(_S32[kind], dtype=torch.float32, device=dy.device)
        tail = unpack_codes(packed[n4 // 4:], n - n4)
        dx[n4:] = flat[n4:].float() * s[tail.long()]
    return dx.to(dy.dtype).reshape(dy.shape)


# ---------------------------------------------------------------------------------------------------- Triton kernels
if triton is not None:

    @triton.jit
    def _act_fwd_kernel(x_ptr, y_ptr, code_ptr, n, nbytes, c1, c2, c3,
                        KIND: tl.constexpr, WRITE_CODES: tl.constexpr, BLOCK: tl.constexpr):
        # One program: BLOCK code bytes = 4·BLOCK consecutive elements, viewed as a [BLOCK, 4] tile.
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        lane = tl.arange(0, 4)
        idx = byte[:, None] * 4 + lane[None, :]
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if KIND == 0:
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # 1/√2
        else:
            y = x / (1.0 + tl.exp(-x))
        tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=mask)
        if WRITE_CODES:
            t1 = tl.cast(c1, tl.float32)
            t2 = tl.cast(c2, tl.float32)
            t3 = tl.cast(c3, tl.float32)
            code = (x > t1).to(tl.int32) + (x > t2).to(tl.int32) + (x > t3).to(tl.int32)
            code = tl.where(mask, code, 0)
            packed = tl.sum(code << (lane[None, :] * 2), axis=1)  # disjoint bits: sum == or
            tl.store(code_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)

    @triton.jit
    def _act_bwd_kernel(dy_ptr, code_ptr, dx_ptr, n, nbytes, s1, s2, s3, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        lane = tl.arange(0, 4)
        idx = byte[:, None] * 4 + lane[None, :]
        mask = idx < n
        packed = tl.load(code_ptr + byte, mask=byte < nbytes, other=0).to(tl.int32)
        code = (packed[:, None] >> (lane[None, :] * 2)) & 3
        a = tl.cast(s1, tl.float32)
        b = tl.cast(s2, tl.float32)
        c = tl.cast(s3, tl.float32)
        s = tl.where(code == 1, a, tl.where(code == 2, b, tl.where(code == 3, c, 0.0)))
        dy = tl.load(dy_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + idx, (dy * s).to(dx_ptr.dtype.element_ty), mask=mask)


def _use_triton(x: torch.Tensor) -> bool:
    """Triton per lowmembp._backend, except for fake / meta tensors (memory estimates), which take the reference."""
    return backend_for(x) == "triton" and not is_shape_only(x)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_cfg(nbytes: int) -> tuple[int, int]:
    """(BLOCK bytes per program, num_warps). The interpreter pays per program, so it gets one big block."""
    if _interpreting():
        return max(16, min(triton.next_power_of_2(max(nbytes, 1)), 1 << 14)), 4
    return 1024, 8  # 4096 elements per program


def _need_triton():
    if triton is None:
        raise RuntimeError("approx_act: the Triton backend was selected but triton is not importable; "
                           "install triton or set LOWMEMBP_BACKEND=torch")


def forward_triton(x: torch.Tensor, kind: int, with_codes: bool = True):
    _need_triton()
    xc = x.contiguous()
    n = xc.numel()
    nbytes = (n + 3) // 4
    y = torch.empty_like(xc)
    packed = torch.empty(nbytes if with_codes else 0, dtype=torch.uint8, device=x.device)
    if n:
        block, warps = _launch_cfg(nbytes)
        c1, c2, c3 = _C32[kind]
        _act_fwd_kernel[(triton.cdiv(nbytes, block),)](
            xc, y, packed, n, nbytes, c1, c2, c3,
            KIND=kind, WRITE_CODES=with_codes, BLOCK=block, num_warps=warps)
    return y, (packed if with_codes else None)


def backward_triton(dy: torch.Tensor, packed: torch.Tensor, kind: int) -> torch.Tensor:
    _need_triton()
    dyc = dy.contiguous()
    n = dyc.numel()
    nbytes = (n + 3) // 4
    dx = torch.empty_like(dyc)
    if n:
        block, warps = _launch_cfg(nbytes)
        _, s1, s2, s3 = _S32[kind]
        _act_bwd_kernel[(triton.cdiv(nbytes, block),)](
            dyc, packed, dx, n, nbytes, s1, s2, s3, BLOCK=block, num_warps=warps)
    return dx


# ------------------------------------------------------------------------------------------- autograd and modules
class _ApproxActFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: int):
        fwd = forward_triton if _use_triton(x) else forward_reference
        y, packed = fwd(x, kind, True)
        ctx.save_for_backward(packed)
        ctx.kind = kind
        ctx.shape = tuple(x.shape)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        (packed,) = ctx.saved_tensors
        bwd = backward_triton if _use_triton(dy) else backward_reference
        return bwd(dy, packed, ctx.kind), None


def _apply(x: torch.Tensor, kind: int) -> torch.Tensor:
    check_float_input(x, _NAMES[kind])
    if torch.is_grad_enabled() and x.requires_grad:
        return _ApproxActFn.apply(x, kind)
    fwd = forward_triton if _use_triton(x) else forward_reference
    return fwd(x, kind, False)[0]  # nothing to save: no codes


def regelu2(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU (erf form) forward; backward with the 2-bit ReGELU2 derivative, saving 0.25 byte per element."""
    return _apply(x, _GELU)


def resilu2(x: torch.Tensor) -> torch.Tensor:
    """Exact SiLU forward; backward with the 2-bit ReSiLU2 derivative, saving 0.25 byte per element."""
    return _apply(x, _SILU)


class ReGELU2(nn.Module):
    """Drop-in for ``nn.GELU()`` (erf form) that saves 2-bit codes instead of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return regelu2(x)


class ReSiLU2(nn.Module):
    """Drop-in for ``nn.SiLU()`` that saves 2-bit codes instead of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return resilu2(x)


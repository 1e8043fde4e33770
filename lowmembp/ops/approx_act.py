"""Approx-BP activations: exact forward, k-bit backward (Yang et al., arXiv 2406.16282; docs/design.md#approx-act).

Kinds (``KINDS``) and their exact forward, computed in fp32 and cast back to the input dtype:
``gelu`` 0.5·x·(1 + erf(x/√2)) · ``gelu_tanh`` 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) · ``quick_gelu``
x·sigmoid(1.702·x) · ``silu`` x·sigmoid(x) · ``relu`` max(x, 0) · ``relu2`` max(x, 0)².
Non-finite inputs follow the mathematics, not a library's vector path: f(NaN) = NaN, f(+∞) = +∞, f(−∞) = 0.

Alongside, each element gets a ``bits``-bit code ``Σ_j [x > c_j]`` over the ``2**bits − 1`` breakpoints (compared in
fp32 against the constants rounded to fp32; NaN compares false: code 0). Codes are packed as a little-endian bit
stream: element i occupies bits ``bits·i .. bits·i + bits − 1`` (for 2 bits: element i in byte i // 4, bits
2·(i % 4) and 2·(i % 4) + 1, least significant first — the layout of docs/design.md#approx-act).

Saved for backward: one uint8 tensor, the packed codes followed by ONE flag byte: ``ceil(N·bits/8) + 1`` bytes, i.e.
bits/8 byte per element (0.25 for ReGELU2 / ReSiLU2, against 2 for a bf16 or 4 for an fp32 input that ``F.gelu`` /
``F.silu`` save). The flag byte records non-finite inputs: bit 0 = some input was NaN, bit 1 = some input was +∞ for
a kind whose derivative is unbounded there (``relu2``).
Backward: ``dx = dy · s[code]`` with ``s_j = Σ_{i<=j} a_i`` (``s_0 = 0``) in fp32, cast back to dy's dtype — the
derivative of the piecewise-linear ``h̃(x) = Σ a_i·max(x − c_i, 0)`` fitted to the activation
(:mod:`lowmembp.ops.approx_derive`), not of the activation itself: that approximation is the method.
NaN / ±∞: +∞ gets the top code (slope Σa = 1 = f'(+∞) for the GELU/SiLU family and ReLU), −∞ code 0 (slope 0 =
f'(−∞)). A NaN has no code of its own (all 2^bits codes are taken), so when the flag says NaN, the backward uses
s_0 = NaN for that call: every element of code 0 — the NaN ones and those left of c_1 — gets a NaN gradient (a NaN
forward never yields a healthy-looking gradient; finite elements of other codes keep theirs). Likewise for
``relu2`` with a +∞ input, the top code's slope becomes +∞. ``dy`` NaN or ±∞ propagates by IEEE arithmetic.
``torch.func`` gradient transforms and forward-mode AD raise an error naming the op (``vmap`` alone works).

The ops are ``torch.library`` custom ops (``lowmembp::approx_act_fwd`` / ``lowmembp::approx_act_bwd``) with fake
implementations and registered autograd: ``torch.compile`` treats them as opaque (no graph break, the Triton
interpreter is never traced), FakeTensorMode / meta tensors get the shapes from the fake implementation (paper-scale
memory estimates; same ``ceil(N·bits/8) + 1`` saved bytes), and double backward works (the backward is linear in dy).
Backends (``lowmembp.ops.backend.backend_for``): Triton kernels on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1`` with ``LOWMEMBP_BACKEND=triton``), the CPU fast path on CPU tensors (:func:`forward_cpu`,
:func:`backward_cpu`: the reference's arithmetic, bit for bit equal to it; the codes and the backward one pass each
of the C kernels in :mod:`lowmembp.ops.cpu_kernels`), the PyTorch reference otherwise and under
``LOWMEMBP_BACKEND=torch``. All give bitwise-equal codes and gradients; Triton's
forward outputs agree with the reference's to fp32 rounding of erf/exp/tanh.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowmembp.ops.backend import (CPU_BLOCK, SUPPORTED_FLOAT_DTYPES, backend_for, check_float_input, cpu_block,
                                  cpu_parallel, eager_backend, refuse_functorch_transforms)
from lowmembp._compat import cuda_raw_stream
from lowmembp.ops import cpu_kernels
from lowmembp.ops.launch import Launcher
from lowmembp.ops.skeleton import OpFamily
from lowmembp.ops.approx_table import REGELU2_A, REGELU2_C, RESILU2_A, RESILU2_C, TABLE

try:  # triton is optional on CPU-only installs; the reference path needs none of it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing or broken
    triton = None
    tl = None

__all__ = [
    "KINDS", "BITS", "REGELU2_C", "REGELU2_A", "RESILU2_C", "RESILU2_A", "constants", "slopes",
    "approx_act", "regelu2", "resilu2", "make_approx", "ApproxAct", "ReGELU2", "ReSiLU2",
    "pack_codes", "unpack_codes", "codes_reference", "forward_reference", "backward_reference",
    "forward_triton", "backward_triton", "forward_cpu", "backward_cpu", "saved_bytes",
]

KINDS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu", "relu2")
BITS = (1, 2, 3, 4)
_KIND_ID = {k: i for i, k in enumerate(KINDS)}
_UNBOUNDED = frozenset({"relu2"})  # f'(+∞) = +∞: a +∞ input sets flag bit 1
_NEG_ZERO = frozenset({"gelu", "gelu_tanh", "quick_gelu", "silu"})  # f(x) < 0 for x < 0: f(−∞) = −0
_EXACT = {"gelu": "torch.nn.functional.gelu", "gelu_tanh": "torch.nn.functional.gelu(x, approximate='tanh')",
          "quick_gelu": "x * torch.sigmoid(1.702 * x)", "silu": "torch.nn.functional.silu",
          "relu": "torch.relu", "relu2": "torch.relu(x) ** 2"}  # what to use instead where this op cannot go
_GELU, _SILU = "gelu", "silu"  # legacy names (an int 0 / 1 is accepted as well)
_LEGACY = {0: "gelu", 1: "silu"}
NAN_FLAG, INF_FLAG = 1, 2


def _kind(kind) -> str:
    kind = _LEGACY.get(kind, kind) if isinstance(kind, int) else kind
    if kind not in _KIND_ID:
        raise ValueError(f"unknown approximate activation kind {kind!r}; the kinds are {', '.join(KINDS)}")
    return kind


def _bits(bits) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return int(bits)


def constants(kind: str, bits: int = 2) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(c, a)`` for ``kind`` with ``bits`` bits: ``2**bits − 1`` breakpoints and weights (float64 values)."""
    kind, bits = _kind(kind), _bits(bits)
    try:
        return TABLE[(kind, bits)]
    except KeyError:
        raise ValueError(f"no constants for kind={kind!r} with {bits} bits in lowmembp.ops.approx_table; "
                         "regenerate the table with `python -m lowmembp.ops.approx_derive --table`") from None


def slopes(a) -> tuple[float, ...]:
    """The backward's slope per code, ``s = (0, a1, a1 + a2, ..., Σa)``, summed in float64."""
    out, acc = [0.0], 0.0
    for v in a:
        acc += v
        out.append(acc)
    return tuple(out)


def _fp32(v: float) -> float:
    """Round a Python float to the nearest fp32 value (what both backends compare and multiply with)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


# fp32-rounded thresholds and slopes of every table entry, computed once at import (so a compiled graph only reads
# this dict; Dynamo cannot trace struct.pack)
_CONSTS32 = {key: (tuple(_fp32(v) for v in c), tuple(_fp32(v) for v in slopes(a))) for key, (c, a) in TABLE.items()}


def _consts32(kind: str, bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """fp32-rounded thresholds and slopes (Python floats) for the custom ops' arguments."""
    if (kind, bits) not in _CONSTS32:
        constants(kind, bits)  # raises the clear error
    return _CONSTS32[(kind, bits)]


_BITS_OF_COUNT = {2 ** b: b for b in BITS}  # number of codes (thresholds + 1, or slopes) -> bits


def _bits_of(n_values: int, what: str) -> int:
    bits = int(round(math.log2(n_values)))
    if (1 << bits) != n_values or bits not in BITS:
        raise ValueError(f"approx_act: {what} must have 2**bits values (bits in {BITS}), got {n_values}")
    return bits


def saved_bytes(n: int, bits: int = 2) -> int:
    """Bytes one call saves for backward on n elements: ``ceil(n·bits/8)`` code bytes + 1 flag byte."""
    return (n * _bits(bits) + 7) // 8 + 1


# ----------------------------------------------------------------------------------------------- PyTorch reference
def pack_codes(codes: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) (any shape, read in flat order) into ``ceil(N·bits/8)`` uint8 bytes.

    Little-endian bit stream: element i at bits ``bits·i ..``; eight elements fill ``bits`` bytes exactly."""
    bits = _bits(bits)
    flat = codes.reshape(-1).to(torch.int64)
    n = flat.numel()
    groups = (n + 7) // 8
    buf = torch.zeros(groups * 8, dtype=torch.int64, device=flat.device)
    buf[:n] = flat
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    word = (buf.view(groups, 8) << shifts).sum(1)
    byte_shift = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    out = ((word[:, None] >> byte_shift) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: (n * bits + 7) // 8].clone()


def unpack_codes(packed: torch.Tensor, n: int, bits: int = 2) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``n`` codes as a flat uint8 tensor."""
    bits = _bits(bits)
    nbytes = (n * bits + 7) // 8
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != nbytes:
        raise ValueError(f"unpack_codes: expected a 1-D uint8 tensor of {nbytes} bytes for n={n}, bits={bits}, "
                         f"got {packed.dtype} of shape {tuple(packed.shape)}")
    groups = (n + 7) // 8
    buf = torch.zeros(groups * bits, dtype=torch.int64, device=packed.device)
    buf[:nbytes] = packed
    byte_shift = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (buf.view(groups, bits) << byte_shift).sum(1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((word[:, None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)[:n]


def codes_reference(x: torch.Tensor, c) -> torch.Tensor:
    """Unpacked codes ``Σ_j [x > c_j]`` (uint8, x's shape), compared in fp32 (NaN: 0)."""
    xf = x.float()
    out = torch.zeros(xf.shape, dtype=torch.uint8, device=xf.device)
    for v in c:
        out += xf > _fp32(v)
    return out


def _packed_codes_2bit(flat: torch.Tensor, t32, out: torch.Tensor) -> None:
    """2-bit codes of fp32 ``flat`` packed into ``out`` in few whole-tensor passes: the compare results (bool bytes)
    of four consecutive elements are read as one little-endian int32 lane and summed over the thresholds (byte j =
    code of element j), then one multiply by 2^24 + 2^18 + 2^12 + 2^6 moves byte j to bits 24 + 2j (every other
    product lands below bit 24 in its own 2-bit field, or beyond bit 31 and wraps away), and a shift by 24 leaves the
    packed byte. Falls back to :func:`pack_codes` for the ragged tail (and on big-endian machines)."""
    import sys
    n = flat.numel()
    n4 = n - n % 4 if sys.byteorder == "little" else 0
    if n4:
        main = flat[:n4]
        acc = torch.gt(main, t32[0])
        hit = torch.gt(main, t32[1])
        lanes, v = hit.view(torch.uint8).view(torch.int32), acc.view(torch.uint8).view(torch.int32)
        v += lanes
        torch.gt(main, t32[2], out=hit)
        v += lanes
        v *= (1 << 24) + (1 << 18) + (1 << 12) + (1 << 6)  # int32 arithmetic wraps modulo 2^32
        v >>= 24
        out[: n4 // 4] = v  # the low byte (int32 -> uint8 keeps it)
    if n4 < n:
        out[n4 // 4:] = pack_codes(codes_reference(flat[n4:], t32), 2)


def _exact_fp32(xf: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(xf)
    if kind == "gelu_tanh":
        return F.gelu(xf, approximate="tanh")
    if kind == "quick_gelu":
        return xf * torch.sigmoid(1.702 * xf)
    if kind == "silu":
        return F.silu(xf)
    if kind == "relu":
        return torch.relu(xf)
    return torch.relu(xf).square()


def _flag_tensor(xf: torch.Tensor, kind: str) -> torch.Tensor:
    """The flag byte (0-d uint8 on xf's device): bit 0 = any NaN, bit 1 = any +∞ for an unbounded derivative."""
    flag = torch.isnan(xf).any().to(torch.uint8)
    if kind in _UNBOUNDED:
        flag = flag | (torch.isposinf(xf).any().to(torch.uint8) << 1)
    return flag


def _fwd_reference(x: torch.Tensor, kind: str, thresholds, with_codes: bool):
    xf = x.float().contiguous()
    y = _exact_fp32(xf, kind)
    # non-finite inputs by the mathematics (a library's vectorised path may return NaN for +inf): NaN, +inf, 0.
    # One sum decides: it is finite only if every element is (NaN and ±inf propagate; a finite overflow to inf only
    # sends us down the exact path). A host read: this runs eagerly inside the custom op; on CPU it costs no sync.
    all_finite = bool(torch.isfinite(xf.sum())) if xf.numel() else True
    if not all_finite:
        zero = -0.0 if kind in _NEG_ZERO else 0.0
        y = torch.where(torch.isfinite(xf), y, torch.where(xf < 0, zero, xf))
    y = y.to(x.dtype)
    if not with_codes:
        return y, torch.empty(0, dtype=torch.uint8, device=x.device)
    bits = _bits_of(len(thresholds) + 1, "thresholds")
    flat = xf.reshape(-1)
    n = flat.numel()
    nbytes = (n * bits + 7) // 8
    packed = torch.empty(nbytes + 1, dtype=torch.uint8, device=x.device)
    if bits == 2:
        _packed_codes_2bit(flat, thresholds, packed[:nbytes])
    else:
        packed[:nbytes] = pack_codes(codes_reference(flat, thresholds), bits)
    if all_finite:
        packed[nbytes] = 0
    else:
        packed[nbytes] = _flag_tensor(flat, kind)
    return y, packed


def _slope_rows(s32) -> list[list[float]]:
    """Four slope tables, one per flag value: NaN flag → s_0 = NaN; +∞ flag → s_top = +∞."""
    rows = []
    for flag in range(4):
        row = list(s32)
        if flag & NAN_FLAG:
            row[0] = float("nan")
        if flag & INF_FLAG:
            row[-1] = float("inf")
        rows.append(row)
    return rows


_TABLES: dict = {}


def _slope_table(s32: tuple, device) -> torch.Tensor:
    """[4, 2**bits] fp32 on ``device``: the slopes per code for each flag value (cached per device)."""
    key = ("s", s32, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(_slope_rows(s32), dtype=torch.float32, device=device)
    return _TABLES[key]


def _byte_table(s32: tuple, bits: int, device) -> torch.Tensor:
    """[4, 256, 8 // bits] fp32: the slopes of the codes in each possible byte, per flag value (bits 1, 2, 4)."""
    key = ("b", s32, str(device))
    if key not in _TABLES:
        per, m = 8 // bits, (1 << bits) - 1
        rows = _slope_rows(s32)
        t = [[[rows[f][(b >> (bits * j)) & m] for j in range(per)] for b in range(256)] for f in range(4)]
        _TABLES[key] = torch.tensor(t, dtype=torch.float32, device=device)
    return _TABLES[key]


def _bwd_reference(dy: torch.Tensor, packed: torch.Tensor, s32) -> torch.Tensor:
    bits = _bits_of(len(s32), "slopes")
    flat = dy.reshape(-1)
    n = flat.numel()
    nbytes = (n * bits + 7) // 8
    if packed.numel() != nbytes + 1:
        raise ValueError(f"approx_act backward: expected {nbytes + 1} saved bytes for {n} elements at {bits} bits, "
                         f"got {packed.numel()}")
    flag = packed[nbytes].long()
    dx = torch.empty(n, dtype=torch.float32, device=dy.device)
    done = 0
    if bits != 3:
        per = 8 // bits
        done = n - n % per
        if done:
            d2 = dx[:done].view(-1, per)
            torch.index_select(_byte_table(tuple(s32), bits, dy.device)[flag], 0,
                               packed[: done // per].to(torch.int32), out=d2)
            d2.mul_(flat[:done].view(-1, per))  # fp32 slopes times dy (any float dtype), in fp32
    if done < n:
        first_byte = done * bits // 8  # done is a multiple of 8 // bits (or 0): a byte boundary
        tail = unpack_codes(packed[first_byte:nbytes], n - done, bits)
        dx[done:] = flat[done:].float() * _slope_table(tuple(s32), dy.device)[flag][tail.long()]
    return dx.to(dy.dtype).reshape(dy.shape)


# ------------------------------------------------------------------------------------------------ CPU fast path
# The reference's arithmetic, bit for bit, with fewer passes over memory: the forward output is the native op's (one
# whole-tensor call, as the reference makes), the packed codes one pass of the C kernels (lowmembp.ops.cpu_kernels,
# compiled on first use), and the backward one C pass of dx = s[code]·dy. Without the C kernels (no compiler,
# LOWMEMBP_CPU_KERNELS=0) the same bits come from eager ATen ops: the codes block by block (blocks small enough to
# stay in the core's cache, so that the several passes a block takes read cache, not memory), the backward a lookup
# of four slopes per code byte and a multiply by dy block by block. 2-bit codes of the kinds below; everything else
# (other bit widths, non-finite inputs, big-endian machines) runs the reference.
_CPU_BLOCK = CPU_BLOCK  # elements per block (a multiple of 64); blocks are spread over threads by cpu_parallel
_MAGIC = float(1 << 23)  # k + 2^23 (k a small integer) has k in the low mantissa bits of its fp32 encoding
_LOW_PRECISION_NATIVE = frozenset({"gelu", "silu", "relu"})  # kinds whose native fp16/bf16 kernels may compute in fp32


def _scalars(values: tuple) -> list[torch.Tensor]:
    """0-d fp32 CPU tensors of ``values`` (cached): ops take them without wrapping a Python scalar per call."""
    key = ("0d", values)
    if key not in _TABLES:
        _TABLES[key] = [torch.tensor(v, dtype=torch.float32) for v in values]
    return _TABLES[key]


def _native_kernel(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x)
    return F.silu(x) if kind == "silu" else torch.relu(x)


@functools.lru_cache(maxsize=None)
def native_act_exact(kind: str, dtype: torch.dtype) -> bool:
    """Whether this torch's native ``dtype`` (fp16 / bf16) CPU kernel of ``kind`` returns the fp32 formula's result
    rounded once (the reference's arithmetic), probed once per process on every finite value of the dtype, bf16
    below 2⁻¹²⁴ in magnitude excepted (the ``tiny`` rule of :func:`_native_act`): in one contiguous call (the vector
    loops) and in pieces of 31 (the scalar tails). Which kernel runs depends on the CPU: torch hands fp32, and fp16 /
    bf16 where the CPU has instructions for them, to oneDNN, and the rest to ATen's own loops, whose ``erf`` is
    another approximation (fp16 GELU differs on AVX-512 CPUs without AVX512-FP16, such as AMD's)."""
    if kind not in _LOW_PRECISION_NATIVE or dtype not in (torch.float16, torch.bfloat16):
        return False
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    keep = torch.isfinite(x)
    if dtype == torch.bfloat16:
        keep &= (x == 0) | (x.float().abs() >= 2.0 ** -124)
    x = x[keep]
    want = _exact_fp32(x.float(), kind).to(dtype).view(torch.int16)
    if not torch.equal(_native_kernel(x, kind).view(torch.int16), want):
        return False
    return all(torch.equal(_native_kernel(p, kind).view(torch.int16), w)
               for p, w in zip(x.split(31), want.split(31)))


def _native_act(x: torch.Tensor, kind: str, tiny: bool) -> torch.Tensor:
    """The exact activation in x's dtype, equal to the reference's fp32 compute cast back: the same fp32 call for
    fp32 (and the kinds computed by composition), the native kernel for fp16 / bf16 of kinds whose reduced-precision
    kernel on this CPU gives the fp32 formula rounded once (:func:`native_act_exact`; tests/ops/test_cpu_fastpath.py
    and tests/ops/test_cpu_kernels.py check the bits, the latter on every fp16 and bf16 value). ``tiny``: x is bf16
    and may hold nonzero values below 2⁻¹²⁴, where a native bf16 kernel may flush a subnormal result to zero
    (``F.gelu`` does on AVX512-BF16 CPUs): the fp32 formula then."""
    if x.dtype == torch.float32:
        return _exact_fp32(x, kind)
    if not (tiny and x.dtype == torch.bfloat16) and native_act_exact(kind, x.dtype):
        return _native_kernel(x, kind)
    return _exact_fp32(x.float(), kind).to(x.dtype)


def _codes_cpu(flat: torch.Tensor, thresholds, packed: torch.Tensor, sums: torch.Tensor, lo: int, hi: int,
               with_codes: bool) -> None:
    """Blocks ``[lo, hi)`` of ``flat`` (a multiple of 4 long): the packed 2-bit codes into ``packed`` and each
    block's sum (for the finiteness check) into ``sums[start // block]``."""
    block = cpu_block(_CPU_BLOCK)
    m = min(block, hi - lo)
    xs32 = torch.empty(m, dtype=torch.float32) if flat.dtype != torch.float32 else None
    f0, f1 = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.float32)
    u8 = torch.empty(m, dtype=torch.uint8)
    word = torch.empty(m // 4, dtype=torch.int32)
    t0, t1, t2, magic = _scalars(tuple(thresholds) + (_MAGIC,))  # 0-d tensors: no scalar wrapping per call
    for start in range(lo, hi, block):
        e = min(start + block, hi) - start
        xs = flat[start:start + e]
        if xs32 is not None:
            xs = xs32[:e].copy_(xs)
        torch.sum(xs, 0, out=sums[start // block])
        if not with_codes:
            continue
        a, b = f0[:e], f1[:e]
        torch.gt(xs, t0, out=a)  # 1.0 / 0.0 (an fp32 output is the compare's vectorised path; bool is not)
        torch.gt(xs, t1, out=b)
        a.add_(b)
        torch.gt(xs, t2, out=b)
        a.add_(b).add_(magic)  # the code (0..3), exact, now the low byte of each fp32 encoding
        u8[:e].copy_(a.view(torch.int32))  # int32 -> uint8 keeps the low byte: the codes as bytes
        w = word[: e // 4]
        torch.mul(u8[:e].view(torch.int32), (1 << 24) + (1 << 18) + (1 << 12) + (1 << 6), out=w)  # as the reference
        w >>= 24
        packed[start // 4:(start + e) // 4].copy_(w)


_LITTLE_ENDIAN = sys.byteorder == "little"  # the eager packing reads int32 words as four code bytes


def _fwd_cpu(x: torch.Tensor, kind: str, thresholds, with_codes: bool):
    n = x.numel()
    if len(thresholds) != 3 or not _LITTLE_ENDIAN or n == 0 or not x.is_cpu:  # 2-bit codes only (the reference
        return _fwd_reference(x, kind, thresholds, with_codes)  # checks the count)
    xc = x.contiguous()
    nbytes = (n + 3) // 4
    packed = xc.new_empty(nbytes + 1 if with_codes else 0, dtype=torch.uint8)
    # one C pass: the packed codes (or only the checks) of every element
    if not with_codes:
        seen = cpu_kernels.check(xc)
    elif xc.dtype in SUPPORTED_FLOAT_DTYPES:
        seen = cpu_kernels.codes2_trusted(xc, n, thresholds, packed)
    else:
        seen = None
    if seen is not None:
        if seen & cpu_kernels.NONFINITE:  # some input NaN or ±inf: the reference (its output and flag byte follow
            return _fwd_reference(x, kind, thresholds, with_codes)  # the mathematics)
        y = _native_act(xc, kind, tiny=bool(seen & cpu_kernels.TINY_BF16))  # x's shape: no view to return
        if with_codes:
            ctypes.c_uint8.from_address(packed.data_ptr() + nbytes).value = 0  # the flag byte: no NaN, no +inf
        return y, packed
    flat = xc.reshape(-1)
    # without the C kernels: the codes from eager ATen ops, block by block
    y = _native_act(xc, kind, tiny=xc.dtype == torch.bfloat16)
    n4 = n - n % 4
    block = cpu_block(_CPU_BLOCK)
    sums = torch.zeros(n4 // block + 2, dtype=torch.float32)
    if n4:
        cpu_parallel(n4, block, lambda lo, hi: _codes_cpu(flat, thresholds, packed, sums, lo, hi, with_codes),
                     2 * block)
    if n4 < n:  # the ragged tail: the reference's own packing
        tail = flat[n4:].float()
        sums[-1] = tail.sum()
        if with_codes:
            packed[n4 // 4:nbytes] = pack_codes(codes_reference(tail, thresholds), 2)
    if not bool(torch.isfinite(sums.sum())):  # some input NaN or ±inf (or a finite sum overflowed): the reference
        return _fwd_reference(x, kind, thresholds, with_codes)
    if with_codes:
        packed[nbytes] = 0
    return y, packed


def _slopes_cpu(flat: torch.Tensor, packed: torch.Tensor, table: torch.Tensor, dx: torch.Tensor, lo: int,
                hi: int) -> None:
    """Blocks ``[lo, hi)``: ``dx = s[code] · dy`` in fp32, rounded once to dx's dtype."""
    block = cpu_block(_CPU_BLOCK)
    m = min(block, hi - lo)
    s = torch.empty(m, dtype=torch.float32)
    d32 = torch.empty(m, dtype=torch.float32) if flat.dtype != torch.float32 else None
    idx = torch.empty(m // 4, dtype=torch.int32)
    for start in range(lo, hi, block):
        e = min(start + block, hi) - start
        i = idx[: e // 4]
        i.copy_(packed[start // 4:(start + e) // 4])
        torch.index_select(table, 0, i, out=s[:e].view(torch.complex128))
        if d32 is None:
            torch.mul(s[:e], flat[start:start + e], out=dx[start:start + e])
        else:  # fp32 product, rounded once to dy's dtype (three vectorised passes beat one mixed-dtype pass)
            dx[start:start + e].copy_(s[:e].mul_(d32[:e].copy_(flat[start:start + e])))


def _bwd_cpu(dy: torch.Tensor, packed: torch.Tensor, s32) -> torch.Tensor:
    n = dy.numel()
    nbytes = (n + 3) // 4
    if (len(s32) != 4 or n < 4 or packed.numel() != nbytes + 1 or not packed.is_contiguous() or not dy.is_cpu
            or not packed.is_cpu or packed.dtype != torch.uint8):
        return _bwd_reference(dy, packed, s32)  # 2-bit codes only (the reference checks the count)
    bits = 2
    dyc = dy.contiguous()
    flag = cpu_kernels.read_byte_trusted(packed, nbytes)  # (checked above: contiguous CPU uint8, nbytes + 1)
    if flag == 0 and dyc.dtype in SUPPORTED_FLOAT_DTYPES:  # one C pass; a NaN product in fp16 / bf16 is rounded
        dx = torch.empty_like(dyc)  # by ATen's own ops below; dx in dy's shape: no view to return
        table = _SLOPES_CPU.get(s32) if type(s32) is tuple else None  # (a list in a double backward)
        if table is None:
            table = _SLOPES_CPU[tuple(s32)] = _const_tensor(tuple(s32), "cpu")
        nan = cpu_kernels.slopes2_trusted(dyc, n, packed, table, dx)
        if nan is not None and not (nan and dy.dtype != torch.float32):
            return dx
    flat = dyc.reshape(-1)
    # the four slopes of each code byte, 16 bytes: one complex128 entry, so that one 1-D gather fetches all four
    table = _byte_table(tuple(s32), bits, dy.device)[flag].view(torch.complex128).reshape(256)
    dx = torch.empty(n, dtype=dy.dtype, device=dy.device)
    n4 = n - n % 4
    block = cpu_block(_CPU_BLOCK)
    cpu_parallel(n4, block, lambda lo, hi: _slopes_cpu(flat, packed, table, dx, lo, hi), 2 * block)
    if n4 < n:
        tail = unpack_codes(packed[n4 // 4:nbytes], n - n4, bits)
        dx[n4:] = flat[n4:].float() * _slope_table(tuple(s32), dy.device)[flag][tail.long()]
    return dx.reshape(dy.shape)


def forward_cpu(x: torch.Tensor, kind=_GELU, with_codes: bool = True, bits: int = 2):
    """CPU fast path of :func:`forward_reference`: the same output and saved bytes, bit for bit."""
    kind = _kind(kind)
    return _fwd_cpu(x, kind, _consts32(kind, _bits(bits))[0], with_codes)


def backward_cpu(dy: torch.Tensor, packed: torch.Tensor, kind=_GELU, bits: int = 2) -> torch.Tensor:
    """CPU fast path of :func:`backward_reference`: the same gradient, bit for bit."""
    return _bwd_cpu(dy, packed, _consts32(_kind(kind), _bits(bits))[1])


def forward_reference(x: torch.Tensor, kind=_GELU, with_codes: bool = True, bits: int = 2):
    """Exact activation (fp32 compute, cast back) and, if asked, the saved bytes (packed codes + flag byte)."""
    kind = _kind(kind)
    return _fwd_reference(x, kind, _consts32(kind, _bits(bits))[0], with_codes)


def backward_reference(dy: torch.Tensor, packed: torch.Tensor, kind=_GELU, bits: int = 2) -> torch.Tensor:
    """``dx = dy · s[code]`` in fp32, cast back to dy's dtype."""
    return _bwd_reference(dy, packed, _consts32(_kind(kind), _bits(bits))[1])


# ---------------------------------------------------------------------------------------------------- Triton kernels
# One kernel per op call. The forward's flag byte (NaN / +inf seen anywhere) is an OR over every program: each
# program ORs its own flag into a per-stream int32 workspace (only when it saw one), then takes a ticket; the program
# that takes the last ticket moves the total into the flag byte and zeroes the workspace for the next call. No fill
# or copy launches, and the workspace is back at zero after every launch (so a CUDA graph replays it as it is).
if triton is not None:

    @triton.jit
    def _act_fwd_kernel(x_ptr, y_ptr, code_ptr, t_ptr, ws_ptr, n, nbytes,
                        KIND: tl.constexpr, BITS: tl.constexpr, NT: tl.constexpr, NEG_ZERO: tl.constexpr,
                        UNBOUNDED: tl.constexpr, WRITE_CODES: tl.constexpr, BLOCK: tl.constexpr,
                        TILES: tl.constexpr):
        # One program: TILES tiles of BLOCK groups of 8 consecutive elements (a group fills BITS code bytes), each a
        # [BLOCK, 8] tile; the flags are gathered per element over the tiles and reduced once per program.
        pid = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, 8)
        kb = tl.arange(0, 4)
        seen = tl.zeros([BLOCK, 8], dtype=tl.int32)
        for i in range(TILES):
            grp = (pid * TILES + i) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            idx = grp[:, None] * 8 + lane[None, :]
            mask = idx < n
            x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if KIND == 0:  # gelu (erf)
                y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # 1/√2
            elif KIND == 1:  # gelu_tanh: 0.5·x·(1 + tanh(u)) = x·sigmoid(2u) (no libdevice tanh in the interpreter)
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # √(2/π)
                y = x / (1.0 + tl.exp(-2.0 * u))
            elif KIND == 2:  # quick_gelu
                y = x / (1.0 + tl.exp(-1.702 * x))
            elif KIND == 3:  # silu
                y = x / (1.0 + tl.exp(-x))
            elif KIND == 4:  # relu
                y = tl.where(x > 0.0, x, 0.0)
            else:  # relu2
                r = tl.where(x > 0.0, x, 0.0)
                y = r * r
            finite = tl.abs(x) < float("inf")  # false for ±inf and NaN
            if NEG_ZERO:
                special = tl.where(x < 0.0, -0.0, x)
            else:
                special = tl.where(x < 0.0, 0.0, x)
            y = tl.where(finite, y, special)
            tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=mask)
            if WRITE_CODES:
                code = tl.zeros([BLOCK, 8], dtype=tl.int32)
                for j in tl.static_range(NT):
                    code += (x > tl.load(t_ptr + j)).to(tl.int32)
                code = tl.where(mask, code, 0)
                word = tl.sum(code << (lane[None, :] * BITS), axis=1)  # disjoint bits: sum == or (int32 wraps)
                byte = (word[:, None] >> (kb[None, :] * 8)) & 0xFF
                bidx = grp[:, None] * BITS + kb[None, :]
                tl.store(code_ptr + bidx, byte.to(tl.uint8), mask=(kb[None, :] < BITS) & (bidx < nbytes))
                seen = seen | tl.where(mask & (x != x), 1, 0)
                if UNBOUNDED:
                    seen = seen | tl.where(mask & (x == float("inf")), 2, 0)
        if WRITE_CODES:
            if UNBOUNDED:  # two bits from different elements: the max of each, then or
                flag = tl.max(tl.max(seen & 1, axis=1), axis=0) | tl.max(tl.max(seen & 2, axis=1), axis=0)
            else:
                flag = tl.max(tl.max(seen, axis=1), axis=0)
            tl.atomic_or(ws_ptr, flag, mask=flag != 0)
            ticket = tl.atomic_add(ws_ptr + 1, 1)  # acq_rel: the OR above is seen by whoever takes the last ticket
            if ticket == tl.num_programs(0) - 1:
                total = tl.atomic_xchg(ws_ptr, 0)
                tl.store(code_ptr + nbytes, total.to(tl.uint8))
                tl.atomic_xchg(ws_ptr + 1, 0)

    @triton.jit
    def _act_bwd_kernel(dy_ptr, code_ptr, s_ptr, dx_ptr, n, nbytes,
                        BITS: tl.constexpr, NS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        grp = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        lane = tl.arange(0, 8)
        idx = grp[:, None] * 8 + lane[None, :]
        mask = idx < n
        kb = tl.arange(0, 4)
        bidx = grp[:, None] * BITS + kb[None, :]
        byte = tl.load(code_ptr + bidx, mask=(kb[None, :] < BITS) & (bidx < nbytes), other=0).to(tl.int32)
        word = tl.sum(byte << (kb[None, :] * 8), axis=1)
        code = (word[:, None] >> (lane[None, :] * BITS)) & (NS - 1)
        flag = tl.load(code_ptr + nbytes).to(tl.int32)  # the flag byte after the codes
        s = tl.load(s_ptr + flag * NS + code, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + idx, (dy * s).to(dx_ptr.dtype.element_ty), mask=mask)

    _FWD = Launcher(_act_fwd_kernel)
    _BWD = Launcher(_act_bwd_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_INTERPRET = _interpreting()  # set before triton is imported, so fixed for the process


def _launch_cfg(groups: int) -> tuple[int, int, int]:
    """(BLOCK groups of 8 elements per tile, TILES tiles per program, num_warps). The interpreter pays per program:
    one big block. On a GPU 4096-element tiles, four per program on large tensors: a quarter of the programs, so a
    quarter of the forward's flag reductions and atomic tickets."""
    if _INTERPRET:
        return max(16, min(triton.next_power_of_2(max(groups, 1)), 1 << 12)), 1, 4
    return 512, (4 if groups >= 512 * 4 * 512 else 1), 8


def _need_triton():
    if triton is None:
        raise RuntimeError("approx_act: the Triton backend was selected but triton is not importable; "
                           "install triton or set LOWMEMBP_BACKEND=torch")


_WORKSPACE: dict = {}


def _workspace(like: torch.Tensor, index: int) -> torch.Tensor:
    """The forward kernel's flag workspace on ``like``'s device for the current stream: two int32 zeros (the OR of the
    programs' flags, the ticket counter), made once per (device, stream); the kernel leaves them at zero."""
    key = (index, cuda_raw_stream(index)) if index >= 0 else (index, 0)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = _WORKSPACE[key] = torch.zeros(2, dtype=torch.int32, device=like.device)
    return ws


def _fwd_triton(x: torch.Tensor, kind: str, thresholds, with_codes: bool):
    _need_triton()
    bits = _BITS_OF_COUNT[len(thresholds) + 1]
    xc = x if x.is_contiguous() else x.contiguous()
    n = xc.numel()
    nbytes = (n * bits + 7) >> 3
    y = torch.empty_like(xc)
    packed = xc.new_empty(nbytes + 1 if with_codes else 0, dtype=torch.uint8)
    if n:
        dev = xc.get_device()
        t = _device_table(("t", tuple(thresholds)), xc, dev)
        ws = _workspace(xc, dev) if with_codes else t
        block, tiles, warps = _launch_cfg((n + 7) >> 3)
        _FWD(-(-((n + 7) >> 3) // (block * tiles)), (xc, y, packed if with_codes else y, t, ws, n, nbytes),
             (_KIND_ID[kind], bits, len(thresholds), kind in _NEG_ZERO, kind in _UNBOUNDED, with_codes, block, tiles),
             warps, dev)
    elif with_codes:
        packed.zero_()  # no element: the flag byte alone, 0
    return y, packed


def _device_table(key: tuple, like: torch.Tensor, dev: int) -> torch.Tensor:
    """A small fp32 constant tensor (thresholds or a slope table) on ``like``'s device, made once per device."""
    full = (key, dev)
    t = _TABLES.get(full)
    if t is None:
        kind, values = key
        rows = values if kind == "t" else _slope_rows(values)
        t = _TABLES[full] = torch.tensor(rows, dtype=torch.float32, device=like.device)
    return t


_SLOPES_CPU: dict = {}  # slopes tuple -> its fp32 CPU tensor (the C backward's table)


def _const_tensor(values: tuple, device) -> torch.Tensor:
    key = ("t", values, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _TABLES[key]


def _bwd_triton(dy: torch.Tensor, packed: torch.Tensor, s32) -> torch.Tensor:
    _need_triton()
    bits = _BITS_OF_COUNT.get(len(s32)) or _bits_of(len(s32), "slopes")
    dyc = dy if dy.is_contiguous() else dy.contiguous()
    n = dyc.numel()
    nbytes = (n * bits + 7) >> 3
    if packed.numel() != nbytes + 1:
        raise ValueError(f"approx_act backward: expected {nbytes + 1} saved bytes for {n} elements at {bits} bits, "
                         f"got {packed.numel()}")
    dx = torch.empty_like(dyc)
    if n:
        dev = dyc.get_device()
        block, _, warps = _launch_cfg((n + 7) >> 3)
        _BWD(-(-((n + 7) >> 3) // block), (dyc, packed, _device_table(("s", tuple(s32)), dyc, dev), dx, n, nbytes),
             (bits, len(s32), block), warps, dev)
    return dx


def forward_triton(x: torch.Tensor, kind=_GELU, with_codes: bool = True, bits: int = 2):
    """Triton forward: (y, packed codes + flag byte) — the same bytes as :func:`forward_reference`."""
    kind = _kind(kind)
    return _fwd_triton(x, kind, _consts32(kind, _bits(bits))[0], with_codes)


def backward_triton(dy: torch.Tensor, packed: torch.Tensor, kind=_GELU, bits: int = 2) -> torch.Tensor:
    """Triton backward: ``dx = dy · s[code]``, bitwise equal to :func:`backward_reference`."""
    return _bwd_triton(dy, packed, _consts32(_kind(kind), _bits(bits))[1])


# ------------------------------------------------------------------------------------------------- the custom ops
def _fwd_on(backend: str, x: torch.Tensor, kind: str, thresholds, with_codes: bool):
    """The forward on ``backend`` (``lowmembp.ops.backend.backend_for``): (y, packed codes + flag byte)."""
    if backend == "triton":
        return _fwd_triton(x, kind, thresholds, with_codes)
    if backend == "cpu":
        return _fwd_cpu(x, kind, thresholds, with_codes)
    return _fwd_reference(x, kind, thresholds, with_codes)


def _bwd_on(backend: str, dy: torch.Tensor, packed: torch.Tensor, slopes) -> torch.Tensor:
    """The backward on ``backend``: ``dx = dy · s[code]``."""
    if backend == "triton":
        return _bwd_triton(dy, packed, slopes)
    if backend == "cpu":
        return _bwd_cpu(dy, packed, slopes)
    return _bwd_reference(dy, packed, slopes)


@torch.library.custom_op("lowmembp::approx_act_fwd", mutates_args=())
def _approx_act_fwd(x: torch.Tensor, kind: str, thresholds: list[float], slopes: list[float],
                    with_codes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact activation, packed codes + flag byte). ``slopes`` is unused here; the autograd formula reads it."""
    return _fwd_on(backend_for(x), x, kind, thresholds, with_codes)


@_approx_act_fwd.register_fake
def _(x, kind, thresholds, slopes, with_codes):
    bits = _bits_of(len(thresholds) + 1, "thresholds")
    nbytes = (x.numel() * bits + 7) // 8 + 1 if with_codes else 0
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(nbytes, dtype=torch.uint8, device=x.device))


@torch.library.custom_op("lowmembp::approx_act_bwd", mutates_args=())
def _approx_act_bwd(dy: torch.Tensor, packed: torch.Tensor, slopes: list[float]) -> torch.Tensor:
    """``dx = dy · s[code]`` (slopes fp32-rounded, 2**bits of them)."""
    return _bwd_on(backend_for(dy), dy, packed, slopes)


@_approx_act_bwd.register_fake
def _(dy, packed, slopes):
    return torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)


def _bwd_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.slopes = inputs[2]


def _bwd_backward(ctx, gdx):  # the backward is linear in dy with a piecewise-constant slope: d/dx of it is 0
    (packed,) = ctx.saved_tensors
    return _approx_act_bwd(gdx, packed, ctx.slopes), None, None


torch.library.register_autograd("lowmembp::approx_act_bwd", _bwd_backward, setup_context=_bwd_setup)


class _ApproxActOps(OpFamily):
    """ReGELU2 / ReSiLU2 and their kin (:mod:`lowmembp.ops.skeleton`): saves the packed codes + flag byte only."""
    name = "approx_act"

    @staticmethod
    def forward(backend, x, kind, t32, s32):
        y, packed = _fwd_on(backend, x, kind, t32, True)
        return y, (packed,), s32

    @staticmethod
    def backward(backend, s32, saved, dy):
        return _bwd_on(backend, dy, saved[0], s32), None, None, None

    @staticmethod
    def graph_backward(s32, saved, dy):
        return _approx_act_bwd(dy, saved[0], list(s32)), None, None, None


# the custom op's inputs are (x, kind, thresholds, slopes, with_codes): it saves its second output, the codes
_ApproxActOps.register_autograd("lowmembp::approx_act_fwd", lambda inputs, output: ((output[1],), inputs[3]))


# ------------------------------------------------------------------------------------------- functions and modules
def _run(x: torch.Tensor, kind: str, t32: tuple, s32: tuple) -> torch.Tensor:
    """The op on a validated ``kind`` with its fp32 constants: the eager route where it may run, else the custom op."""
    with_codes = x.requires_grad and torch.is_grad_enabled()
    backend = eager_backend(x)
    if backend is not None:
        if with_codes:
            return _ApproxActOps.apply(backend, x, kind, t32, s32)
        return _fwd_on(backend, x, kind, t32, False)[0]
    refuse_functorch_transforms(x, f"approx_act({kind}, bits={_BITS_OF_COUNT[len(s32)]})", _EXACT[kind])
    return _approx_act_fwd(x, kind, list(t32), list(s32), with_codes)[0]


def approx_act(x: torch.Tensor, kind: str = "gelu", bits: int = 2) -> torch.Tensor:
    """Exact ``kind`` activation forward; backward with the ``bits``-bit approximate derivative (codes saved)."""
    kind, bits = _kind(kind), _bits(bits)
    check_float_input(x, f"approx_act({kind}, bits={bits})")
    return _run(x, kind, *_consts32(kind, bits))


def regelu2(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU (erf form) forward; backward with the 2-bit ReGELU2 derivative, saving 0.25 byte per element."""
    check_float_input(x, "regelu2")
    return _run(x, "gelu", *_CONSTS32[("gelu", 2)])


def resilu2(x: torch.Tensor) -> torch.Tensor:
    """Exact SiLU forward; backward with the 2-bit ReSiLU2 derivative, saving 0.25 byte per element."""
    check_float_input(x, "resilu2")
    return _run(x, "silu", *_CONSTS32[("silu", 2)])


class ApproxAct(nn.Module):
    """Drop-in for the exact ``kind`` activation module that saves ``bits``-bit codes instead of its input."""

    def __init__(self, kind: str = "gelu", bits: int = 2):
        super().__init__()
        self.kind, self.bits = _kind(kind), _bits(bits)
        self._consts = _consts32(self.kind, self.bits)  # fail now, not in the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in SUPPORTED_FLOAT_DTYPES:
            check_float_input(x, type(self).__name__)
        consts = self.__dict__.get("_consts") or _consts32(self.kind, self.bits)  # (a module pickled before)
        return _run(x, self.kind, *consts)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, bits={self.bits}"


class ReGELU2(ApproxAct):
    """Drop-in for ``nn.GELU()`` (erf form) that saves 2-bit codes instead of its input."""

    def __init__(self):
        super().__init__("gelu", 2)


class ReSiLU2(ApproxAct):
    """Drop-in for ``nn.SiLU()`` that saves 2-bit codes instead of its input."""

    def __init__(self):
        super().__init__("silu", 2)


def make_approx(kind: str, bits: int = 2) -> nn.Module:
    """The approximate-activation module for ``kind`` (one of :data:`KINDS`) with ``bits`` bits per element.

    ``("gelu", 2)`` gives :class:`ReGELU2` and ``("silu", 2)`` :class:`ReSiLU2`; every other pair an
    :class:`ApproxAct`. Raises ValueError (listing the kinds) for an unknown kind."""
    kind, bits = _kind(kind), _bits(bits)
    if bits == 2 and kind == "gelu":
        return ReGELU2()
    if bits == 2 and kind == "silu":
        return ReSiLU2()
    return ApproxAct(kind, bits)

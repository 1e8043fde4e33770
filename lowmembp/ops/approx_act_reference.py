"""The approximate activations' definition and PyTorch reference: the kinds, their constants, the saved bytes.

Each element gets a ``bits``-bit code ``Σ_j [x > c_j]`` over the ``2**bits − 1`` breakpoints (compared in fp32
against the constants rounded to fp32; NaN compares false: code 0), packed as a little-endian bit stream: element i
occupies bits ``bits·i .. bits·i + bits − 1`` (for 2 bits: byte i // 4, bits 2·(i % 4) and 2·(i % 4) + 1, least
significant first — docs/design.md#approx-act). ONE flag byte follows: bit 0 = some input was NaN, bit 1 = some input
was +∞ for a kind whose derivative is unbounded there (``relu2``). Backward: ``dx = dy · s[code]`` with
``s_j = Σ_{i<=j} a_i`` (``s_0 = 0``) in fp32, cast back to dy's dtype — the derivative of the piecewise-linear
``h̃(x) = Σ a_i·max(x − c_i, 0)`` fitted to the activation (:mod:`lowmembp.ops.approx_derive`). +∞ gets the top code
(slope Σa = 1), −∞ code 0 (slope 0); when the flag says NaN the backward uses s_0 = NaN for that call (the NaN
elements and those left of c_1 get a NaN gradient), and for ``relu2`` with a +∞ input the top slope is +∞.

This reference (:func:`forward_reference`, :func:`backward_reference`) is the oracle: the Triton kernels
(:mod:`~lowmembp.ops.approx_act_triton`) and the CPU fast path (:mod:`~lowmembp.ops.approx_act_cpu`) give its codes
and gradients bit for bit; :mod:`lowmembp.ops.approx_act` is the op built on them.
"""
from __future__ import annotations

import math
import struct

import torch
import torch.nn.functional as F

from lowmembp.ops.approx_table import TABLE

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


def forward_reference(x: torch.Tensor, kind=_GELU, with_codes: bool = True, bits: int = 2):
    """Exact activation (fp32 compute, cast back) and, if asked, the saved bytes (packed codes + flag byte)."""
    kind = _kind(kind)
    return _fwd_reference(x, kind, _consts32(kind, _bits(bits))[0], with_codes)


def backward_reference(dy: torch.Tensor, packed: torch.Tensor, kind=_GELU, bits: int = 2) -> torch.Tensor:
    """``dx = dy · s[code]`` in fp32, cast back to dy's dtype."""
    return _bwd_reference(dy, packed, _consts32(_kind(kind), _bits(bits))[1])


"""The approximate activations' CPU fast path: the reference's arithmetic, bit for bit, with fewer passes over memory.

The forward output is the native op's (one whole-tensor call, as the reference makes), the packed codes one pass of
the C kernels (:mod:`lowmembp.ops.cpu_kernels`, compiled on first use), and the backward one C pass of
``dx = s[code]·dy``. Without the C kernels (no compiler, ``LOWMEMBP_CPU_KERNELS=0``) the same bits come from eager ATen
ops: the codes block by block (blocks small enough to stay in the core's cache, so that the several passes a block
takes read cache, not memory), the backward a lookup of four slopes per code byte and a multiply by dy block by
block. 2-bit codes only; everything else (other bit widths, non-finite inputs, big-endian machines) runs the
reference (:mod:`~lowmembp.ops.approx_act_reference`). :func:`fwd_node`: ReGELU2 / ReSiLU2 through the C++ extension
(``cpu_kernels/autograd.cpp``; with grad its autograd node: the same bits, a fraction of the Python route's host
time), or None.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch
import torch.nn.functional as F

from lowmembp.ops import cpu_kernels
from lowmembp.ops.approx_act_reference import (_GELU, _TABLES, _bits, _bwd_reference, _byte_table, _consts32,
                                               _exact_fp32, _fwd_reference, _kind, _slope_table, codes_reference,
                                               pack_codes, unpack_codes)
from lowmembp.ops.backend import CPU_BLOCK, SUPPORTED_FLOAT_DTYPES, cpu_block, cpu_parallel

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


_SLOPES_CPU: dict = {}  # slopes tuple -> its fp32 CPU tensor (the C backward's table)


def _const_tensor(values: tuple, device) -> torch.Tensor:
    key = ("t", values, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _TABLES[key]


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



# ------------------------------------------------------------------------------------- the C++ autograd node
_NODE_KINDS = {"gelu": 0, "silu": 1}  # the kinds autograd.cpp serves (2-bit codes); its kind ids
_NODE_NAMES = {k: kind for kind, k in _NODE_KINDS.items()}
_NODE: list = []  # [the set-up extension, or None when it is unavailable], filled on the first call


def _node_backward(dy: torch.Tensor, packed: torch.Tensor, k: int, graph: bool) -> torch.Tensor:
    """The node's backward where it does not compute dx itself: what the Python route computes (a double
    backward through the custom op ``lowmembp::approx_act_bwd``, else :func:`_bwd_cpu`)."""
    s32 = _consts32(_NODE_NAMES[k], 2)[1]
    if graph:
        from lowmembp.ops import approx_act  # the custom op (its module imports this one)
        return approx_act._approx_act_bwd(dy, packed, list(s32))
    return _bwd_cpu(dy, packed, s32)


def _node_setup():
    ext = cpu_kernels.extension() if _LITTLE_ENDIAN else None
    if ext is not None:
        for kind, k in _NODE_KINDS.items():
            ext.set_constants(k, *map(list, _consts32(kind, 2)))
        ext.set_callback(_node_backward)
    _NODE[:] = [ext]
    return ext


def fwd_node(x: torch.Tensor, kind: str, s32: tuple) -> torch.Tensor | None:
    """``kind`` on a plain CPU tensor through the C++ extension (built on the first call): y, with grad the codes
    saved on its autograd node, bit for bit the Python route's (``_fwd_cpu`` / ``_bwd_cpu``); None where it does not
    serve the call (another kind or bit width, NaN / ±inf inputs, fewer than 4 elements with grad, autocast, the
    extension unavailable): the caller then runs the Python route."""
    ext = _NODE[0] if _NODE else _node_setup()
    k = _NODE_KINDS.get(kind)
    if ext is None or k is None or len(s32) != 4:
        return None
    dtype = x.dtype
    return ext.approx_act(x, k, dtype is torch.float32 or native_act_exact(kind, dtype))

"""Mesa-style 8-bit activation compression (Pan et al., 2021): per-group int8 with EMA ranges, stochastic rounding.

What a layer saves for backward with this op: the uint8 codes, **1 byte per element**, plus **two fp32 scalars per
group** (the step α/255 and the minimum β, 8 bytes per group) — against 2 bytes per element for fp16/bf16 or 4 for
fp32. The backward dequantises and runs the exact backward of the layer on the dequantised tensor.

Groups: element ``i`` of the contiguous tensor belongs to group ``(i // inner) % G``. That one rule covers both
layouts Mesa uses:

- per head, for ``[B, H, N, D]`` tensors (attention operands, softmax output): ``G = H``, ``inner = N·D``;
- per channel group, for ``[..., C]`` tensors (linear / activation / norm inputs): ``G`` groups of ``C/G`` channels,
  ``inner = C/G``.

Ranges: per group a range α and minimum β, an exponential moving average across steps (λ = 0.9) with the current
batch included: the first step takes α = max − min, β = min of the batch; later steps
``α ← λα + (1−λ)(max − min)``, ``β ← λβ + (1−λ)·min`` — then the batch is quantised with the updated values.
Data parallel (``torch.distributed`` initialised with more than one process): min and max are those of the whole
global batch, reduced over the ranks before the update (:func:`reduce_over_ranks`), so every rank keeps one
process's ranges.
Non-finite statistics (a batch with an inf, a NaN, or a range that overflows fp32) do not update the ranges: that
batch is quantised with the ranges as they were, the update counter does not advance, the quantiser's ``skipped``
buffer counts it, and a RuntimeWarning says so once per quantiser (checked at once on CPU tensors; on CUDA every
64th call, to avoid a device sync per call; not under ``torch.compile``). One bad batch never poisons later steps.

Rounding: ``q = clamp(round((x − β)·255/α + u − 0.5), 0, 255)`` with u ~ U(0, 1), computed as
``clamp(floor((x − β)·(255/α) + u), 0, 255)`` (the same with round-half-up), so ``E[x̂] = x`` inside the range;
values outside [β, β + α] clamp to the ends (the original Mesa code wraps around in uint8 there; we clamp).
Dequantise: ``x̂ = q·(α/255) + β``. Within the range the error is below α/255 per element.

Random numbers: a counter-based hash of (seed, element index) — ``h = lowbias32(i·0x9E3779B9 + seed)``,
``u = (h >> 8)·2⁻²⁴`` — computed inside the Triton kernel (no float u tensor is ever materialised on the GPU) and by
the PyTorch reference in the same way, so kernel and reference agree bit for bit given the seed (indices are taken
modulo 2³²). The seed of each call is a 0-d int64 tensor drawn from torch's default CPU generator
(``torch.manual_seed`` makes a run reproducible) — a tensor, not a Python int, so that ``torch.compile`` neither
specialises on it nor recompiles per call.

Custom ops: quantise and dequantise are ``torch.library`` custom ops (``lowmembp::mesa_quantize`` /
``lowmembp::mesa_dequantize``) with fake implementations: ``torch.compile`` (CPU inductor included) keeps them as
opaque nodes — inductor never vectorises the integer hash — and FakeTensorMode / meta tensors only allocate the
outputs.

CPU reference: it works in chunks of :func:`get_chunk_size` elements (default 8192) so that its int64 / fp32
temporaries stay small; change that with :func:`set_chunk_size` or, for a block of code, ``with chunk_size(n):``.
Shape-only tensors (``FakeTensorMode`` or the meta device, e.g. :mod:`lowmembp.estimator.step`) carry no values: there
the
reference allocates the output only (uint8 codes, or the dequantised tensor), in one piece, as the Triton kernel
does — no chunk loop, no temporaries.

CPU fast path (:func:`quantize_cpu`, :func:`dequantize_cpu`, the default on CPU tensors): the reference's
arithmetic, bit for bit, in one pass of the C kernels of :mod:`lowmembp.ops.cpu_kernels` (the hash in wrapping 32-bit
integers, each group's scale and β per row), or, without a C compiler, in eager ATen ops over cache-sized blocks of
whole group rows.

Backend: Triton on CUDA tensors, the CPU fast path on CPU tensors, the PyTorch reference elsewhere and under
``LOWMEMBP_BACKEND=torch`` (:func:`lowmembp.ops.backend.backend_for`). Kernels
load, cast to fp32, compute, cast back (bf16 arithmetic is never used); fp32, fp16 and bf16 inputs are accepted.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from lowmembp.ops.backend import (
    CPU_BLOCK,
    SUPPORTED_FLOAT_DTYPES,
    backend_for,
    check_float_input,
    cpu_block,
    cpu_parallel,
    eager_backend,
    is_shape_only,
    stream_capturing,
)
from lowmembp._compat import unset_fake_temporarily
from lowmembp.ops import cpu_kernels
from lowmembp.ops.launch import Launcher

_WARN_EVERY_CUDA = 64  # a CUDA quantiser checks its skipped-update counter (a device sync) every this many calls

try:  # pragma: no cover - triton is optional on CPU machines
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

MOMENTUM = 0.9
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_H1 = 0x7FEB352D
_H2 = 0x846CA68B
_MIN_RANGE = 1e-12  # a constant group (α = 0) quantises to β exactly
_fused_pack = True


def fused_pack_enabled() -> bool:
    """Whether :meth:`EMAQuantizer.pack` runs its one-call CPU path where it can (default True)."""
    return _fused_pack


def set_fused_pack(enabled: bool) -> bool:
    """Turn :meth:`EMAQuantizer.pack`'s one-call CPU path on or off (off: the ATen ops of :func:`group_min_max`,
    :func:`ema_update` and :func:`quantize`, the same bits); returns the previous setting."""
    global _fused_pack
    old, _fused_pack = _fused_pack, bool(enabled)
    return old


# ----------------------------------------------------------------------------------------------------------- groups
def group_layout(x: torch.Tensor, mode: str, num_groups: int | None = None) -> tuple[int, int]:
    """``(inner, G)`` for ``x``: ``mode="head"`` for [B, H, N, D] (G = H) or ``"channel"`` (G groups of the last
    dim)."""
    if mode == "head":
        if x.dim() != 4:
            raise ValueError(f"per-head quantisation needs a [B, H, N, D] tensor, got shape {tuple(x.shape)}")
        return x[0, 0].numel(), x.shape[1]
    if mode == "channel":
        c = x.shape[-1]
        g = channel_groups(c, num_groups or 1)
        return c // g, g
    raise ValueError(f"group mode must be 'head' or 'channel', got {mode!r}")


def channel_groups(channels: int, wanted: int) -> int:
    """The number of channel groups actually used: ``gcd(channels, wanted)`` (groups must divide the channels)."""
    if wanted < 1:
        raise ValueError(f"the number of channel groups must be >= 1, got {wanted}")
    a, b = channels, int(wanted)  # Euclid by hand: math.gcd does not take the SymInt a compiled graph passes here
    while b:
        a, b = b, a % b
    return a


def group_min_max(x: torch.Tensor, inner: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group minimum and maximum of ``x`` (fp32, shape [G])."""
    x3 = x.detach().reshape(-1, groups, inner)
    return x3.amin(dim=(0, 2)).float(), x3.amax(dim=(0, 2)).float()


def reduce_over_ranks(mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Data parallel (``torch.distributed`` initialised, more than one process): the minimum and maximum over every
    rank's batch (one all-reduce), so that every rank's EMA follows the statistics of the whole global batch, as one
    process with that batch would (DDP's broadcast of rank 0's buffers then changes nothing). Otherwise unchanged.
    Every rank must quantise the same sites in the same order, as data-parallel training does."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or is_shape_only(mn):
        return mn, mx
    both = torch.cat([-mn, mx])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return -both[:mn.numel()], both[mn.numel():]


def ema_update(alpha: torch.Tensor, beta: torch.Tensor, count: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor,
               momentum: float = MOMENTUM) -> torch.Tensor:
    """In place: the first call sets α = max − min, β = min; later ``α ← λα + (1−λ)(max−min)``, same for β.

    ``count`` (a 0-d int64 tensor) counts the updates. A batch whose statistics are not all finite (min, max and
    their difference, every group) leaves α, β and ``count`` unchanged. Returns that verdict as a 0-d bool tensor
    (True: updated); no host synchronisation happens (``torch.where``).
    """
    first = count == 0
    rng = mx - mn
    ok = torch.isfinite(rng).all() & torch.isfinite(mn).all()
    alpha.copy_(torch.where(ok, torch.where(first, rng, momentum * alpha + (1 - momentum) * rng), alpha))
    beta.copy_(torch.where(ok, torch.where(first, mn, momentum * beta + (1 - momentum) * mn), beta))
    count.add_(ok.to(count.dtype))
    return ok


# ------------------------------------------------------------------------------------------------------- the format
@dataclass
class QTensor:
    """An 8-bit tensor: ``codes`` (uint8, the shape of the original), per-group ``step`` = α/255 and ``beta`` (fp32)."""
    codes: torch.Tensor
    step: torch.Tensor
    beta: torch.Tensor
    inner: int
    groups: int
    dtype: torch.dtype

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.step, self.beta

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def quantize(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
             seed: int | torch.Tensor | None = None) -> QTensor:
    """Quantise ``x`` to 8 bits with per-group range ``alpha`` and minimum ``beta`` (fp32 [G]), stochastic rounding.

    ``seed``: an int or a 0-d integer tensor; ``None`` draws one (:func:`draw_seed_tensor`)."""
    check_float_input(x, "mesa quantize")
    _check_groups(x, inner, groups, alpha, beta)
    alpha = alpha.detach().float().clamp_min(_MIN_RANGE)
    scale = 255.0 / alpha  # [G], fresh and contiguous
    step = alpha / 255.0
    beta = beta.detach().float().clone()
    backend = eager_backend(x)
    if backend is not None:  # a kernel without the custom op's dispatch
        if seed is None:  # a CUDA graph being captured: drawn on the device, so that every replay draws anew
            seed = draw_seed_tensor(x.device) if stream_capturing() else int(draw_seed_tensor())
        elif not (backend == "triton" and isinstance(seed, torch.Tensor) and seed.device == x.device):
            seed = int(seed)
        codes = _quantize_on(backend, x.detach().contiguous(), scale, beta, inner, groups, seed)
        return QTensor(codes, step, beta, inner, groups, x.dtype)
    if seed is None:  # traced: on x's device (a compiled CUDA graph then replays a fresh draw)
        seed = draw_seed_tensor(x.device)
    elif not isinstance(seed, torch.Tensor):
        seed = torch.tensor(int(seed), dtype=torch.int64)
    codes = _mesa_quantize_op(x.detach(), scale, beta, inner, groups, seed)
    return QTensor(codes, step, beta, inner, groups, x.dtype)


def dequantize(qt: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x̂ = q·step + β`` per group, in ``dtype`` (default: the dtype that was quantised)."""
    backend = eager_backend(qt.codes)
    if backend is not None:  # a kernel without the custom op's dispatch
        return _dequantize_on(backend, qt.codes.contiguous(), qt.step, qt.beta, qt.inner, qt.groups, dtype or qt.dtype)
    return _mesa_dequantize_op(qt.codes, qt.step, qt.beta, qt.inner, qt.groups, dtype or qt.dtype)


@torch.library.custom_op("lowmembp::mesa_quantize", mutates_args=())
def _mesa_quantize_op(x: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                      seed: torch.Tensor) -> torch.Tensor:
    """uint8 codes of x (x's shape): Triton or the reference; ``seed`` a 0-d integer tensor (any device: on x's
    CUDA device the Triton kernel reads it there, without a host synchronisation)."""
    backend = backend_for(x)
    if not (backend == "triton" and seed.device == x.device):
        seed = int(seed)
    return _quantize_on(backend, x.contiguous(), scale, beta, inner, groups, seed)


@_mesa_quantize_op.register_fake
def _(x, scale, beta, inner, groups, seed):
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


@torch.library.custom_op("lowmembp::mesa_dequantize", mutates_args=())
def _mesa_dequantize_op(codes: torch.Tensor, step: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``q·step[g] + β[g]`` in ``dtype`` (codes' shape)."""
    return _dequantize_on(backend_for(codes), codes.contiguous(), step, beta, inner, groups, dtype)


@_mesa_dequantize_op.register_fake
def _(codes, step, beta, inner, groups, dtype):
    return torch.empty(codes.shape, dtype=dtype, device=codes.device)


def draw_seed_tensor(device=None) -> torch.Tensor:
    """A 0-d int64 seed in [0, 2³¹ − 1) from torch's default generator of ``device`` (default the CPU's; traceable:
    no ``.item()``; on a CUDA device graph-safe: a captured CUDA graph draws a new one at every replay)."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device or "cpu")


def draw_seed() -> int:
    """A seed in [0, 2³¹ − 1) from torch's default CPU generator (``torch.manual_seed`` reproduces the sequence).

    Drawn on a real CPU tensor with any ``FakeTensorMode`` unset for the moment, so it also works while the data are
    fake or on the meta device (a fake tensor has no value to read back)."""
    with unset_fake_temporarily():
        return int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item())


def _check_groups(x, inner, groups, alpha, beta):
    if inner * groups == 0 or x.numel() % (inner * groups) != 0:
        raise ValueError(f"mesa quantize: {x.numel()} elements do not split into groups of inner={inner} x G={groups}")
    if alpha.numel() != groups or beta.numel() != groups:
        raise ValueError(f"mesa quantize: alpha/beta need {groups} entries, got {alpha.numel()}/{beta.numel()}")


# ------------------------------------------------------------------------------------------- PyTorch reference
def hash_uniform(n: int, seed: int, device=None, start: int = 0) -> torch.Tensor:
    """The counter-based uniforms in [0, 1) for element indices ``start .. start+n-1`` (fp32, exact multiples of
    2⁻²⁴)."""
    i = torch.arange(start, start + n, device=device, dtype=torch.int64) & _MASK32
    h = (i * _GOLDEN + (int(seed) & _MASK32)) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _H1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _H2) & _MASK32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (2.0 ** -24)


DEFAULT_CHUNK = 1 << 13  # the references work in chunks so that their int64 / fp32 temporaries stay small
_chunk = DEFAULT_CHUNK


def get_chunk_size() -> int:
    """Elements per chunk of the CPU references (:func:`quantize_ref`, :func:`dequantize_ref`)."""
    return _chunk


def set_chunk_size(elements: int | None) -> int:
    """Set the elements per chunk of the CPU references (``None``: the default, 8192); returns the previous value.

    Larger chunks mean fewer Python-level ops and larger temporaries (about 40 bytes per element of a chunk). The
    codes do not depend on it: the random numbers are indexed by element, not by chunk."""
    global _chunk
    if elements is None:
        elements = DEFAULT_CHUNK
    if isinstance(elements, bool) or not isinstance(elements, int) or elements < 1:
        raise ValueError(f"mesa chunk size must be a positive int (elements), got {elements!r}")
    old, _chunk = _chunk, elements
    return old


@contextlib.contextmanager
def chunk_size(elements: int | None):
    """``with chunk_size(n): ...``: the CPU references use chunks of ``n`` elements inside the block."""
    old = set_chunk_size(elements)
    try:
        yield
    finally:
        set_chunk_size(old)


def _chunk_for(chunk: int | None) -> int:
    if chunk is None:
        return _chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"mesa chunk must be a positive int (elements), got {chunk!r}")
    return chunk


def _group_index(start: int, n: int, inner: int, groups: int, device) -> torch.Tensor:
    return (torch.arange(start, start + n, device=device) // inner) % groups


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                 seed: int, chunk: int | None = None) -> torch.Tensor:
    """Reference quantiser: ``clamp(floor((x − β[g])·scale[g] + u), 0, 255)`` as uint8, ``scale = 255/α``.

    ``chunk``: elements per step (default :func:`get_chunk_size`); the result does not depend on it. On a fake or
    meta ``x`` only the output is allocated (there are no values to compute)."""
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    if is_shape_only(x):
        return out.reshape(x.shape)
    n_chunk = _chunk_for(chunk)
    for start in range(0, flat.numel(), n_chunk):
        n = min(n_chunk, flat.numel() - start)
        g = _group_index(start, n, inner, groups, x.device)
        y = (flat[start:start + n].float() - beta[g]) * scale[g]
        q = torch.floor(y + hash_uniform(n, seed, x.device, start)).clamp_(0, 255)
        out[start:start + n] = q.to(torch.uint8)
    return out.reshape(x.shape)


def dequantize_ref(codes: torch.Tensor, step: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                   dtype: torch.dtype, chunk: int | None = None) -> torch.Tensor:
    """Reference dequantiser: ``q·step[g] + β[g]`` in fp32, cast to ``dtype`` (``chunk`` as in :func:`quantize_ref`)."""
    flat = codes.reshape(-1)
    out = torch.empty(flat.shape, dtype=dtype, device=codes.device)
    if is_shape_only(codes):
        return out.reshape(codes.shape)
    n_chunk = _chunk_for(chunk)
    for start in range(0, flat.numel(), n_chunk):
        n = min(n_chunk, flat.numel() - start)
        g = _group_index(start, n, inner, groups, codes.device)
        out[start:start + n] = (flat[start:start + n].float() * step[g] + beta[g]).to(dtype)
    return out.reshape(codes.shape)


# ------------------------------------------------------------------------------------------------ CPU fast path
# The reference's arithmetic, bit for bit, in one pass of the C kernels (lowmembp.ops.cpu_kernels, compiled on first
# use: the hash in wrapping uint32 arithmetic, each group's scale and β per row of ``inner`` elements). Without them
# (no compiler, LOWMEMBP_CPU_KERNELS=0) eager ATen ops give the same bits: blocks of whole group rows (``inner``
# consecutive elements share a group) that stay in the core's cache, each group's scale and β broadcast over its row
# (no per-element index or gather), and the hash in 32-bit integers (wrapping multiplies and adds are the reference's
# arithmetic modulo 2³²; a masked arithmetic shift is its logical shift), in place in preallocated buffers.
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


# --------------------------------------------------------------------------------------------------- Triton kernels
_BLOCK = 1024

if triton is not None:
    @triton.jit
    def _mesa_quant_kernel(X, Q, SCALE, BETA, n, inner, G, seed, SEED_PTR: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
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
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
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


def _quantize_on(backend: str, x, scale, beta, inner, groups, seed) -> torch.Tensor:
    """Quantise on ``backend`` (``lowmembp.ops.backend.backend_for``); x contiguous; ``seed`` an int (or, for
    Triton, a 0-d integer tensor on x's device)."""
    if backend == "triton":
        return _quantize_triton(x, scale, beta, inner, groups, seed)
    if backend == "cpu":
        return quantize_cpu(x, scale, beta, inner, groups, seed)
    return quantize_ref(x, scale, beta, inner, groups, seed)


def _dequantize_on(backend: str, codes, step, beta, inner, groups, dtype) -> torch.Tensor:
    """Dequantise on ``backend``; codes contiguous."""
    if backend == "triton":
        return _dequantize_triton(codes, step, beta, inner, groups, dtype)
    if backend == "cpu":
        return dequantize_cpu(codes, step, beta, inner, groups, dtype)
    return dequantize_ref(codes, step, beta, inner, groups, dtype)


# ------------------------------------------------------------------------------------------------------ the module
class EMAQuantizer(nn.Module):
    """Holds one tensor site's EMA ranges (buffers ``alpha``, ``beta``, ``count``; not in the state dict).

    ``mode="head"`` (per head of [B, H, N, D]) or ``"channel"`` (``num_groups`` channel groups, reduced to a divisor
    of the channel count). In training mode :meth:`pack` updates the EMA with the batch before quantising; in eval
    mode it uses the stored ranges (or, before any training step, the batch's own range).
    """

    def __init__(self, num_groups: int, mode: str = "channel", momentum: float = MOMENTUM):
        super().__init__()
        if mode not in ("head", "channel"):
            raise ValueError(f"EMAQuantizer mode must be 'head' or 'channel', got {mode!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"EMA momentum must be in [0, 1), got {momentum}")
        self.mode, self.num_groups, self.momentum = mode, int(num_groups), float(momentum)
        self.register_buffer("alpha", torch.zeros(self.num_groups), persistent=False)
        self.register_buffer("beta", torch.zeros(self.num_groups), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("skipped", torch.zeros((), dtype=torch.int64), persistent=False)  # non-finite batches
        self._updated = False  # whether an EMA update has happened (known without reading ``count`` back)
        self._warned = False
        self._calls = 0

    def extra_repr(self) -> str:
        return f"mode={self.mode}, groups={self.num_groups}, momentum={self.momentum}"

    def pack(self, x: torch.Tensor) -> QTensor:
        inner, groups = group_layout(x, self.mode, self.num_groups)
        if groups != self.alpha.numel():
            if self.mode == "head":
                raise ValueError(f"EMAQuantizer built for {self.alpha.numel()} heads got {groups} heads")
            # fewer channel groups than asked (gcd): resize once, before the first update
            self._resize(groups, x.device)
        seed = None
        if self.training and fused_pack_enabled() and self._fusable(x):
            seed = draw_seed_tensor()  # the one draw of the call, as quantize makes it below
            qt = self._pack_cpu(x.detach(), inner, groups, seed)
            if qt is not None:
                return qt
        with torch.no_grad():
            mn, mx = group_min_max(x, inner, groups)
            if self.training:
                mn, mx = reduce_over_ranks(mn, mx)  # torchrun/DDP: the global batch's statistics
                ok = ema_update(self.alpha, self.beta, self.count, mn, mx, self.momentum)
                self.skipped.add_((~ok).to(self.skipped.dtype))
                self._updated = True
                alpha, beta = self.alpha, self.beta
                if not torch.compiler.is_compiling():
                    self._maybe_warn(x)
            else:
                started = self.count > 0
                alpha = torch.where(started, self.alpha, mx - mn)
                beta = torch.where(started, self.beta, mn)
        return quantize(x, alpha, beta, inner, groups, seed)

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether :meth:`_pack_cpu` may run: a plain eager CPU tensor on the CPU fast path, fp32 CPU ranges, int64
        counters, and no data-parallel group of more than one process (whose statistics are all-reduced)."""
        if eager_backend(x) != "cpu" or x.numel() == 0 or x.dtype not in SUPPORTED_FLOAT_DTYPES:
            return False
        buf = self._buffers  # (not Module.__getattr__: this runs on every call)
        a, b, c, k = buf["alpha"], buf["beta"], buf["count"], buf["skipped"]
        if not (a.dtype is b.dtype is torch.float32 and c.dtype is k.dtype is torch.int64):
            return False
        if not (a.is_cpu and b.is_cpu and c.is_cpu and k.is_cpu and a.is_contiguous() and b.is_contiguous()
                and a.numel() == b.numel() and c.numel() == k.numel() == 1):
            return False
        dist = torch.distributed
        return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)

    def _pack_cpu(self, x: torch.Tensor, inner: int, groups: int, seed: torch.Tensor) -> QTensor | None:
        """Training-mode :meth:`pack` in one C call (:func:`lowmembp.ops.cpu_kernels.mesa_pack8`): the same ranges,
        counters, codes, step and β bit for bit as :func:`group_min_max`, :func:`ema_update` and :func:`quantize`.
        None where the ATen ops must run instead (no C kernels; a -0.0 at a group's min or max), nothing changed."""
        xc = x.contiguous()
        codes = torch.empty_like(xc, dtype=torch.uint8)  # contiguous as xc
        step, beta, scale = (xc.new_empty(groups, dtype=torch.float32) for _ in range(3))
        s = int(seed)
        buf = self._buffers  # checked by _fusable; pack made alpha's size the groups
        flags = cpu_kernels.mesa_pack8_trusted(xc, xc.numel(), inner, groups, buf["alpha"], buf["beta"],
                                               buf["count"], buf["skipped"], self.momentum, _MIN_RANGE, s, step,
                                               beta, scale, codes)
        if flags is None or flags & cpu_kernels.PACK8_AMBIGUOUS:
            return None
        if not self._updated:
            self._updated = True
        if flags & cpu_kernels.PACK8_NAN:  # a NaN code: ATen's conversion decides it (the eager ops)
            codes = quantize_cpu(xc, scale, beta, inner, groups, s)
        if flags & cpu_kernels.PACK8_SKIPPED and not self._warned:  # the skipped counter, read by the C call
            self._warn_skipped()
        return QTensor(codes, step, beta, inner, groups, x.dtype)

    def _maybe_warn(self, x: torch.Tensor) -> None:
        """Warn once if a batch's statistics were non-finite (CPU: every call; CUDA: every 64th, one sync)."""
        if self._warned or is_shape_only(self.skipped) or stream_capturing():  # no value to read (fake / meta
            return  # buffers), or none to read now (a CUDA graph being captured: no host synchronisation)
        self._calls += 1
        if x.device.type != "cpu" and self._calls % _WARN_EVERY_CUDA:
            return
        if int(self.skipped) > 0:
            self._warn_skipped()

    def _warn_skipped(self) -> None:
        self._warned = True
        warnings.warn(f"mesa EMAQuantizer({self.extra_repr()}): a batch with non-finite statistics (inf/NaN, "
                      f"or a range that overflows fp32) was seen; it did not update the EMA ranges, which keep "
                      f"their last finite values (skipped updates so far: {int(self.skipped)}; this warning is "
                      f"shown once per quantiser)", RuntimeWarning, stacklevel=5)

    def _resize(self, groups: int, device) -> None:
        if getattr(self, "_updated", False):
            raise ValueError(f"EMAQuantizer: channel groups changed from {self.alpha.numel()} to {groups} "
                             "after training started (the layer saw inputs of another width)")
        self.alpha = torch.zeros(groups, device=device)
        self.beta = torch.zeros(groups, device=device)

"""MS-BP norms: MS-LayerNorm and MS-RMSNorm without affine parameters (Yang et al., ICML 2024; docs/design.md#ms-norms).

Forward (statistics in fp32, over the last dimension of size N):
    LayerNorm  y = (x - mean(x)) * rstd,   rstd = 1 / sqrt(var(x) + eps)
    RMSNorm    y = x * rstd,               rstd = 1 / sqrt(mean(x^2) + eps)
Saved for backward: the OUTPUT ``y`` (the very tensor returned, in the output dtype) and ``rstd`` (fp32, one per row),
never the input. Per element that is the output's element size (4 bytes fp32, 2 bytes bf16/fp16) plus 4/N bytes
for rstd; and because the following linear layer saves its input ``y`` anyway, the norm+linear pair stores one
tensor instead of two (the norm's own cost is then only 4 bytes per row).
Backward from the output (g the upstream gradient, means over the normalised dimension):
    LayerNorm  dx = rstd * (g - mean(g) - y * mean(g*y))
    RMSNorm    dx = rstd * (g - y * mean(g*y))

Sharing with the next linear layer needs the linear to save the same storage: no cast, copy or dropout between.
Under autocast the norm therefore emits the autocast dtype (``torch.get_autocast_dtype``), so the linear's input
cast is a no-op; outside autocast it emits the input's dtype. The gradient is returned in the input's dtype.
peft LoRA layers cast their input to the adapter weight dtype; see ``lowmembp.ops.shared_linear`` for that case.

The output dtype is an option (``out_dtype`` of the modules and functions, one of :data:`OUT_DTYPES`):
``"auto"`` (default, the above), ``"input"`` (always the input's dtype: what the official lomem kernel does,
``lomem/csrc/layer_norm.cpp:20`` allocates the output with ``input.options()``, so under AMP with an fp32 residual
stream it emits and saves fp32) and ``"fp32"`` (always float32). With ``"input"`` / ``"fp32"`` under fp16/bf16
autocast the saved output is 4 bytes per element instead of 2, and the next linear shares it only if it saves its
input as given: ``lowmembp.ops.shared_linear.linear_sharing_input`` does (a trainable ``nn.Linear`` under autocast
saves its own 16-bit copy; a frozen one saves no input).

Backends (``lowmembp.ops.backend.backend_for``): Triton kernels on CUDA tensors (one program per few rows, a block of
next_power_of_2(N) columns, 64-bit row offsets), on CPU tensors the CPU fast path (bit for bit equal to the
reference: LayerNorm's forward one C call replicating ATen's CPU norm, RMSNorm's C casts around ATen's fp32 norm, the
backward one C call with ATen's row-sum order: ``ms_norm_fwd_cpu`` / ``ms_norm_bwd_cpu``), the PyTorch reference
elsewhere and under ``LOWMEMBP_BACKEND=torch`` (vectorised: ``native_layer_norm`` / ``_fused_rms_norm`` on fp32).
Rows wider than ``MAX_TRITON_N`` use the reference too.

The op is a ``torch.library`` custom op (``lowmembp::ms_norm_fwd`` / ``lowmembp::ms_norm_bwd``, fake implementations
and registered autograd): ``torch.compile`` sees one opaque node (no graph break, ``_fused_rms_norm`` and the Triton
interpreter are never traced) and FakeTensorMode / meta tensors take the fake implementation (the same y and rstd
allocations). Double backward, ``torch.func`` gradient transforms and forward-mode AD raise an error naming the op
and what to use instead (``torch.func.vmap`` alone works).

Pure functions for scripts (e.g. ``benchmarks/gpu_check.py``); any shape, normalised over the last dim, rows = the
product of the leading dims:
    ms_norm_fwd_triton(x, kind, eps, out_dtype=None) -> (y of x's shape, rstd [rows] fp32)
    ms_norm_bwd_triton(g, y, rstd, kind, dx_dtype)    -> dx of y's shape
    ms_norm_fwd_ref / ms_norm_bwd_ref                   same signatures, PyTorch
    ms_norm_bytes(rows, N, x_dtype, y_dtype, kind)      -> (forward bytes moved, backward bytes moved)
``kind`` is ``"layernorm"`` or ``"rmsnorm"``. The autograd functions ``ms_layer_norm(x, eps, out_dtype="auto")`` /
``ms_rms_norm`` and the modules ``MSLayerNorm`` / ``MSRMSNorm`` take ``out_dtype`` as above.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lowmembp.ops.backend import (CPU_BLOCK, SUPPORTED_FLOAT_DTYPES, autocast_dtype, backend_for, check_float_input,
                                  cpu_block, cpu_parallel, eager_backend, refuse_functorch_transforms)
from lowmembp._compat import fused_rms_norm
from lowmembp.ops import cpu_kernels
from lowmembp.ops.launch import Launcher
from lowmembp.ops.skeleton import OpFamily

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing or broken: reference only
    triton = None

KINDS = ("layernorm", "rmsnorm")
OUT_DTYPES = ("auto", "input", "fp32")  # the norm's output (and saved) dtype; see the module doc
MAX_TRITON_N = 32768  # widest row held in one block; wider rows use the reference
_TILE = 4096  # elements per program (rows * BLOCK) for narrow rows


# ----------------------------------------------------------------------------------------------------------- Triton
if triton is not None:

    @triton.jit
    def _ms_norm_fwd_kernel(X, Y, RSTD, n_rows, N, stride_x, stride_y, eps,
                            IS_RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols < N)[None, :]
        n_f = tl.cast(N, tl.float32)
        eps_f = tl.cast(eps, tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / n_f
            xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / n_f
        rstd = 1.0 / tl.sqrt(var + eps_f)
        y = xc * rstd[:, None]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_ok)

    @triton.jit
    def _ms_norm_bwd_kernel(G, Y, RSTD, DX, n_rows, N, stride_g, stride_y, stride_dx,
                            IS_RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols < N)[None, :]
        n_f = tl.cast(N, tl.float32)
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        mgy = tl.sum(g * y, axis=1) / n_f
        if IS_RMS:
            dx = g - y * mgy[:, None]
        else:
            mg = tl.sum(g, axis=1) / n_f
            dx = g - mg[:, None] - y * mgy[:, None]
        dx = dx * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    _FWD = Launcher(_ms_norm_fwd_kernel)
    _BWD = Launcher(_ms_norm_bwd_kernel)


_CFG: dict = {}


def _launch_cfg(n_rows: int, n: int):
    """(BLOCK columns, ROWS per program, num_warps) for rows of n elements (cached per n and small row counts)."""
    key = (min(n_rows, 16), n)
    cfg = _CFG.get(key)
    if cfg is None:
        block = triton.next_power_of_2(n)
        rows = max(1, min(_TILE // block, 16, triton.next_power_of_2(max(n_rows, 1))))
        cfg = _CFG[key] = block, rows, min(8, max(1, rows * block // 256))
    return cfg


def _check_kind(kind: str) -> bool:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind == "rmsnorm"


def _unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def ms_norm_fwd_triton(x: torch.Tensor, kind: str, eps: float, out_dtype: torch.dtype | None = None):
    """Triton forward over the last dim of x: returns (y of x's shape in out_dtype, rstd [rows] fp32)."""
    if triton is None:
        raise RuntimeError("triton is not importable: use ms_norm_fwd_ref or install triton")
    is_rms = _check_kind(kind)
    n = x.shape[-1]
    x2d = x.view(-1, n) if x.is_contiguous() else _unit_col_stride(x.reshape(-1, n))
    n_rows = x2d.shape[0]
    y = torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=torch.contiguous_format)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    if n_rows == 0 or n == 0:
        return y, rstd.fill_(float(eps) ** -0.5)
    block, rows, warps = _launch_cfg(n_rows, n)
    _FWD(-(-n_rows // rows), (x2d, y, rstd, n_rows, n, x2d.stride(0), n, float(eps)), (is_rms, rows, block), warps,
         x.get_device())
    return y, rstd


def ms_norm_bwd_triton(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, kind: str, dx_dtype: torch.dtype):
    """Triton backward from the output: dx of y's shape in dx_dtype."""
    if triton is None:
        raise RuntimeError("triton is not importable: use ms_norm_bwd_ref or install triton")
    is_rms = _check_kind(kind)
    n = y.shape[-1]
    g2d = g.view(-1, n) if g.is_contiguous() else _unit_col_stride(g.reshape(-1, n))
    y2d = y.view(-1, n) if y.is_contiguous() else _unit_col_stride(y.reshape(-1, n))
    n_rows = y2d.shape[0]
    dx = torch.empty_like(y, dtype=dx_dtype, memory_format=torch.contiguous_format)
    if dx.numel() == 0:
        return dx
    block, rows, warps = _launch_cfg(n_rows, n)
    _BWD(-(-n_rows // rows), (g2d, y2d, rstd, dx, n_rows, n, g2d.stride(0), y2d.stride(0), n), (is_rms, rows, block),
         warps, y.get_device())
    return dx


# -------------------------------------------------------------------------------------------------------- reference
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


# ------------------------------------------------------------------------------------------------ CPU fast path
# The reference's arithmetic, bit for bit, in C (lowmembp.ops.cpu_kernels). The backward runs whole in C, row by row:
# the sums of the row's g·y (and LayerNorm's fp32 g) in the order of ATen's CPU `sum` (kernels.c replicates its cascade
# sum for the vector width a probe at first use finds, cpu_kernels.aten_sum_width(); straight from g and y where they
# share a dtype and the width is 8, else from a scratch row in the core's cache), then the addcmul, mean subtraction,
# rstd product and rounding to dx's dtype; the rows split over an OpenMP team. Where the probe finds no width (another
# torch's sum) the backward is two C passes around ATen's own row sums, over blocks of whole rows that stay in the cache
# on one thread and over the whole tensor on more; so is the backward of a single row of 32768 or more elements, which
# ATen sums over threads in two passes. The LayerNorm forward runs whole in C, row by row over an OpenMP team
# (cpu_kernels.layer_norm_fwd): ATen's CPU LayerNorm (its Welford moments, rstd and output line; each row on one thread,
# as ATen's) for the variant a probe at first use finds (cpu_kernels.layer_norm_variant(): the vector width and which
# multiply-adds torch's build fused), reading x in its dtype and rounding y once to its own, fp32 in and out included.
# Where no variant matches (another torch), and for RMSNorm, the forward is C casts around ATen's fp32 norm (its
# statistics stay ATen's), and fp32 in and out is the reference's one native call. A NaN in the result (whose bits
# ATen's conversions decide) recomputes the call with the reference. Without the C kernels the reference's own ops run
# over row blocks spread over threads by cpu_parallel. Either way the results are the same bits
# (tests/ops/test_cpu_fastpath.py, tests/ops/test_cpu_norm_kernels.py). Rows too wide for a block, strided rows (whose
# sums ATen orders by the layout), float64 and empty inputs run the reference.
_CPU_BLOCK = CPU_BLOCK  # elements per block; the blocks are spread over threads by cpu_parallel
_CPU_MAX_N = CPU_BLOCK  # wider rows: the reference (a block holds at least one row)
# elements per pass of the C kernels on one thread (measured best on a 2 MiB L2): backward (fp32 g, y, g·y: 768 KiB)
# and forward (fp32 x and y: 1 MiB)
_KERNEL_BLOCK, _KERNEL_BLOCK_FWD = 1 << 16, 1 << 17
_SMALL = 1 << 14  # elements below which the forward's C casts around ATen's norm cost more than the reference's ops
_ATEN_GRAIN = 32768  # at::internal::GRAIN_SIZE: ATen reduces a single row this long in two passes over threads


def _row_block(n: int) -> int:
    return max(1, cpu_block(_CPU_BLOCK) // n)


_FLOATS = SUPPORTED_FLOAT_DTYPES  # the dtypes the CPU fast path reads and writes


def _cpu_fast(t: torch.Tensor, n: int) -> bool:
    return t.is_cpu and t.dtype in _FLOATS and t.numel() > 0 and n <= _CPU_MAX_N


def ms_norm_fwd_cpu(x: torch.Tensor, kind: str, eps: float, out_dtype: torch.dtype | None = None):
    """CPU fast path of :func:`ms_norm_fwd_ref` (same signature, same bits): LayerNorm whole in C with ATen's
    arithmetic (:func:`lowmembp.ops.cpu_kernels.layer_norm_fwd`) where the probe replicates this torch's, else the
    reference's casts in C (:mod:`lowmembp.ops.cpu_kernels`) around ATen's fp32 norm, else its ops row block by row
    block."""
    _check_kind(kind)
    out_dtype = out_dtype or x.dtype
    n = x.shape[-1]
    if not (_cpu_fast(x, n) and x.is_contiguous() and out_dtype in _FLOATS):
        return ms_norm_fwd_ref(x, kind, eps, out_dtype)  # a strided input's row statistics follow its layout
    if kind == "layernorm":  # whole in C; y in x's shape (a base tensor, not a view: cheaper through autograd)
        rows = x.numel() // n
        y = torch.empty_like(x, dtype=out_dtype)
        rstd = x.new_empty(rows, dtype=torch.float32)
        nan = cpu_kernels.layer_norm_fwd_trusted(x, rows, n, eps, y, rstd)  # None: no library, or no variant
        if nan == 0:
            return y, rstd
        if nan:  # a NaN: its bits (and its row's rstd) are the reference's
            return ms_norm_fwd_ref(x, kind, eps, out_dtype)
    kernels = cpu_kernels.library() is not None
    if (x.dtype == torch.float32 and out_dtype == torch.float32) or x.numel() < _SMALL:
        # fp32 in and out: the reference is one native call already; a small tensor: its three calls cost less
        # than the blocks' and casts' set-up (the same bits either way)
        return ms_norm_fwd_ref(x, kind, eps, out_dtype)
    x2d = x.reshape(-1, n)
    rows = x2d.shape[0]
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if kernels:
        if _fwd_kernels(x2d, kind, eps, y, rstd):  # a NaN: its bits (and its row's rstd) are the reference's
            return ms_norm_fwd_ref(x, kind, eps, out_dtype)
        return y.reshape(x.shape), rstd
    step = _row_block(n)

    def work(lo, hi):
        xbuf = torch.empty((min(step, hi - lo), n), dtype=torch.float32) if x.dtype != torch.float32 else None
        for r in range(lo, hi, step):
            e = min(r + step, hi)
            xb = x2d[r:e] if xbuf is None else xbuf[:e - r].copy_(x2d[r:e])  # the reference's x.to(fp32)
            yb, rb = ms_norm_fwd_ref(xb, kind, eps, torch.float32)  # fp32 in and out: the native call alone
            y[r:e].copy_(yb)  # the reference's y.to(out_dtype), straight into the output
            rstd[r:e].copy_(rb)

    cpu_parallel(rows, step, work, 2 * step)
    return y.reshape(x.shape), rstd


def _kernel_rows(n: int, rows: int, block: int) -> int:
    """Rows per pass of the C kernels: on one thread a block of about ``block`` elements, which stays in the core's
    cache; on more, every row (one OpenMP region per pass and one native parallel call per ATen op: no many short
    regions whose barriers wait for a thread the OS has descheduled)."""
    return max(1, block // n) if torch.get_num_threads() == 1 else max(rows, 1)


def _fwd_kernels(x2d, kind, eps, y, rstd) -> int:
    """The forward with the C casts (RMSNorm, and LayerNorm where no variant replicates ATen's): x to fp32, ATen's
    fp32 norm (the reference's call), fp32 to y's dtype; 1 if some value is NaN, else 0."""
    rows, n = x2d.shape
    step = _kernel_rows(n, rows, _KERNEL_BLOCK_FWD)
    threads = None if step >= rows else 1
    xbuf = None if x2d.dtype == torch.float32 else torch.empty((min(step, rows), n), dtype=torch.float32)
    for r in range(0, rows, step):
        e = min(r + step, rows)
        xb = x2d[r:e]
        if xbuf is not None:
            if cpu_kernels.cast(xb, xbuf, threads):
                return 1
            xb = xbuf[:e - r]
        yb, rb = ms_norm_fwd_ref(xb, kind, eps, torch.float32)  # fp32 in and out: the native call alone
        if y.dtype == torch.float32:
            y[r:e].copy_(yb)
        elif cpu_kernels.cast(yb, y[r:e], threads):
            return 1
        rstd[r:e].copy_(rb)
    return 0


def ms_norm_bwd_cpu(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, kind: str, dx_dtype: torch.dtype):
    """CPU fast path of :func:`ms_norm_bwd_ref` (same signature, same bits): whole in C row by row with ATen's
    summation order (:func:`lowmembp.ops.cpu_kernels.norm_bwd_rows`), else two C passes around ATen's row sums, else
    its ops row block by row block."""
    is_rms = _check_kind(kind)
    n = y.shape[-1]
    # strided rows (whose sums the reference orders by the layout) and mismatched shapes (the reference says what is
    # wrong) run the reference
    if not (_cpu_fast(y, n) and g.is_cpu and g.dtype in _FLOATS and rstd.is_cpu and rstd.dtype == torch.float32
            and dx_dtype in _FLOATS
            and g.is_contiguous() and y.is_contiguous() and g.shape == y.shape and rstd.numel() * n == y.numel()):
        return ms_norm_bwd_ref(g, y, rstd, kind, dx_dtype)
    dx = torch.empty_like(y, dtype=dx_dtype)  # y's shape (a base tensor, not a view)
    rstd1d = rstd if rstd.dim() == 1 and rstd.is_contiguous() else rstd.reshape(-1).contiguous()
    nan = None
    rows = y.numel() // n
    if rows > 1 or n < _ATEN_GRAIN:  # one long row: ATen sums it over threads in another order
        # None: no library, or ATen's sum not replicated
        nan = cpu_kernels.norm_bwd_rows_trusted(g, y, rows, n, rstd1d, dx, not is_rms)
    if nan is None:
        g2d, y2d, dx2d = g.reshape(-1, n), y.reshape(-1, n), dx.view(-1, n)
        if cpu_kernels.library() is not None and cpu_kernels.addcmul_fused() is not None:
            nan = _bwd_kernels(g2d, y2d, rstd1d, is_rms, dx2d)  # two C passes around ATen's row sums
        else:
            nan = _bwd_eager_blocks(g2d, y2d, rstd1d.reshape(-1, 1), is_rms, dx2d)
    if nan:
        return ms_norm_bwd_ref(g, y, rstd, kind, dx_dtype)  # a NaN's bits are ATen's only by chance
    return dx


def _bwd_kernels(g2d, y2d, rstd, is_rms, dx) -> int:
    """The backward with the C passes: the product g·y (and LayerNorm's fp32 copy of a 16-bit g), ATen's row sums,
    the fused rest; 1 if some dx is NaN, else 0."""
    rows, n = y2d.shape
    step = _kernel_rows(n, rows, _KERNEL_BLOCK)
    m = min(step, rows)
    buf = torch.empty((m, n), dtype=torch.float32)
    gbuf = None if is_rms or g2d.dtype == torch.float32 else torch.empty((m, n), dtype=torch.float32)
    prod_rows, bwd_rows = cpu_kernels.norm_bwd_passes(g2d, y2d, rstd, dx, buf, gbuf, None if step >= rows else 1)
    nan = 0
    for r in range(0, rows, step):
        e = min(r + step, rows)
        prod_rows(r, e)
        k = e - r
        # ATen's row sums (the reference's buf.sum(-1) and gf.mean(-1), which is gf.sum(-1) / n); C divides by n
        sgy = buf[:k].sum(-1)
        sg = None if is_rms else (g2d[r:e] if gbuf is None else gbuf[:k]).sum(-1)
        nan |= bwd_rows(r, e, sgy, sg)
    return nan


def _bwd_eager_blocks(g2d, y2d, r2d, is_rms, dx) -> int:
    """The reference's ops row block by row block (without the C kernels); 0 (its NaNs are the reference's)."""
    rows, n = y2d.shape
    dx_dtype = dx.dtype
    step = _row_block(n)

    def work(lo, hi):
        m = min(step, hi - lo)
        buf = torch.empty((m, n), dtype=torch.float32)
        gbuf = torch.empty((m, n), dtype=torch.float32) if g2d.dtype != torch.float32 else None
        ybuf = torch.empty((m, n), dtype=torch.float32) if y2d.dtype != torch.float32 else None
        for r in range(lo, hi, step):
            k = min(step, hi - r)
            gf = g2d[r:r + k] if gbuf is None else gbuf[:k].copy_(g2d[r:r + k])
            yf = y2d[r:r + k] if ybuf is None else ybuf[:k].copy_(y2d[r:r + k])
            b = torch.mul(gf, yf, out=buf[:k])
            mgy = b.sum(-1, keepdim=True).div_(n)
            d = torch.addcmul(gf, yf, mgy, value=-1.0, out=b)  # g - y*mean(g*y), as the reference
            if not is_rms:
                d.sub_(gf.mean(-1, keepdim=True))
            if dx_dtype == torch.float32:
                torch.mul(d, r2d[r:r + k], out=dx[r:r + k])
            else:
                dx[r:r + k].copy_(d.mul_(r2d[r:r + k]))

    cpu_parallel(rows, step, work, 2 * step)
    return 0


def ms_norm_bytes(rows: int, n: int, x_dtype: torch.dtype, y_dtype: torch.dtype, kind: str = "layernorm"):
    """Bytes the kernels move: forward reads x, writes y and rstd; backward reads g, y, rstd and writes dx."""
    _check_kind(kind)
    xs, ys = torch.empty((), dtype=x_dtype).element_size(), torch.empty((), dtype=y_dtype).element_size()
    fwd = rows * n * (xs + ys) + rows * 4
    bwd = rows * n * (2 * ys + xs) + rows * 4
    return fwd, bwd


# ------------------------------------------------------------------------------------------------- the custom ops
def _fwd_on(backend: str, x: torch.Tensor, kind: str, eps: float, out_dtype: torch.dtype):
    """The forward on ``backend`` (``backend_for``): Triton up to :data:`MAX_TRITON_N` columns (a kernel and its
    allocations: autocast does not touch them), the others with autocast off inside."""
    if backend == "triton" and x.shape[-1] <= MAX_TRITON_N:
        return ms_norm_fwd_triton(x, kind, eps, out_dtype)
    if _autocast_on(x):
        with torch.autocast(x.device.type, enabled=False):
            return _fwd_on(backend, x, kind, eps, out_dtype)
    if backend == "cpu":
        return ms_norm_fwd_cpu(x, kind, eps, out_dtype)
    return ms_norm_fwd_ref(x, kind, eps, out_dtype)


def _bwd_on(backend: str, g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, kind: str, dx_dtype: torch.dtype):
    """The backward on ``backend``: Triton as the forward, the others with autocast off inside."""
    if backend == "triton" and y.shape[-1] <= MAX_TRITON_N and rstd.dtype == torch.float32:
        return ms_norm_bwd_triton(g, y, rstd, kind, dx_dtype)
    if _autocast_on(g):
        with torch.autocast(g.device.type, enabled=False):
            return _bwd_on(backend, g, y, rstd, kind, dx_dtype)
    if backend == "cpu":
        return ms_norm_bwd_cpu(g, y, rstd, kind, dx_dtype)
    return ms_norm_bwd_ref(g, y, rstd, kind, dx_dtype)


def check_out_dtype(out_dtype: str, where: str = "ms_norm") -> str:
    """``out_dtype`` if it is one of :data:`OUT_DTYPES`, else ValueError saying the choices."""
    if not isinstance(out_dtype, str) or out_dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype must be one of {', '.join(map(repr, OUT_DTYPES))} ('auto': the autocast "
                         f"dtype under autocast, else the input's; 'input': the input's, as the official lomem "
                         f"kernel; 'fp32': float32), got {out_dtype!r}")
    return out_dtype


def _out_dtype(x: torch.Tensor, mode: str = "auto") -> torch.dtype:
    """The dtype the norm emits (and saves) for ``mode`` (:data:`OUT_DTYPES`); ``"auto"``: the autocast dtype when
    autocast is on for x's device (so the next linear shares y), else x's dtype."""
    if mode == "input":
        return x.dtype
    if mode == "fp32":
        return torch.float32
    return autocast_dtype(x) or x.dtype


def _autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is on for t's device (the ops then switch it off for their own work)."""
    return (t.is_cpu and torch.is_autocast_enabled("cpu")) or (t.is_cuda and torch.is_autocast_enabled("cuda"))


_OP_NAME = {"layernorm": "ms_layer_norm", "rmsnorm": "ms_rms_norm"}


@torch.library.custom_op("lowmembp::ms_norm_fwd", mutates_args=())
def _ms_norm_fwd_op(x: torch.Tensor, kind: str, eps: float,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in out_dtype, rstd [rows] fp32): Triton or the reference, autocast off inside."""
    return _fwd_on(backend_for(x), x, kind, eps, out_dtype)


@_ms_norm_fwd_op.register_fake
def _(x, kind, eps, out_dtype):
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    return (torch.empty(x.shape, dtype=out_dtype, device=x.device),
            torch.empty((rows,), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device))


@torch.library.custom_op("lowmembp::ms_norm_bwd", mutates_args=())
def _ms_norm_bwd_op(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, kind: str,
                    dx_dtype: torch.dtype) -> torch.Tensor:
    """dx from the output y and rstd (docs/design.md#ms-norms)."""
    return _bwd_on(backend_for(g), g, y, rstd, kind, dx_dtype)


@_ms_norm_bwd_op.register_fake
def _(g, y, rstd, kind, dx_dtype):
    return torch.empty(y.shape, dtype=dx_dtype, device=y.device)


def _bwd_setup(ctx, inputs, output):
    ctx.kind = inputs[3]


def _bwd_backward(ctx, *grads):
    op = _OP_NAME.get(ctx.kind, "ms_norm")
    raise RuntimeError(
        f"{op}: double backward (a gradient of the gradient, e.g. create_graph=True then grad again, or "
        f"torch.func.hessian/jacfwd of jacrev) is not supported: its backward runs from the saved output only. Use "
        f"the exact torch.nn.functional.{'layer_norm' if ctx.kind == 'layernorm' else 'rms_norm'} for that "
        f"computation, or convert the model without MS-norms (method 'lowmembp-act').")


torch.library.register_autograd("lowmembp::ms_norm_bwd", _bwd_backward, setup_context=_bwd_setup)


class _MSNormOps(OpFamily):
    """MS-LayerNorm / MS-RMSNorm (:mod:`lowmembp.ops.skeleton`): saves y itself (the tensor returned, which the next
    linear saves too) and rstd."""
    name = "ms_norm"

    @staticmethod
    def forward(backend, x, kind, eps, out_dtype):
        y, rstd = _fwd_on(backend, x, kind, eps, out_dtype)  # grad mode is off here; y is a new tensor
        return y, (y, rstd), (kind, x.dtype)

    @staticmethod
    def backward(backend, attrs, saved, g):
        y, rstd = saved
        return _bwd_on(backend, g, y, rstd, attrs[0], attrs[1]), None, None, None

    @staticmethod
    def graph_backward(attrs, saved, g):  # the backward op's own autograd refuses double backward
        y, rstd = saved
        return _ms_norm_bwd_op(g, y, rstd, attrs[0], attrs[1]), None, None, None


# the custom op's inputs are (x, kind, eps, out_dtype): it saves both outputs, y the very tensor returned
_MSNormOps.register_autograd("lowmembp::ms_norm_fwd",
                              lambda inputs, output: (tuple(output), (inputs[1], inputs[0].dtype)))

_INSTEAD = {"layernorm": "torch.nn.functional.layer_norm", "rmsnorm": "torch.nn.functional.rms_norm"}


def _run(x: torch.Tensor, kind: str, eps: float, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The op on validated arguments, emitting ``dtype``: the eager route where it may run, else the custom op."""
    backend = eager_backend(x)
    if backend is not None:
        if x.requires_grad and torch.is_grad_enabled():
            return _MSNormOps.apply(backend, x, kind, eps, dtype)
        return _fwd_on(backend, x, kind, eps, dtype)[0]
    refuse_functorch_transforms(x, op, _INSTEAD[kind])
    return _ms_norm_fwd_op(x, kind, eps, dtype)[0]


def _ms_norm(x: torch.Tensor, eps: float, kind: str, op: str, out_dtype: str = "auto") -> torch.Tensor:
    check_float_input(x, op)
    check_out_dtype(out_dtype, op)
    if x.dim() == 0:
        raise ValueError(f"{op}: expected at least 1 dimension (normalised over the last), got a 0-d tensor")
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps}")
    return _run(x, kind, eps, _out_dtype(x, out_dtype), op)  # the dtype read before the op's own work


def ms_layer_norm(x: torch.Tensor, eps: float = 1e-5, out_dtype: str = "auto") -> torch.Tensor:
    """LayerNorm over the last dim without affine; saves only its output (shared with the next linear) and rstd.
    ``out_dtype``: one of :data:`OUT_DTYPES` (module doc)."""
    return _ms_norm(x, eps, "layernorm", "ms_layer_norm", out_dtype)


def ms_rms_norm(x: torch.Tensor, eps: float = 1e-6, out_dtype: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim without affine; saves only its output (shared with the next linear) and rstd.
    ``out_dtype``: one of :data:`OUT_DTYPES` (module doc)."""
    return _ms_norm(x, eps, "rmsnorm", "ms_rms_norm", out_dtype)


# ----------------------------------------------------------------------------------------------------------- modules
def _hidden(shape, cls: str) -> int:
    if isinstance(shape, int):
        n = shape
    elif isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1 and isinstance(shape[0], int):
        n = shape[0]
    else:
        raise ValueError(f"{cls}: normalises over the last dimension only; give an int or a 1-tuple, got {shape!r}")
    if n < 0:
        raise ValueError(f"{cls}: the hidden size must be >= 0, got {n}")
    return n


class _MSNormBase(nn.Module):
    _kind = "layernorm"

    def __init__(self, normalized_shape, eps: float, out_dtype: str = "auto"):
        super().__init__()
        self.normalized_shape = (_hidden(normalized_shape, type(self).__name__),)
        self.eps = float(eps)
        self.out_dtype = check_out_dtype(out_dtype, type(self).__name__)
        self.elementwise_affine = False
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # eps and out_dtype were checked when the module was made: per call only what the input can get wrong
        if x.dtype not in SUPPORTED_FLOAT_DTYPES:
            check_float_input(x, type(self).__name__)
        if x.dim() == 0 or x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"{type(self).__name__}: expected the last dimension to be {self.normalized_shape[0]}, "
                             f"got input of shape {tuple(x.shape)}")
        return _run(x, self._kind, self.eps, _out_dtype(x, self.__dict__.get("out_dtype", "auto")),
                    type(self).__name__)

    def extra_repr(self) -> str:
        dt = getattr(self, "out_dtype", "auto")
        return f"{self.normalized_shape}, eps={self.eps}" + ("" if dt == "auto" else f", out_dtype={dt!r}")


class MSLayerNorm(_MSNormBase):
    """Drop-in for ``nn.LayerNorm(normalized_shape, elementwise_affine=False)`` that saves only its output + rstd.

    Fold γ/β of a trained LayerNorm into the next linear layers first (docs/design.md#ms-norms; lowmembp.methods).
    ``out_dtype``: the dtype it emits and saves, one of :data:`OUT_DTYPES` (module doc)."""
    _kind = "layernorm"

    def __init__(self, normalized_shape, eps: float = 1e-5, out_dtype: str = "auto"):
        super().__init__(normalized_shape, eps, out_dtype)


class MSRMSNorm(_MSNormBase):
    """RMSNorm without a weight (LLaMA's with γ folded into the next linears) that saves only its output + rstd.
    ``out_dtype``: the dtype it emits and saves, one of :data:`OUT_DTYPES` (module doc)."""
    _kind = "rmsnorm"

    def __init__(self, hidden_size, eps: float = 1e-6, out_dtype: str = "auto"):
        super().__init__(hidden_size, eps, out_dtype)

    @property
    def variance_epsilon(self) -> float:  # the attribute name transformers' LlamaRMSNorm uses
        return self.eps


__all__ = ["ms_layer_norm", "ms_rms_norm", "MSLayerNorm", "MSRMSNorm", "ms_norm_fwd_triton", "ms_norm_bwd_triton",
           "ms_norm_fwd_ref", "ms_norm_bwd_ref", "ms_norm_fwd_cpu", "ms_norm_bwd_cpu", "ms_norm_bytes", "KINDS",
           "MAX_TRITON_N", "OUT_DTYPES", "check_out_dtype"]

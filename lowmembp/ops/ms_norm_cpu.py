"""The MS-norms' CPU fast path: the reference's arithmetic, bit for bit, in C (:mod:`lowmembp.ops.cpu_kernels`).

The reference is :mod:`~lowmembp.ops.ms_norm_reference`'s. The backward runs whole in C, row by row: the sums of the
row's g·y (and LayerNorm's fp32 g) in the order of ATen's CPU `sum` (kernels.c replicates its cascade sum for the vector
width a probe at first use finds, cpu_kernels.aten_sum_width(); straight from g and y where they share a dtype and the
width is 8, else from a scratch row in the core's cache), then the addcmul, mean subtraction, rstd product and rounding
to dx's dtype; the rows split over an OpenMP team. Where the probe finds no width (another torch's sum) the backward is
two C passes around ATen's own row sums, over blocks of whole rows that stay in the cache on one thread and over the
whole tensor on more; so is the backward of a single row of 32768 or more elements, which ATen sums over threads in two
passes. The LayerNorm forward runs whole in C, row by row over an OpenMP team (cpu_kernels.layer_norm_fwd): ATen's CPU
LayerNorm (its Welford moments, rstd and output line; each row on one thread, as ATen's) for the variant a probe at
first use finds (cpu_kernels.layer_norm_variant(): the vector width and which multiply-adds torch's build fused),
reading x in its dtype and rounding y once to its own, fp32 in and out included. Where no variant matches (another
torch), and for RMSNorm, the forward is C casts around ATen's fp32 norm (its statistics stay ATen's), and fp32 in and
out is the reference's one native call. A NaN in the result (whose bits ATen's conversions decide) recomputes the call
with the reference. Without the C kernels the reference's own ops run over row blocks spread over threads by
cpu_parallel. Either way the results are the same bits (tests/ops/test_cpu_fastpath.py,
tests/ops/test_cpu_norm_kernels.py). Rows too wide for a block, strided rows (whose sums ATen orders by the layout),
float64 and empty inputs run the reference. :func:`fwd_node`: the route through the C++ extension (with grad its
autograd node: the same bits, a fraction of the host time; docs/performance/cpu.md), or None.
"""
from __future__ import annotations

import torch

from lowmembp._compat import fused_rms_norm_takes_shape
from lowmembp.ops import cpu_kernels
from lowmembp.ops.backend import CPU_BLOCK, SUPPORTED_FLOAT_DTYPES, cpu_block, cpu_parallel
from lowmembp.ops.ms_norm_reference import _check_kind, ms_norm_bwd_ref, ms_norm_fwd_ref

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


# ------------------------------------------------------------------------------------- the C++ autograd node
_NODE_KINDS = {"layernorm": 0, "rmsnorm": 1}  # autograd.cpp's kind ids
_NODE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # autograd.cpp's dtype codes
_NODE_NAMES, _NODE_DTYPE_OF = tuple(_NODE_KINDS), tuple(_NODE_DTYPES)
_NODE: list = []  # [the set-up extension, or None when it is unavailable], filled on the first call


def _node_backward(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, k: int, dx_code: int,
                   graph: bool) -> torch.Tensor:
    """The node's backward where it does not compute dx itself: the Python route's (through the custom op
    ``lowmembp::ms_norm_bwd`` for a backward that is itself differentiated)."""
    from lowmembp.ops import ms_norm  # the custom op and the route (its module imports this one)

    kind, dx_dtype = _NODE_NAMES[k], _NODE_DTYPE_OF[dx_code]
    if graph:
        return ms_norm._ms_norm_bwd_op(g, y, rstd, kind, dx_dtype)
    return ms_norm._bwd_on("cpu", g, y, rstd, kind, dx_dtype)


def _node_setup():
    ext = cpu_kernels.extension()
    if ext is not None:  # what the probes found for this torch, once (the Python route asks them per call)
        variant, width, fused = cpu_kernels.layer_norm_variant(), cpu_kernels.aten_sum_width(), \
            cpu_kernels.addcmul_fused()
        ext.set_norm_config(-1 if variant is None else variant.width, 0 if variant is None else variant.flags,
                            -1 if width is None else width, -1 if fused is None else int(fused),
                            fused_rms_norm_takes_shape(), _CPU_MAX_N, _SMALL, _ATEN_GRAIN)
        ext.set_norm_callback(_node_backward)
    _NODE[:] = [ext]
    return ext


def fwd_node(x: torch.Tensor, kind: str, eps: float, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The norm of a plain CPU tensor through the C++ extension (built on the first call): y, with grad y and rstd
    saved on its autograd node, bit for bit the Python route's (:func:`ms_norm_fwd_cpu` /
    :func:`ms_norm_bwd_cpu`); None where the node does not serve the call (strided, empty or float64 inputs, rows
    wider than a block, a 16-bit tensor of 16384 elements or more whose forward is not LayerNorm's C replica, a NaN in
    the result, autocast, the extension unavailable): the caller then runs the Python route."""
    ext = _NODE[0] if _NODE else _node_setup()
    code = _NODE_DTYPES.get(out_dtype)
    if ext is None or code is None:
        return None
    return ext.ms_norm(x, _NODE_KINDS[kind], eps, code)

"""The MS-norms' Triton kernels and their launches (CUDA tensors; CPU ones under Triton's interpreter).

``ms_norm_fwd_triton`` / ``ms_norm_bwd_triton`` take the signatures of the reference
(:mod:`~lowmembp.ops.ms_norm_reference`). A few rows per program, a block of next_power_of_2(N) columns, 64-bit row
offsets, launched from :mod:`lowmembp.ops.launch`'s cache; rows wider than :data:`MAX_TRITON_N` take the reference.
"""
from __future__ import annotations

import torch

from lowmembp.ops.launch import Launcher
from lowmembp.ops.ms_norm_reference import _check_kind

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing or broken: reference only
    triton = None

MAX_TRITON_N = 32768  # widest row held in one block; wider rows use the reference
_TILE = 4096  # elements per program (rows * BLOCK) for narrow rows


if triton is not None:

    @triton.jit
    def _tile_rows(n_rows, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's ROWS rows (64-bit) and BLOCK columns, whether each row is one of n_rows and the mask of
        the tile's elements in range."""
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        row_ok = rows < n_rows
        return rows, cols, row_ok, row_ok[:, None] & (cols < N)[None, :]

    @triton.jit
    def _ms_norm_fwd_kernel(X, Y, RSTD, n_rows, N, stride_x, stride_y, eps,
                            IS_RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows, cols, row_ok, mask = _tile_rows(n_rows, N, ROWS, BLOCK)
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
        rows, cols, row_ok, mask = _tile_rows(n_rows, N, ROWS, BLOCK)
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

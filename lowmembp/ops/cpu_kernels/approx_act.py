"""The C kernels of the approximate activations' CPU fast path (:mod:`lowmembp.ops.approx_act_cpu`).

:func:`codes2` packs the 2-bit codes of x and checks its values in one pass, :func:`check` only checks them,
:func:`slopes2` is the backward ``dx = s[code] · dy``; :func:`read_byte` / :func:`write_byte` reach the flag byte
without tensor indexing. Each has a ``_trusted`` twin without the checks, for callers that have made sure of them.
"""
from __future__ import annotations

import ctypes

import torch

from lowmembp.ops.cpu_kernels.build import _DTYPES, _check_tensor, _threads, library


def read_byte(t: torch.Tensor, i: int) -> int:
    """Byte ``i`` of a contiguous CPU uint8 tensor, read from memory (no tensor indexing: a fraction of its cost)."""
    _check_tensor(t, i + 1, torch.uint8)
    return ctypes.c_uint8.from_address(t.data_ptr() + i).value


def read_byte_trusted(t: torch.Tensor, i: int) -> int:
    """:func:`read_byte` without its check, for a caller that has made sure ``t`` is a contiguous CPU uint8 tensor
    of more than ``i`` bytes."""
    return ctypes.c_uint8.from_address(t.data_ptr() + i).value


def write_byte(t: torch.Tensor, i: int, value: int) -> None:
    """Set byte ``i`` of a contiguous CPU uint8 tensor the caller has just allocated (nothing else holds it: its
    version counter is not bumped) to ``value``."""
    _check_tensor(t, i + 1, torch.uint8)
    ctypes.c_uint8.from_address(t.data_ptr() + i).value = value


NONFINITE, TINY_BF16 = 1, 2  # the bits that codes2 and check return


def codes2(x: torch.Tensor, thresholds, out: torch.Tensor) -> int | None:
    """Packed 2-bit codes of contiguous ``x`` (``Σ_j [x > t_j]`` in fp32, element i in byte i // 4, bits 2·(i % 4))
    into the first ``ceil(n / 4)`` bytes of ``out``; returns :func:`check`'s bits of x."""
    if library() is None or x.dtype not in _DTYPES:
        return None
    x = x.contiguous()
    n = x.numel()
    _check_tensor(x, n, x.dtype)
    _check_tensor(out, (n + 3) // 4, torch.uint8)
    return codes2_trusted(x, n, thresholds, out)


def codes2_trusted(x: torch.Tensor, n: int, thresholds, out: torch.Tensor) -> int | None:
    """:func:`codes2` without its checks, for a caller that has made sure of them (contiguous CPU x of n elements of
    fp32, bf16 or fp16; contiguous CPU uint8 out of at least ``ceil(n / 4)``): a wrong tensor here is memory
    corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    t0, t1, t2 = thresholds
    return lib.lmbp_codes2(x.data_ptr(), _DTYPES[x.dtype], n, t0, t1, t2, out.data_ptr(), _threads(n))


def check(x: torch.Tensor) -> int | None:
    """Bits about contiguous ``x``: :data:`NONFINITE` if some element is NaN or ±inf, :data:`TINY_BF16` if x is
    bf16 and some element is nonzero and below 2⁻¹²⁴ in magnitude (a native bf16 activation kernel may flush its
    result to zero there); 0 if neither."""
    lib = library()
    if lib is None or x.dtype not in _DTYPES:
        return None
    x = x.contiguous()
    n = x.numel()
    _check_tensor(x, n, x.dtype)
    return lib.lmbp_check(x.data_ptr(), _DTYPES[x.dtype], n, _threads(n))


def slopes2(dy: torch.Tensor, codes: torch.Tensor, slopes: torch.Tensor, dx: torch.Tensor) -> int | None:
    """``dx = s[code] · dy`` in fp32, rounded once to dy's dtype (dx's too), with 2-bit ``codes`` and the four fp32
    ``slopes``; returns 1 if some product is NaN (its bits are ATen's for fp32 only), else 0."""
    if library() is None or dy.dtype not in _DTYPES:
        return None
    dy, codes, slopes = dy.contiguous(), codes.contiguous(), slopes.float().contiguous()
    n = dy.numel()
    _check_tensor(dy, n, dy.dtype)
    _check_tensor(codes, (n + 3) // 4, torch.uint8)
    _check_tensor(slopes, 4, torch.float32)
    _check_tensor(dx, n, dy.dtype)
    return slopes2_trusted(dy, n, codes, slopes, dx)


def slopes2_trusted(dy: torch.Tensor, n: int, codes: torch.Tensor, slopes: torch.Tensor,
                    dx: torch.Tensor) -> int | None:
    """:func:`slopes2` without its checks, for a caller that has made sure of them (contiguous CPU dy and dx of n
    elements of one dtype of fp32, bf16 and fp16; contiguous CPU uint8 codes of at least ``ceil(n / 4)``, four
    contiguous CPU fp32 slopes): a wrong tensor here is memory corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    return lib.lmbp_slopes2(dy.data_ptr(), _DTYPES[dy.dtype], codes.data_ptr(), n, slopes.data_ptr(),
                            dx.data_ptr(), _threads(n))

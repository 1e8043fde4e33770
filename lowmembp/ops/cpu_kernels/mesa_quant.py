"""The C kernels of Mesa's CPU fast path (:mod:`lowmembp.ops.mesa_quant_cpu`, ``EMAQuantizer.pack``).

:func:`quantize8` and :func:`dequantize8` are the 8-bit quantiser and dequantiser; :func:`mesa_pack8` is a training
step of ``EMAQuantizer.pack`` in one call (the group statistics, the EMA update and the codes). Each ``_trusted``
twin skips the checks, for callers that have made sure of them.
"""
from __future__ import annotations

import torch

from lowmembp.ops.cpu_kernels.build import _DTYPES, _check_tensor, _threads, library


def _check_elementwise(src: torch.Tensor, src_dtype: torch.dtype, out: torch.Tensor, out_dtype: torch.dtype,
                       groups: int, a: torch.Tensor, b: torch.Tensor) -> int:
    """Checks an elementwise pass's tensors in order: ``src`` and ``out`` of ``src.numel()`` elements, fp32 ``a`` and
    ``b`` of ``groups``; returns that number of elements."""
    n = src.numel()
    _check_tensor(src, n, src_dtype)
    _check_tensor(out, n, out_dtype)
    _check_tensor(a, groups, torch.float32)
    _check_tensor(b, groups, torch.float32)
    return n


def quantize8(x: torch.Tensor, inner: int, groups: int, scale: torch.Tensor, beta: torch.Tensor, seed: int,
              out: torch.Tensor) -> int | None:
    """Mesa's codes ``clamp(floor((x − β[g])·scale[g] + u_i), 0, 255)`` into uint8 ``out``; returns 1 if some value
    is NaN before the clamp (its code is ATen's conversion of NaN), else 0."""
    lib = library()
    if lib is None or x.dtype not in _DTYPES:
        return None
    x, scale, beta = x.contiguous(), scale.float().contiguous(), beta.float().contiguous()
    n = _check_elementwise(x, x.dtype, out, torch.uint8, groups, scale, beta)
    return lib.lmbp_quantize8(x.data_ptr(), _DTYPES[x.dtype], n, inner, groups, scale.data_ptr(), beta.data_ptr(),
                              int(seed) & 0xFFFFFFFF, out.data_ptr(), _threads(n))


def dequantize8(codes: torch.Tensor, inner: int, groups: int, step: torch.Tensor, beta: torch.Tensor,
                out: torch.Tensor) -> int | None:
    """Mesa's ``q·step[g] + β[g]`` in fp32, rounded once to out's dtype; returns 1 if some value is NaN, else 0."""
    if library() is None or out.dtype not in _DTYPES:
        return None
    codes, step, beta = codes.contiguous(), step.float().contiguous(), beta.float().contiguous()
    n = _check_elementwise(codes, torch.uint8, out, out.dtype, groups, step, beta)
    return dequantize8_trusted(codes, n, inner, groups, step, beta, out)


def dequantize8_trusted(codes: torch.Tensor, n: int, inner: int, groups: int, step: torch.Tensor, beta: torch.Tensor,
                        out: torch.Tensor) -> int | None:
    """:func:`dequantize8` without its checks, for a caller that has made sure of them (contiguous CPU uint8 codes
    and out of n elements, out fp32, bf16 or fp16; contiguous CPU fp32 step and β of ``groups``): a wrong tensor here
    is memory corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    return lib.lmbp_dequantize8(codes.data_ptr(), n, inner, groups, step.data_ptr(), beta.data_ptr(),
                                out.data_ptr(), _DTYPES[out.dtype], _threads(n))


PACK8_NAN, PACK8_AMBIGUOUS, PACK8_SKIPPED = 1, 2, 4  # the bits that mesa_pack8 returns
_PACK8_STACK_GROUPS = 1024  # kernels.c's PACK8_STACK_GROUPS


def mesa_pack8(x: torch.Tensor, inner: int, groups: int, alpha: torch.Tensor, beta: torch.Tensor,
               count: torch.Tensor, skipped: torch.Tensor, momentum: float, min_range: float, seed: int,
               step: torch.Tensor, beta_out: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> int | None:
    """Mesa's ``EMAQuantizer.pack`` in training mode, in one call: each group's min and max of contiguous ``x``; if
    all are finite and so is every range, the EMA update of the fp32 ``alpha`` / ``beta`` in place (the first update,
    ``count == 0``, sets them; int64 ``count`` += 1), else int64 ``skipped`` += 1; then ``step = a/255``,
    ``scale = 255/a`` for ``a = max(alpha, min_range)`` (as ATen rounds them), ``beta_out = beta`` and the codes of
    :func:`quantize8` into ``out``. Returns the :data:`PACK8_NAN` bit as quantize8's 1, :data:`PACK8_SKIPPED` if
    ``skipped > 0`` afterwards, or only :data:`PACK8_AMBIGUOUS` when a group's min or max is a zero and the group
    holds a -0.0 (ATen's reduction order picks the sign: nothing is written, the caller runs the ATen ops)."""
    if library() is None or x.dtype not in _DTYPES:
        return None
    n = x.numel()
    _check_tensor(x, n, x.dtype)
    _check_tensor(out, n, torch.uint8)
    for t in (alpha, beta, step, beta_out, scale):
        _check_tensor(t, groups, torch.float32)
    for t in (count, skipped):
        _check_tensor(t, 1, torch.int64)
    return mesa_pack8_trusted(x, n, inner, groups, alpha, beta, count, skipped, momentum, min_range, seed, step,
                              beta_out, scale, out)


def mesa_pack8_trusted(x: torch.Tensor, n: int, inner: int, groups: int, alpha: torch.Tensor, beta: torch.Tensor,
                       count: torch.Tensor, skipped: torch.Tensor, momentum: float, min_range: float, seed: int,
                       step: torch.Tensor, beta_out: torch.Tensor, scale: torch.Tensor,
                       out: torch.Tensor) -> int | None:
    """:func:`mesa_pack8` without its checks, for a caller that has made sure of them (contiguous CPU tensors: x of
    n elements of fp32, bf16 or fp16, uint8 out of n, fp32 alpha, beta, step, beta_out and scale of ``groups``, int64
    count and skipped): a wrong tensor here is memory corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    threads = _threads(n)
    work = None  # scratch for per-thread minima, maxima and flags: the kernel's stack up to 1024 groups x threads
    if groups * threads > _PACK8_STACK_GROUPS:
        work = torch.empty(2 * groups * threads + (groups * threads + 3) // 4, dtype=torch.float32)
    return lib.lmbp_mesa_pack8(x.data_ptr(), _DTYPES[x.dtype], n, inner, groups, alpha.data_ptr(), beta.data_ptr(),
                               count.data_ptr(), skipped.data_ptr(), momentum, 1.0 - momentum, min_range,
                               step.data_ptr(), beta_out.data_ptr(), scale.data_ptr(), int(seed) & 0xFFFFFFFF,
                               out.data_ptr(), None if work is None else work.data_ptr(), threads)

"""Mesa quantisation's PyTorch reference: the counter-based uniforms and the chunked quantiser and dequantiser.

``u_i = lowbias32(i·0x9E3779B9 + seed) >> 8`` times 2⁻²⁴ (:func:`hash_uniform`); :func:`quantize_ref` is
``clamp(floor((x − β[g])·scale[g] + u), 0, 255)`` as uint8, :func:`dequantize_ref` ``q·step[g] + β[g]`` (the format
and the groups: :mod:`lowmembp.ops.mesa_quant`). Both work in chunks of :func:`get_chunk_size` elements so that their
temporaries stay small. The oracle of the other backends: the CPU fast path (:mod:`~lowmembp.ops.mesa_quant_cpu`)
gives its codes and values bit for bit, the Triton kernels (:mod:`~lowmembp.ops.mesa_quant_triton`) compute the same
formulas with the same uniforms.
"""
from __future__ import annotations

import contextlib

import torch

from lowmembp.ops.backend import is_shape_only

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_H1 = 0x7FEB352D
_H2 = 0x846CA68B


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


def _iter_chunks(numel: int, chunk: int | None, inner: int, groups: int, device):
    """Yields ``(start, n, g)`` for each chunk of ``numel`` elements (``chunk`` as in :func:`quantize_ref`): the
    chunk's first element, its length and the group index of each of its elements."""
    n_chunk = _chunk_for(chunk)
    for start in range(0, numel, n_chunk):
        n = min(n_chunk, numel - start)
        yield start, n, (torch.arange(start, start + n, device=device) // inner) % groups


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                 seed: int, chunk: int | None = None) -> torch.Tensor:
    """Reference quantiser: ``clamp(floor((x − β[g])·scale[g] + u), 0, 255)`` as uint8, ``scale = 255/α``.

    ``chunk``: elements per step (default :func:`get_chunk_size`); the result does not depend on it. On a fake or
    meta ``x`` only the output is allocated (there are no values to compute)."""
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    if is_shape_only(x):
        return out.reshape(x.shape)
    for start, n, g in _iter_chunks(flat.numel(), chunk, inner, groups, x.device):
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
    for start, n, g in _iter_chunks(flat.numel(), chunk, inner, groups, codes.device):
        out[start:start + n] = (flat[start:start + n].float() * step[g] + beta[g]).to(dtype)
    return out.reshape(codes.shape)

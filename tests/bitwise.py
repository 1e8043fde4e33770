"""Bit-for-bit comparison of tensors, for the tests of the CPU fast path and its C kernels against the references."""
from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width (uint8 as it is): NaN payloads and −0.0 compare as what they are."""
    if t.dtype == torch.uint8:
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """``a`` and ``b`` have the same dtype, shape and bits."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    diff = int((bits(a) != bits(b)).sum())
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ in their bits"

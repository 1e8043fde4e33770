"""Approx-BP activations: exact forward, k-bit backward (Yang et al., arXiv 2406.16282; docs/design.md#approx-act).

Kinds (``KINDS``) and their exact forward, computed in fp32 and cast back to the input dtype:
``gelu`` 0.5·x·(1 + erf(x/√2)) · ``gelu_tanh`` 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) · ``quick_gelu``
x·sigmoid(1.702·x) · ``silu`` x·sigmoid(x) · ``relu`` max(x, 0) · ``relu2`` max(x, 0)².
Non-finite inputs follow the mathematics, not a library's vector path: f(NaN) = NaN, f(+∞) = +∞, f(−∞) = 0.
Saved for backward: one uint8 tensor, the ``bits``-bit codes packed and one flag byte, ``ceil(N·bits/8) + 1`` bytes
(0.25 byte per element for ReGELU2 / ReSiLU2, against 2 for a bf16 or 4 for an fp32 input that ``F.gelu`` /
``F.silu`` save); the backward is ``dx = dy · s[code]`` (the format: :mod:`~lowmembp.ops.approx_act_reference`).

This module is the op: the functions and modules, the eager route (:mod:`lowmembp.ops.skeleton`) and the
``torch.library`` custom ops ``lowmembp::approx_act_fwd`` / ``lowmembp::approx_act_bwd`` (fake implementations,
registered autograd: ``torch.compile`` sees them opaque, FakeTensorMode / meta tensors get the same saved bytes,
double backward works). ``torch.func`` gradient transforms and forward-mode AD raise an error naming the op
(``vmap`` alone works). Backends (``lowmembp.ops.backend.backend_for``), all with bitwise-equal codes and gradients:
the Triton kernels on CUDA tensors (:mod:`~lowmembp.ops.approx_act_triton`), the CPU fast path on CPU tensors
(:mod:`~lowmembp.ops.approx_act_cpu`), the PyTorch reference otherwise and under ``LOWMEMBP_BACKEND=torch``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lowmembp.ops.approx_act_cpu import _bwd_cpu, _fwd_cpu, backward_cpu, forward_cpu, fwd_node
from lowmembp.ops.approx_act_reference import (_BITS_OF_COUNT, _CONSTS32, _EXACT, BITS, KINDS, _bits, _bits_of,
                                               _bwd_reference, _consts32, _fwd_reference, _kind, backward_reference,
                                               codes_reference, constants, forward_reference, pack_codes,
                                               saved_bytes, slopes, unpack_codes)
from lowmembp.ops.approx_act_triton import _bwd_triton, _fwd_triton, backward_triton, forward_triton
from lowmembp.ops.approx_table import REGELU2_A, REGELU2_C, RESILU2_A, RESILU2_C
from lowmembp.ops.backend import (SUPPORTED_FLOAT_DTYPES, backend_for, check_float_input, eager_backend,
                                  refuse_functorch_transforms)
from lowmembp.ops.skeleton import OpFamily

__all__ = [
    "KINDS", "BITS", "REGELU2_C", "REGELU2_A", "RESILU2_C", "RESILU2_A", "constants", "slopes",
    "approx_act", "regelu2", "resilu2", "make_approx", "ApproxAct", "ReGELU2", "ReSiLU2",
    "pack_codes", "unpack_codes", "codes_reference", "forward_reference", "backward_reference",
    "forward_triton", "backward_triton", "forward_cpu", "backward_cpu", "saved_bytes",
]


# ------------------------------------------------------------------------------------------------- the custom ops
def _fwd_on(backend: str, x: torch.Tensor, kind: str, thresholds, with_codes: bool):
    """The forward on ``backend`` (``lowmembp.ops.backend.backend_for``): (y, packed codes + flag byte)."""
    if backend == "triton":
        return _fwd_triton(x, kind, thresholds, with_codes)
    if backend == "cpu":
        return _fwd_cpu(x, kind, thresholds, with_codes)
    return _fwd_reference(x, kind, thresholds, with_codes)


def _bwd_on(backend: str, dy: torch.Tensor, packed: torch.Tensor, slopes) -> torch.Tensor:
    """The backward on ``backend``: ``dx = dy · s[code]``."""
    if backend == "triton":
        return _bwd_triton(dy, packed, slopes)
    if backend == "cpu":
        return _bwd_cpu(dy, packed, slopes)
    return _bwd_reference(dy, packed, slopes)


@torch.library.custom_op("lowmembp::approx_act_fwd", mutates_args=())
def _approx_act_fwd(x: torch.Tensor, kind: str, thresholds: list[float], slopes: list[float],
                    with_codes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact activation, packed codes + flag byte). ``slopes`` is unused here; the autograd formula reads it."""
    return _fwd_on(backend_for(x), x, kind, thresholds, with_codes)


@_approx_act_fwd.register_fake
def _(x, kind, thresholds, slopes, with_codes):
    bits = _bits_of(len(thresholds) + 1, "thresholds")
    nbytes = (x.numel() * bits + 7) // 8 + 1 if with_codes else 0
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(nbytes, dtype=torch.uint8, device=x.device))


@torch.library.custom_op("lowmembp::approx_act_bwd", mutates_args=())
def _approx_act_bwd(dy: torch.Tensor, packed: torch.Tensor, slopes: list[float]) -> torch.Tensor:
    """``dx = dy · s[code]`` (slopes fp32-rounded, 2**bits of them)."""
    return _bwd_on(backend_for(dy), dy, packed, slopes)


@_approx_act_bwd.register_fake
def _(dy, packed, slopes):
    return torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)


def _bwd_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.slopes = inputs[2]


def _bwd_backward(ctx, gdx):  # the backward is linear in dy with a piecewise-constant slope: d/dx of it is 0
    (packed,) = ctx.saved_tensors
    return _approx_act_bwd(gdx, packed, ctx.slopes), None, None


torch.library.register_autograd("lowmembp::approx_act_bwd", _bwd_backward, setup_context=_bwd_setup)


class _ApproxActOps(OpFamily):
    """ReGELU2 / ReSiLU2 and their kin (:mod:`lowmembp.ops.skeleton`): saves the packed codes + flag byte only."""
    name = "approx_act"

    @staticmethod
    def forward(backend, x, kind, t32, s32):
        y, packed = _fwd_on(backend, x, kind, t32, True)
        return y, (packed,), s32

    @staticmethod
    def backward(backend, s32, saved, dy):
        return _bwd_on(backend, dy, saved[0], s32), None, None, None

    @staticmethod
    def graph_backward(s32, saved, dy):
        return _approx_act_bwd(dy, saved[0], list(s32)), None, None, None


# the custom op's inputs are (x, kind, thresholds, slopes, with_codes): it saves its second output, the codes
_ApproxActOps.register_autograd("lowmembp::approx_act_fwd", lambda inputs, output: ((output[1],), inputs[3]))


# ------------------------------------------------------------------------------------------- functions and modules
def _run(x: torch.Tensor, kind: str, t32: tuple, s32: tuple) -> torch.Tensor:
    """The op on a validated ``kind`` with its fp32 constants: the eager route where it may run, else the custom op."""
    with_codes = x.requires_grad and torch.is_grad_enabled()
    backend = eager_backend(x)
    if backend is not None:
        if backend == "cpu":  # the C++ extension (approx_act_cpu.fwd_node; with grad its node); None: the Python route
            y = fwd_node(x, kind, s32)
            if y is not None:
                return y
        if with_codes:
            return _ApproxActOps.apply(backend, x, kind, t32, s32)
        return _fwd_on(backend, x, kind, t32, False)[0]
    refuse_functorch_transforms(x, f"approx_act({kind}, bits={_BITS_OF_COUNT[len(s32)]})", _EXACT[kind])
    return _approx_act_fwd(x, kind, list(t32), list(s32), with_codes)[0]


def approx_act(x: torch.Tensor, kind: str = "gelu", bits: int = 2) -> torch.Tensor:
    """Exact ``kind`` activation forward; backward with the ``bits``-bit approximate derivative (codes saved)."""
    kind, bits = _kind(kind), _bits(bits)
    check_float_input(x, f"approx_act({kind}, bits={bits})")
    return _run(x, kind, *_consts32(kind, bits))


def regelu2(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU (erf form) forward; backward with the 2-bit ReGELU2 derivative, saving 0.25 byte per element."""
    check_float_input(x, "regelu2")
    return _run(x, "gelu", *_CONSTS32[("gelu", 2)])


def resilu2(x: torch.Tensor) -> torch.Tensor:
    """Exact SiLU forward; backward with the 2-bit ReSiLU2 derivative, saving 0.25 byte per element."""
    check_float_input(x, "resilu2")
    return _run(x, "silu", *_CONSTS32[("silu", 2)])


class ApproxAct(nn.Module):
    """Drop-in for the exact ``kind`` activation module that saves ``bits``-bit codes instead of its input."""

    def __init__(self, kind: str = "gelu", bits: int = 2):
        super().__init__()
        self.kind, self.bits = _kind(kind), _bits(bits)
        self._consts = _consts32(self.kind, self.bits)  # fail now, not in the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in SUPPORTED_FLOAT_DTYPES:
            check_float_input(x, type(self).__name__)
        consts = self.__dict__.get("_consts") or _consts32(self.kind, self.bits)  # (a module pickled before)
        return _run(x, self.kind, *consts)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, bits={self.bits}"


class ReGELU2(ApproxAct):
    """Drop-in for ``nn.GELU()`` (erf form) that saves 2-bit codes instead of its input."""

    def __init__(self):
        super().__init__("gelu", 2)


class ReSiLU2(ApproxAct):
    """Drop-in for ``nn.SiLU()`` that saves 2-bit codes instead of its input."""

    def __init__(self):
        super().__init__("silu", 2)


def make_approx(kind: str, bits: int = 2) -> nn.Module:
    """The approximate-activation module for ``kind`` (one of :data:`KINDS`) with ``bits`` bits per element.

    ``("gelu", 2)`` gives :class:`ReGELU2` and ``("silu", 2)`` :class:`ReSiLU2`; every other pair an
    :class:`ApproxAct`. Raises ValueError (listing the kinds) for an unknown kind."""
    kind, bits = _kind(kind), _bits(bits)
    if bits == 2 and kind == "gelu":
        return ReGELU2()
    if bits == 2 and kind == "silu":
        return ReSiLU2()
    return ApproxAct(kind, bits)

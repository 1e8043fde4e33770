"""MS-BP norms: MS-LayerNorm and MS-RMSNorm without affine parameters (Yang et al., ICML 2024).

Statistics in fp32 over the last dimension; saved for backward: the OUTPUT ``y`` (the very tensor returned) and
``rstd`` (fp32, one per row), never the input, so a norm and the linear after it store one tensor instead of two.
The formulas, the output dtype rules (``out_dtype``, :data:`OUT_DTYPES`) and the sharing: docs/design.md#ms-norms.

Routes (:mod:`lowmembp.ops.skeleton`): eager calls on plain CPU / CUDA tensors take one ``autograd.Function`` on the
backend's kernels; traced, fake and ``torch.func`` calls the custom ops ``lowmembp::ms_norm_fwd`` /
``lowmembp::ms_norm_bwd`` (``torch.compile`` sees one opaque node). Double backward, ``torch.func`` gradient
transforms and forward-mode AD raise an error naming the op (``vmap`` works). Backends: Triton on CUDA
(:mod:`~lowmembp.ops.ms_norm_triton`), the CPU fast path (:mod:`~lowmembp.ops.ms_norm_cpu`), the PyTorch reference
elsewhere (:mod:`~lowmembp.ops.ms_norm_reference`); their pure functions are importable from here, with
``ms_norm_bytes(rows, N, x_dtype, y_dtype, kind) -> (forward bytes moved, backward bytes moved)``.
"""
from __future__ import annotations

import torch
from torch import nn

from lowmembp.ops.backend import (SUPPORTED_FLOAT_DTYPES, autocast_dtype, backend_for, check_float_input,
                                  eager_backend, refuse_functorch_transforms)
from lowmembp.ops.ms_norm_cpu import fwd_node, ms_norm_bwd_cpu, ms_norm_fwd_cpu
from lowmembp.ops.ms_norm_reference import KINDS, _check_kind, ms_norm_bwd_ref, ms_norm_fwd_ref
from lowmembp.ops.ms_norm_triton import MAX_TRITON_N, ms_norm_bwd_triton, ms_norm_fwd_triton
from lowmembp.ops.skeleton import OpFamily

OUT_DTYPES = ("auto", "input", "fp32")  # the norm's output (and saved) dtype (docs/design.md#ms-norms)


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
        if backend == "cpu":  # the C++ extension (ms_norm_cpu.fwd_node; with grad its node); None: the Python route
            y = fwd_node(x, kind, eps, dtype)
            if y is not None:
                return y
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
    ``out_dtype``: one of :data:`OUT_DTYPES` (docs/design.md#ms-norms)."""
    return _ms_norm(x, eps, "layernorm", "ms_layer_norm", out_dtype)


def ms_rms_norm(x: torch.Tensor, eps: float = 1e-6, out_dtype: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim without affine; saves only its output (shared with the next linear) and rstd.
    ``out_dtype``: one of :data:`OUT_DTYPES` (docs/design.md#ms-norms)."""
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
    ``out_dtype``: the dtype it emits and saves, one of :data:`OUT_DTYPES` (docs/design.md#ms-norms)."""
    _kind = "layernorm"

    def __init__(self, normalized_shape, eps: float = 1e-5, out_dtype: str = "auto"):
        super().__init__(normalized_shape, eps, out_dtype)


class MSRMSNorm(_MSNormBase):
    """RMSNorm without a weight (LLaMA's with γ folded into the next linears) that saves only its output + rstd.
    ``out_dtype``: the dtype it emits and saves, one of :data:`OUT_DTYPES` (docs/design.md#ms-norms)."""
    _kind = "rmsnorm"

    def __init__(self, hidden_size, eps: float = 1e-6, out_dtype: str = "auto"):
        super().__init__(hidden_size, eps, out_dtype)

    @property
    def variance_epsilon(self) -> float:  # the attribute name transformers' LlamaRMSNorm uses
        return self.eps


__all__ = ["ms_layer_norm", "ms_rms_norm", "MSLayerNorm", "MSRMSNorm", "ms_norm_fwd_triton", "ms_norm_bwd_triton",
           "ms_norm_fwd_ref", "ms_norm_bwd_ref", "ms_norm_fwd_cpu", "ms_norm_bwd_cpu", "ms_norm_bytes", "KINDS",
           "MAX_TRITON_N", "OUT_DTYPES", "check_out_dtype"]

"""Which implementation an op runs: the Triton kernel or the PyTorch reference.

Rule: Triton for CUDA tensors, the PyTorch reference for everything else. The environment variable
``LOWMEMBP_BACKEND`` forces one: ``triton`` (also on CPU tensors, which works only under Triton's interpreter,
``TRITON_INTERPRET=1`` set before triton is imported) or ``torch``.
"""
from __future__ import annotations

import os

import torch

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_VALID = ("triton", "torch", "auto", "")


def backend_for(x: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for an op whose main input is ``x``."""
    forced = os.environ.get("LOWMEMBP_BACKEND", "").strip().lower()
    if forced not in _VALID:
        raise ValueError(f"LOWMEMBP_BACKEND={forced!r} is not valid: use 'triton', 'torch' or leave it unset")
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "LOWMEMBP_BACKEND=triton on a CPU tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before triton is imported, or move the tensor to a CUDA device")
        return "triton"
    return "triton" if x.device.type == "cuda" and triton_available() else "torch"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton missing or broken
        return False
    return True


def check_float_input(x: torch.Tensor, op: str) -> None:
    """Raise a clear error for inputs an op does not support (the official CUDA code returns garbage there)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(
            f"{op}: unsupported dtype {x.dtype}; supported are float32, float16 and bfloat16 "
            f"(convert with x.float() or x.to(torch.bfloat16))")


def is_shape_only(x: torch.Tensor) -> bool:
    """True for tensors without data — the meta device or a FakeTensor (memory estimates run ops on these).

    The ops no longer need it (they are ``torch.library`` custom ops whose fake implementations serve such tensors);
    it remains for eager-only code paths (e.g. a check that must not read a fake value). Never call it on a traced
    path: under ``torch.compile`` it is a graph break.
    """
    if x.device.type == "meta":
        return True
    from lowmembp._compat import is_fake
    return is_fake(x)


def refuse_functorch_transforms(x: torch.Tensor, op: str, instead: str) -> None:
    """Raise a clear error when ``x`` is inside a ``torch.func`` gradient transform (grad, vjp, jacrev, jvp, jacfwd,
    hessian) or carries a forward-mode AD tangent: the ops' autograd is registered for ordinary reverse mode only,
    and forward mode would silently give zero tangents. ``torch.func.vmap`` alone is allowed (it runs per sample).
    A no-op under ``torch.compile`` (Dynamo/AOTAutograd trace the op's fake implementation, not this check)."""
    if torch.compiler.is_compiling():
        return
    from lowmembp._compat import functorch_unwrap_grad_tracking
    t, grad_tracking = functorch_unwrap_grad_tracking(x)
    if grad_tracking:
        raise RuntimeError(
            f"{op}: torch.func gradient transforms (grad, vjp, jacrev, jvp, jacfwd, hessian) are not supported "
            f"by this op (its backward is registered for ordinary autograd only). Use loss.backward() / "
            f"torch.autograd.grad, or {instead} inside the transform.")
    import torch.autograd.forward_ad as fwAD
    if fwAD.unpack_dual(t).tangent is not None:
        raise RuntimeError(f"{op}: forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported by this "
                           f"op; use reverse mode (loss.backward() / torch.autograd.grad), or {instead}.")

"""Which implementation an op runs: the Triton kernel, the CPU fast path or the PyTorch reference.

Rule: Triton for CUDA tensors, the CPU fast path for CPU tensors, the PyTorch reference for everything else (and
for CUDA tensors where Triton is missing). The CPU fast path computes the reference's arithmetic, bit for bit equal
to it: one-pass C kernels for the approximate activations' codes, Mesa's quantiser and the norms (LayerNorm's
forward with ATen's own arithmetic replicated, the backward with ATen's row-sum order), compiled on first use
(:mod:`lowmembp.ops.cpu_kernels`; eager ATen ops, the same bits, where no C compiler is found).
The environment variable ``LOWMEMBP_BACKEND`` forces one: ``triton`` (also on CPU tensors, which works only under
Triton's interpreter, ``TRITON_INTERPRET=1`` set before triton is imported), ``cpu`` (CPU tensors only) or ``torch``
(the reference everywhere: the oracle the tests compare against).
"""
from __future__ import annotations

import os

import torch

from lowmembp._compat import dispatch_mode_active, forward_ad_active, functorch_unwrap_grad_tracking, is_fake

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_VALID = ("triton", "cpu", "torch", "auto", "")


def backend_for(x: torch.Tensor) -> str:
    """Return ``"triton"``, ``"cpu"`` or ``"torch"`` for an op whose main input is ``x``."""
    forced = os.environ.get("LOWMEMBP_BACKEND", "").strip().lower()
    if forced not in _VALID:
        raise ValueError(f"LOWMEMBP_BACKEND={forced!r} is not valid: use 'triton', 'cpu', 'torch' or leave it unset")
    if forced == "torch":
        return "torch"
    if forced == "cpu":
        if not x.is_cpu:
            raise RuntimeError(f"LOWMEMBP_BACKEND=cpu on a {x.device.type} tensor: the CPU fast path runs on CPU "
                               f"tensors only; unset LOWMEMBP_BACKEND or set it to 'triton' or 'torch'")
        return "cpu"
    if forced == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "LOWMEMBP_BACKEND=triton on a CPU tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before triton is imported, or move the tensor to a CUDA device")
        return "triton"
    if x.is_cuda:
        return "triton" if triton_available() else "torch"
    return "cpu" if x.is_cpu else "torch"


def eager_backend(x: torch.Tensor) -> str | None:
    """The backend an op may call directly, through a plain ``torch.autograd.Function`` rather than its
    ``torch.library`` custom op, or None where the custom op must run.

    The custom op's dispatch costs some hundred microseconds of Python per forward + backward: on the CPU more than
    the op itself on small tensors, on a GPU more than the kernel (the host then falls behind the device, and a
    training step waits on it). So where nothing needs the custom op: a plain CPU or CUDA tensor (not a FakeTensor or
    other subclass, not on the meta device), in eager mode (not traced by ``torch.compile``), not wrapped by
    ``torch.func``, with no ``TorchDispatchMode`` in force (a memory tracker sees the custom op as one op, its
    outputs only, as the fake implementation that the estimator runs), and a backend that is a kernel: ``"triton"``
    (CUDA tensors, or CPU tensors under Triton's interpreter) or ``"cpu"`` (the CPU fast path). The PyTorch
    reference keeps the custom op (the oracle, one code path); so does everything traced or fake."""
    if (type(x) is not torch.Tensor or torch.compiler.is_compiling() or not (x.is_cpu or x.is_cuda)
            or dispatch_mode_active()):
        return None
    inner, grad_tracking = functorch_unwrap_grad_tracking(x)
    if inner is not x or grad_tracking:
        return None
    backend = backend_for(x)
    return backend if backend != "torch" else None


def device_type(x: torch.Tensor) -> str:
    """``x.device.type``, without building the ``torch.device`` (microseconds an op call on the CPU hot paths)."""
    return "cpu" if x.is_cpu else "cuda" if x.is_cuda else x.device.type


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when autocast is on for x's device, else None (also for a device autocast does not
    know)."""
    dev = device_type(x)
    try:
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    except (RuntimeError, ValueError, TypeError):
        return None


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
    return x.is_meta or is_fake(x)


def refuse_functorch_transforms(x: torch.Tensor, op: str, instead: str) -> None:
    """Raise a clear error when ``x`` is inside a ``torch.func`` gradient transform (grad, vjp, jacrev, jvp, jacfwd,
    hessian) or carries a forward-mode AD tangent: the ops' autograd is registered for ordinary reverse mode only,
    and forward mode would silently give zero tangents. ``torch.func.vmap`` alone is allowed (it runs per sample).
    A no-op under ``torch.compile`` (Dynamo/AOTAutograd trace the op's fake implementation, not this check)."""
    if torch.compiler.is_compiling():
        return
    t, grad_tracking = functorch_unwrap_grad_tracking(x)
    if grad_tracking:
        raise RuntimeError(
            f"{op}: torch.func gradient transforms (grad, vjp, jacrev, jvp, jacfwd, hessian) are not supported "
            f"by this op (its backward is registered for ordinary autograd only). Use loss.backward() / "
            f"torch.autograd.grad, or {instead} inside the transform.")
    if forward_ad_active() and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
        raise RuntimeError(f"{op}: forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported by this "
                           f"op; use reverse mode (loss.backward() / torch.autograd.grad), or {instead}.")


# The CPU fast paths split their blocks over threads themselves: each block is smaller than ATen's grain (32768
# elements), so that an op on it runs on the calling thread, and the ranges of blocks go to Python threads (ATen
# releases the GIL while an op runs). Many short ops each opening an OpenMP region would wait at every region's
# barrier for a thread the OS has descheduled — on a loaded machine hundreds of times slower.
CPU_BLOCK = 1 << 15  # elements per block: below ATen's grain size, so that an op on a block stays on its thread
_POOL: dict = {}


def cpu_block(block: int = CPU_BLOCK) -> int:
    """Elements per block for the calling thread count: ``block`` when the blocks are spread over threads, four
    times that on one thread (fewer ops, no OpenMP region to open either way)."""
    return block if torch.get_num_threads() > 1 else 4 * block


def _no_grad(work, lo, hi):
    with torch.no_grad():  # grad mode is per thread: a worker has it on, and the op's body runs without autograd
        return work(lo, hi)


def cpu_parallel(n: int, align: int, work, min_per_thread: int = 2 * CPU_BLOCK) -> None:
    """Call ``work(lo, hi)`` on consecutive ranges covering ``[0, n)`` (each a multiple of ``align`` long except the
    last), one range per thread of ``torch.get_num_threads()``, in parallel; re-raise the first error."""
    threads = max(1, torch.get_num_threads())
    parts = max(1, min(threads, n // max(min_per_thread, align)))
    if parts == 1:
        work(0, n)
        return
    step = -(-n // parts)
    step = -(-step // align) * align
    ranges = [(s, min(s + step, n)) for s in range(0, n, step)]
    if len(ranges) == 1:
        work(0, n)
        return
    from concurrent.futures import ThreadPoolExecutor

    pool = _POOL.get(threads)
    if pool is None:
        pool = _POOL[threads] = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="lowmembp-cpu")
    futures = [pool.submit(_no_grad, work, lo, hi) for lo, hi in ranges[1:]]
    try:
        work(*ranges[0])
    finally:
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e

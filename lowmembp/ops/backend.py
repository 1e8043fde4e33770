"""Which implementation an op runs: the Triton kernel, the CPU fast path or the PyTorch reference.

Rule: Triton for CUDA tensors, the CPU fast path for CPU tensors, the PyTorch reference for everything else (and
for CUDA tensors where Triton is missing). The CPU fast path computes the reference's arithmetic, bit for bit equal
to it (:mod:`lowmembp.ops.cpu_kernels`; eager ATen ops, the same bits, where no C compiler is found).

One backend can be forced: ``LOWMEMBP_BACKEND`` (read once, when this module is imported) or :func:`set_backend` /
``with use_backend(name):`` at run time: ``triton`` (also on CPU tensors, which works only under Triton's
interpreter, ``TRITON_INTERPRET=1`` set before triton is imported), ``cpu`` (CPU tensors only) or ``torch`` (the
reference everywhere: the oracle the tests compare against). An op call reads no environment: the choice is made
when it is set, and :func:`eager_backend` is a few attribute reads (docs/performance/host-time.md).
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch

from lowmembp._compat import (dispatch_mode_active, forward_ad_active, functorch_unwrap_grad_tracking, is_fake,
                              is_functorch_wrapped)

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ENV = "LOWMEMBP_BACKEND"
_VALID = ("triton", "cpu", "torch", "auto", "")


class _Routes(NamedTuple):
    """The forced backend's consequences, worked out once when it is set: what CPU and CUDA tensors run (or the
    error a call on such a tensor raises)."""
    forced: str
    cpu: str
    cuda: str
    cpu_error: str | None = None
    cuda_error: str | None = None
    invalid: bool = False  # the name is not a backend: every call raises ValueError


_TRITON: list[bool] = []  # [whether triton imports], filled on first need


def triton_available() -> bool:
    """Whether triton imports (checked once per process)."""
    if not _TRITON:
        try:
            import triton  # noqa: F401
            _TRITON.append(True)
        except Exception:  # pragma: no cover - triton missing or broken
            _TRITON.append(False)
    return _TRITON[0]


def routes_for(name: str | None) -> _Routes:
    """The routes for a forced backend ``name`` (None or ``"auto"``: none forced). An invalid name gives routes
    whose every call raises an error saying what is valid (so that a bad environment variable fails the first op
    call, not the import)."""
    forced = (name or "").strip().lower()
    if forced not in _VALID:
        err = f"{ENV}={forced!r} is not valid: use 'triton', 'cpu', 'torch' or leave it unset"
        return _Routes(forced, "torch", "torch", err, err, invalid=True)
    if forced == "torch":
        return _Routes(forced, "torch", "torch")
    if forced == "cpu":
        return _Routes(forced, "cpu", "torch", cuda_error=(
            f"{ENV}=cpu on a non-CPU tensor: the CPU fast path runs on CPU tensors only; unset {ENV} (or "
            f"set_backend(None)) or choose 'triton' or 'torch'"))
    if forced == "triton":
        cpu_error = None if os.environ.get("TRITON_INTERPRET", "0") == "1" else (
            f"{ENV}=triton on a CPU tensor needs Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
            f"imported, or move the tensor to a CUDA device")
        return _Routes(forced, "triton", "triton", cpu_error=cpu_error)
    return _Routes(forced, "cpu", "triton" if triton_available() else "torch")


_routes = routes_for(os.environ.get(ENV))


def set_backend(name: str | None) -> str:
    """Force ``name`` (``"triton"``, ``"cpu"``, ``"torch"``; None or ``"auto"``: the rule) for every later op call
    in this process; returns the previous setting. Raises ValueError for an unknown name."""
    global _routes
    routes = routes_for(name)
    if routes.invalid:
        raise ValueError(routes.cpu_error.replace(f"{ENV}=", "backend "))
    previous, _routes = _routes.forced, routes
    return previous


@contextlib.contextmanager
def use_backend(name: str | None):
    """``with use_backend("torch"): ...``: :func:`set_backend` for the block, the previous setting restored after."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def forced_backend() -> str:
    """The forced backend's name, ``""`` when none is."""
    return _routes.forced


def backend_for(x: torch.Tensor) -> str:
    """Return ``"triton"``, ``"cpu"`` or ``"torch"`` for an op whose main input is ``x``."""
    r = _routes
    if r.invalid:
        raise ValueError(r.cpu_error)
    if x.is_cpu:
        if r.cpu_error:
            raise RuntimeError(r.cpu_error)
        return r.cpu
    if r.cuda_error:  # CUDA and the other devices (meta: the custom op's fake implementation serves it)
        raise RuntimeError(r.cuda_error)
    return r.cuda if x.is_cuda else "torch"


_is_compiling = torch.compiler.is_compiling


def eager_backend(x: torch.Tensor) -> str | None:
    """The backend an op may call directly, through a plain ``torch.autograd.Function`` rather than its
    ``torch.library`` custom op, or None where the custom op must run.

    The custom op's Python dispatch costs more than the kernels on small tensors, so it runs only where it is
    needed: for a tensor that is not a plain CPU or CUDA tensor (a FakeTensor or other subclass, the meta device),
    while ``torch.compile`` traces, inside ``torch.func`` transforms or forward-mode AD, and while a
    ``TorchDispatchMode`` is in force (a memory tracker then sees the custom op whole, as the fake implementation the
    estimator runs), and on the PyTorch reference (the oracle keeps one code path)."""
    if type(x) is not torch.Tensor or _is_compiling() or dispatch_mode_active() or is_functorch_wrapped(x) \
            or forward_ad_active():
        return None
    r = _routes
    if x.is_cuda:
        backend = r.cuda if r.cuda_error is None else backend_for(x)
    elif x.is_cpu:
        backend = r.cpu if r.cpu_error is None else backend_for(x)
    else:
        return None
    return None if backend == "torch" else backend


def stream_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (False without CUDA): the ops then read
    nothing back from the device and draw their random seeds there."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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

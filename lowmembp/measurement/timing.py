"""Step time after warm-up: p20 / p50 / p80 over repeats.

    stats = time_steps(step, warmup=3, repeats=20)   # {"p20", "p50", "p80", "n", "how"}, seconds
    times = time_interleaved({"a": step_a, "b": step_b}, rounds=10)   # {"a": [s, ...], "b": [...]}: taking turns
    hold_freed_memory()   # glibc: freed tensors' memory is reused, not returned to the OS (CPU benchmarks)

CUDA: each step is bracketed by CUDA events (``elapsed_time`` after a synchronise), so asynchronous kernels are
counted where they run. CPU: ``torch.cuda``-free, ``time.perf_counter`` around the step (CPU ops are synchronous;
``device="cuda"`` with events is chosen automatically when a CUDA device is given).
Percentiles use linear interpolation between order statistics (``numpy.percentile``'s default).
"""
from __future__ import annotations

import ctypes
import platform
import time
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["time_steps", "time_interleaved", "summarize", "throughput", "hold_freed_memory"]


def summarize(samples: Sequence[float], how: str = "") -> dict:
    """``{"p20", "p50", "p80", "n", "how"}`` of step times in seconds (linear-interpolated percentiles)."""
    arr = np.asarray(list(samples), dtype=float)
    if arr.size == 0:
        raise ValueError("summarize: no samples (run at least one timed repeat)")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"summarize: step times must be finite and >= 0, got {arr.tolist()}")
    p20, p50, p80 = np.percentile(arr, [20, 50, 80])
    return {"p20": float(p20), "p50": float(p50), "p80": float(p80), "n": int(arr.size), "how": how}


def time_steps(step: Callable[[], object], *, warmup: int = 3, repeats: int = 20,
               device: torch.device | str | None = None) -> dict:
    """Run ``step`` ``warmup`` times untimed, then ``repeats`` timed; return :func:`summarize` of the times."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_steps: need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = torch.device(device) if device is not None else None
    for _ in range(warmup):
        step()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return summarize(times, "cuda events")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return summarize(times, "cpu perf_counter")


def time_interleaved(steps: Mapping[str, Callable[[int], object]], *, rounds: int, warmup: int = 1,
                     rotate: bool = False) -> dict[str, list[float]]:
    """``{name: [seconds of each timed round]}`` for ``steps`` (``{name: step(round)}``) run in turns: one step of
    each per round, ``warmup`` rounds untimed first. Taking turns, every step sees the same changes of a shared
    machine's load, which back-to-back repeats of one step and then the other would not. ``rotate``: each round
    starts one name later, so that no step always runs right after the same one. CPU steps (``time.perf_counter``;
    the ops are synchronous)."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"time_interleaved: need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    names = list(steps)
    if not names:
        raise ValueError("time_interleaved: no steps given")
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        shift = r % len(names) if rotate else 0
        for n in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            steps[n](r)
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[n].append(dt)
    return times


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def hold_freed_memory(mmap_threshold: int = 32 << 20) -> bool:
    """Keep the memory of freed CPU tensors in this process for reuse, for the rest of the process (glibc only).

    PyTorch allocates CPU tensors with the C library's ``malloc``, which glibc serves from fresh ``mmap`` memory above
    an adaptive threshold (128 KiB at start, raised up to 32 MiB by frees) and gives back to the OS on free (or trims
    its heap). A fresh mapping costs one page fault per 4 KiB on first touch, the kernel zeroing each page: for a
    22.5 MB tensor about 5500 faults, as long as the op that fills it here. Whether a tensor of a given size is fresh
    then depends on the process's history of allocations, so the same op's time can change by 2× between processes or
    within one. This fixes the threshold at ``mmap_threshold`` bytes (glibc's largest) and turns trimming off
    (``mallopt``), so that a tensor below it reuses freed heap memory, as tensors do in a caching allocator; larger
    ones are still mapped fresh. Returns whether it took effect (False on another C library: nothing changes). CPU
    benchmarks call it before timing (``benchmarks/cpu_ops.py``, ``benchmarks/cpu_steps.py``) and say so; the same
    effect from outside a process: ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:``
    ``glibc.malloc.trim_threshold=4294967295``.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))


def throughput(step_time_s: dict, batch_size: int, tokens_per_sample: int | None = None) -> dict:
    """Samples/s (and tokens/s) at the median step time."""
    p50 = step_time_s["p50"]
    if p50 <= 0:
        raise ValueError(f"throughput: median step time must be > 0, got {p50}")
    sps = batch_size / p50
    return {"samples_per_s": sps, "tokens_per_s": sps * tokens_per_sample if tokens_per_sample else None}

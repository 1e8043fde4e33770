"""Step time after warm-up: p20 / p50 / p80 over repeats.

    stats = time_steps(step, warmup=3, repeats=20)   # {"p20", "p50", "p80", "n", "how"}, seconds
    times = time_interleaved({"a": step_a, "b": step_b}, rounds=10)   # {"a": [s, ...], "b": [...]}: taking turns
    hold_freed_memory()   # glibc: freed tensors' memory is reused, not returned to the OS (CPU benchmarks)
    median_interval(times["a"])          # {"median", "low", "high", "level", "n"}: the median and its 95 % interval
    ratio_interval(times["a"], times["b"])   # the per-round ratio a / b, its median and 95 % interval

The one timing protocol (benchmarks, the GPU run and the training job share it): configurations compared with each
other take turns round by round (:func:`time_interleaved`), warm-up rounds are discarded, each row reports the median
with its 95 % interval (:func:`median_interval`, distribution-free: two order statistics), and a ratio of two rows is
the median of their per-round ratios with its interval (:func:`ratio_interval`: paired by round, so a drift of the
machine that hits both rows cancels).

CUDA: each step is bracketed by CUDA events (``elapsed_time`` after a synchronise), so asynchronous kernels are
counted where they run. CPU: ``torch.cuda``-free, ``time.perf_counter`` around the step (CPU ops are synchronous;
``device="cuda"`` with events is chosen automatically when a CUDA device is given).
Percentiles use linear interpolation between order statistics (``numpy.percentile``'s default).
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import platform
import time
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["time_steps", "time_interleaved", "summarize", "throughput", "hold_freed_memory", "median_interval",
           "ratio_interval", "EventTimer"]


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
                     rotate: bool = False, device: torch.device | str | None = None) -> dict[str, list[float]]:
    """``{name: [seconds of each timed round]}`` for ``steps`` (``{name: step(round)}``) run in turns: one step of
    each per round, ``warmup`` rounds untimed first. Taking turns, every step sees the same changes of a shared
    machine's load, which back-to-back repeats of one step and then the other would not. ``rotate``: each round
    starts one name later, so that no step always runs right after the same one. CPU steps: ``time.perf_counter``
    (the ops are synchronous); ``device`` a CUDA device: CUDA events around each step on the current stream
    (:class:`EventTimer`), read after one synchronisation at the end, so nothing waits between the steps."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"time_interleaved: need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    names = list(steps)
    if not names:
        raise ValueError("time_interleaved: no steps given")
    timers = {n: EventTimer(device) for n in names}
    for r in range(warmup + rounds):
        shift = r % len(names) if rotate else 0
        for n in names[shift:] + names[:shift]:
            with timers[n].time(keep=r >= warmup):
                steps[n](r)
    return {n: t.seconds() for n, t in timers.items()}


class EventTimer:
    """Times of code blocks: CUDA events on a CUDA ``device`` (recorded around each block on the current stream, read
    in :meth:`seconds` after one synchronisation: the host never waits between blocks), else ``time.perf_counter``.

        timer = EventTimer("cuda")
        with timer.time():
            step()
        timer.seconds()   # [s, ...]
    """

    def __init__(self, device: torch.device | str | None = None):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = dev.type == "cuda"
        self.how = "cuda events" if self.cuda else "cpu perf_counter"
        self._pending: list = []  # (start, end) events not yet read
        self._times: list[float] = []

    @contextlib.contextmanager
    def time(self, keep: bool = True):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            if keep:
                self._pending.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        if keep:
            self._times.append(time.perf_counter() - t0)

    def seconds(self) -> list[float]:
        """Every kept block's seconds, in order (CUDA: synchronises on the last event first)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self._times += [s.elapsed_time(e) / 1e3 for s, e in self._pending]
            self._pending = []
        return list(self._times)


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2 ** n if k >= 0 else 0.0


def median_interval(samples: Sequence[float], level: float = 0.95) -> dict:
    """The median of ``samples`` and a distribution-free interval around it: the order statistics ``x(j)`` and
    ``x(n+1-j)`` with the largest ``j`` whose coverage ``P(j <= B < n+1-j)``, ``B ~ Binomial(n, 1/2)``, is at least
    ``level``. Returns ``{"median", "low", "high", "level", "coverage", "n"}``; with fewer than 6 samples no pair
    reaches 95 %: ``low`` / ``high`` are then the smallest and largest sample and ``coverage`` says what they
    cover."""
    arr = np.sort(np.asarray(list(samples), dtype=float))
    n = int(arr.size)
    if n == 0:
        raise ValueError("median_interval: no samples")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"median_interval: samples must be finite, got {arr.tolist()}")
    if not 0 < level < 1:
        raise ValueError(f"median_interval: level must be in (0, 1), got {level}")
    j, coverage = 1, 1 - 2 * _binom_cdf(0, n)  # x(1), x(n)
    for cand in range(1, n // 2 + 1):
        cov = 1 - 2 * _binom_cdf(cand - 1, n)
        if cov >= level:
            j, coverage = cand, cov
        else:
            break
    return {"median": float(np.median(arr)), "low": float(arr[j - 1]), "high": float(arr[n - j]),
            "level": level, "coverage": float(coverage), "n": n}


def ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> dict:
    """The ratio of two rows timed round by round: :func:`median_interval` of the per-round ratios ``a[i] / b[i]``
    (paired: round ``i`` of both ran side by side). For a throughput ratio pass the times the other way round
    (``ratio_interval(t_b, t_a)`` is ``a``'s throughput over ``b``'s)."""
    a, b = list(a), list(b)
    if len(a) != len(b) or not a:
        raise ValueError(f"ratio_interval: need two equal, non-empty lists of rounds, got {len(a)} and {len(b)}")
    if any(x <= 0 for x in b):
        raise ValueError("ratio_interval: the denominator's times must be > 0")
    return median_interval([x / y for x, y in zip(a, b)], level)


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

"""Measurements around a training step, on an explicit schedule.

    schedule = Schedule(saved_bytes_at=0, peak_at=1, time_from=2)
    probes = [SavedBytesProbe(model, at=0), PeakProbe(model, optimizer, at=1), StepTimer(device, time_from=2)]
    for step in range(steps):
        result = run_step(step, one_step, probes)       # each probe that wants this step wraps it
    for probe in probes:
        probe.report(sections)                          # fills the record's sections

A step is a callable ``step(forward) -> StepResult`` where ``forward`` is a context manager entered around the
forward pass of the first micro-batch (what saved-tensor accounting needs); a probe's ``wrap(step)`` returns a new
step callable that measures the inner one. A new measurement (host memory of an offloading method, the peak of a
compiled step) is one more probe class: ``wants(step)``, ``wrap(step_fn)``, ``report(sections)``.

The probes that change what they measure (the saved-tensor accountant, the memory tracker) run on steps of their
own; the timer leaves those steps out (:meth:`Schedule.timed`), so step times never include measurement overhead.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean training loss of the step's micro-batches
    samples: int
    tokens: int | None  # None when the task does not count tokens


StepFn = Callable[[ContextManager], StepResult]


@dataclass(frozen=True)
class Schedule:
    """At which steps each measurement runs (step numbers from 0)."""
    saved_bytes_at: int | None = 0  # None: not measured
    peak_at: int | None = 1
    time_from: int = 2  # the first timed step (``--timing-warmup``)

    def __post_init__(self):
        for name in ("saved_bytes_at", "peak_at"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"Schedule.{name} must be >= 0 or None, got {v}")
        if self.time_from < 0:
            raise ValueError(f"Schedule.time_from must be >= 0, got {self.time_from}")

    def measured(self, step: int) -> bool:
        """A step that a memory probe runs on (slowed down by its bookkeeping)."""
        return step in (self.saved_bytes_at, self.peak_at)

    def timed(self, step: int) -> bool:
        return step >= self.time_from and not self.measured(step)


class Probe(Protocol):
    def wants(self, step: int) -> bool: ...

    def wrap(self, step_fn: StepFn) -> StepFn: ...

    def report(self, sections: dict) -> None: ...


def run_step(step: int, step_fn: StepFn, probes) -> StepResult:
    """Run one step with every probe that wants it wrapped around it (the first probe outermost)."""
    fn = step_fn
    for probe in reversed([p for p in probes if p.wants(step)]):
        fn = probe.wrap(fn)
    return fn(contextlib.nullcontext())


class SavedBytesProbe:
    """Activation bytes saved for backward by the first micro-batch's forward, by op kind
    (``lowmembp.measurement.saved.SavedTensorAccountant``) → ``saved_bytes``."""

    def __init__(self, model, at: int | None):
        self.model, self.at, self.result = model, at, None

    def wants(self, step: int) -> bool:
        return step == self.at

    def wrap(self, step_fn: StepFn) -> StepFn:
        from lowmembp.measurement.saved import SavedTensorAccountant

        def step(forward):
            accountant = SavedTensorAccountant(self.model)

            @contextlib.contextmanager
            def both():
                with forward, accountant:
                    yield
            out = step_fn(both())
            rep = accountant.report()
            self.result = {"total": int(rep["total"]), "by_kind": {k: int(v) for k, v in rep["by_kind"].items()},
                           "how": "lowmembp.measurement.saved.SavedTensorAccountant, one forward"}
            return out
        return step

    def report(self, sections: dict) -> None:
        if self.result is not None:
            sections["saved_bytes"] = self.result


class MemoryBudgetExceeded(MemoryError):
    """The measured peak is over ``--max-memory-mb``: the run is recorded as ``oom``."""


class PeakProbe:
    """Peak memory of one whole steady training step on the model's device
    (``lowmembp.measurement.peak.measure_step_peak``: the CUDA allocator's peak, on CPU the storage tracker) →
    ``peak.device``. A failure of the tracker itself is not a failure of the run: the step is run again untracked and
    the failure becomes a note. Over ``budget_bytes`` raises :class:`MemoryBudgetExceeded`. ``measure``: another
    ``measure_step_peak(model, optimizer, step, warmup=0)`` (a sharded model's:
    ``experiments.distributed.peak_measure``)."""

    def __init__(self, model, optimizer, at: int | None, budget_bytes: float | None = None, is_fatal=None,
                 measure=None):
        self.model, self.optimizer, self.at, self.budget = model, optimizer, at, budget_bytes
        self.measure = measure
        self.is_fatal = is_fatal or (lambda err: False)
        self.result, self.notes = None, []

    def wants(self, step: int) -> bool:
        return step == self.at

    def wrap(self, step_fn: StepFn) -> StepFn:
        from lowmembp.measurement.peak import measure_step_peak

        measure = self.measure or measure_step_peak

        def step(forward):
            box = {}
            try:
                peak = measure(self.model, self.optimizer,
                                         lambda: box.setdefault("out", step_fn(forward)), warmup=0)
            except Exception as err:  # the tracker failed, not necessarily the training: train on, say so
                if self.is_fatal(err):
                    raise
                note = f"peak-memory measurement failed ({type(err).__name__}: {err}); peak.device is null"
                print(f"warning: {note}", file=sys.stderr)
                self.notes.append(note)
                if "out" not in box:
                    self.optimizer.zero_grad(set_to_none=True)
                peak = None
            out = box["out"] if "out" in box else step_fn(contextlib.nullcontext())
            self.result = peak
            if peak is not None and self.budget is not None and peak["bytes"] > self.budget:
                raise MemoryBudgetExceeded(
                    f"out of memory: measured peak {peak['bytes'] / 2**20:.1f} MiB ({peak['how']}) exceeds "
                    f"--max-memory-mb {self.budget / 2**20:g}")
            return out
        return step

    def report(self, sections: dict) -> None:
        if self.result is not None:
            sections.setdefault("peak", {})["device"] = {
                "bytes": int(self.result["bytes"]), "how": self.result["how"],
                "by_category": {k: int(v) for k, v in (self.result.get("by_category") or {}).items()}}
            if self.result.get("reserved_bytes") is not None:  # CUDA: the allocator's reserved peak
                sections["peak"]["device"]["reserved_bytes"] = int(self.result["reserved_bytes"])
            host = self.result.get("host")  # offloading: host memory, measured apart from the device
            if host is not None:
                sections["peak"]["host"] = {"bytes": int(host["bytes"]), "how": host["how"],
                                            "by_category": {k: int(v) for k, v in host["by_category"].items()}}
        sections.setdefault("notes", []).extend(self.notes)


class StepTimer:
    """Time of every step the schedule times → ``step_time_s`` (p20/p50/p80, the median's 95 % interval:
    ``lowmembp.measurement.timing.median_interval``) and ``throughput`` (samples and tokens of those steps / their
    total time). On CUDA each step is bracketed by CUDA events on the current stream after a synchronisation (so the
    window starts with the device idle and ends when the step's last kernel does: the host's launch gaps inside the
    step count, the previous step's tail does not); on the CPU ``time.perf_counter``. The steps before
    ``Schedule.time_from`` are the warm-up and are not timed."""

    def __init__(self, device, schedule: Schedule):
        import torch

        from lowmembp.measurement.timing import EventTimer

        self.schedule = schedule
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(device)) if self.cuda else (lambda: None)
        self.timer = EventTimer(device if self.cuda else "cpu")
        self._host: list[float] = []  # host wall time per step (the progress bar's rate, read without a sync)
        self.samples: list[int] = []
        self.tokens: list[int | None] = []

    @property
    def times(self) -> list[float]:
        return self.timer.seconds()

    def wants(self, step: int) -> bool:
        return self.schedule.timed(step)

    def wrap(self, step_fn: StepFn) -> StepFn:
        def step(forward):
            self.sync()
            t0 = time.perf_counter()
            with self.timer.time():
                out = step_fn(forward)
            self._host.append(time.perf_counter() - t0)
            self.samples.append(out.samples)
            self.tokens.append(out.tokens)
            return out
        return step

    def samples_per_s(self) -> float | None:
        return sum(self.samples) / sum(self._host) if self._host and sum(self._host) > 0 else None

    def report(self, sections: dict) -> None:
        from lowmembp.measurement.timing import median_interval, summarize

        times = self.times
        if not times:
            return
        how = ("cuda events per step (synchronised before each)" if self.cuda else "perf_counter per step")
        stats = summarize(times, how)
        ci = median_interval(times)
        stats.update(ci95_low=ci["low"], ci95_high=ci["high"])
        sections["step_time_s"] = stats
        total = sum(times)
        tok = None if any(t is None for t in self.tokens) or total <= 0 else sum(self.tokens) / total
        sections["throughput"] = {"samples_per_s": sum(self.samples) / total if total > 0 else 0.0,
                                  "tokens_per_s": tok}

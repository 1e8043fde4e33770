"""The planner's fake-tensor steps: :func:`lowmembp.estimator.step.estimate`'s procedure, built once, run at several
batches.

    steps = Steps(spec, "lora+checkpointing", layers=2, seq_len=2048, dtype="bf16")
    run = steps.run(4, flops=True)     # run.peak: estimate()'s "peak" at batch 4, run.flops, run.events
    line = BatchLine(run, steps.run(5))
    line.peak(37)                      # the peak at batch 37 from those two steps (see BatchLine), or None

Why not :func:`estimate` itself: it builds and converts the model for every call and counts saved tensors the planner
does not read. Here the model is built once per combination and depth and every step runs under an
:class:`EventTracker` riding in the fake mode (:class:`RecordingFakeMode`, less dispatch than a second mode), so the
peak is ``estimate()``'s to the byte (``tests/plan/test_plan_fast.py``). :class:`BatchLine` reads the peak at any
batch off two steps whose op sequences match, the creation events' totals being linear in the batch; batch 1 is
always stepped. The argument for both: docs/planner.md, "How a row is stepped".
"""
from __future__ import annotations

import contextlib

import torch
from lowmembp.estimator.fsdp import fsdp_peak
from lowmembp.estimator.step import make_optimizer, prepare_model, train_step
from lowmembp.estimator.zoo import ModelSpec, block_names, make_batch
from lowmembp.estimator.weights import nf4_peak
from lowmembp.estimator.fake_mode import StepFakeMode, answer_device
from lowmembp.measurement.peak import CATEGORIES, DEVICE_QUERY, StorageTracker, prime_optimizer
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER

__all__ = ["Steps", "StepRun", "BatchLine", "EventTracker", "RecordingFakeMode", "MIN_BATCH"]

MIN_BATCH = 2  # the smallest batch a line is fitted on or gives (batch 1 is stepped: docs/planner.md)


class RecordingFakeMode(StepFakeMode):
    """A :class:`lowmembp.estimator.fake_mode.StepFakeMode` that hands every op it runs for its caller to
    ``observer(func, args, kwargs, out)`` while one is set (not the ops of its own decompositions, which a dispatch
    mode stacked above it would not see either; not ``prim.device``, which only answers a tensor's device).

    Why: a :class:`StorageTracker` entered as a second dispatch mode above the fake mode puts every op through two
    Python modes, and most of a fake step is that per-op dispatch (on LLaMA-7B shapes ~4 300 dispatches a 3-block
    step, 3 000 of them the autograd engine asking ``prim.device``). Riding in the fake mode itself it sees the same
    ops in the same order (``tests/plan/test_plan_fast.py``: the same events, peaks and FLOPs) for 3-30 % less time."""

    observer = None
    _depth = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``_disable_dynamo`` wrapper around this mode's ``__torch_dispatch__`` (torch's switch for it): nothing
        a planner step runs is compiled (the ``compile`` method is left out of plans), and the wrapper costs ~4 µs
        on each of the step's ~4 000 dispatches, two thirds of them ``prim.device`` queries."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:  # answered at once, as StepFakeMode does (torch's own answer without its fast path)
            return answer_device(args) if self.fast else self.dispatch_op(func, types, args, kwargs)
        kwargs = kwargs or {}
        if self.observer is None or self._depth:
            return self.dispatch_op(func, types, args, kwargs)
        self._depth += 1
        try:
            out = self.dispatch_op(func, types, args, kwargs)
        finally:
            self._depth -= 1
        self.observer(func, args, kwargs, out)
        return out


class EventTracker(StorageTracker):
    """A :class:`StorageTracker` that also keeps, for every storage it starts counting on the device, the running
    total and its split by category right after it (the events the peak is the largest of), and can count the
    step's FLOPs (``flops``, a :class:`lowmembp.measurement.flops.StepFlops`) from the same ops. Entered as a dispatch
    mode like
    its parent, or ridden in a :class:`RecordingFakeMode` with :meth:`recording` (the planner's steps)."""

    def __init__(self, flops=None):
        super().__init__()
        self.events: list[tuple] = []   # (total, (bytes per category in CATEGORIES order), saved bytes, phase)
        self.flops = flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not DEVICE_QUERY:
            self.observe(func, args, kwargs, out)
        return out

    def observe(self, func, args, kwargs, out) -> None:
        """One op ``func(*args, **kwargs)`` that returned ``out``: its FLOPs, its new storages."""
        if self.flops is not None:
            self.flops.count(func, args, kwargs, out)
        self._note(out)

    @contextlib.contextmanager
    def recording(self, mode: RecordingFakeMode):
        """Track the ops ``mode`` runs inside this block (instead of entering this tracker as a mode)."""
        if mode.observer is not None:
            raise RuntimeError("RecordingFakeMode: another tracker is recording in this mode")
        self._start()
        mode.observer = self.observe
        try:
            yield self
        finally:
            mode.observer = None
            self._stop()

    def count_storage(self, st, key, category):
        new = self.category_of(key) is None
        super().count_storage(st, key, category)
        if new and category in self.current:
            self.events.append((self.total, tuple(self.current[c] for c in CATEGORIES), self.saved, self.phase()))


class StepRun:
    """One measured step: ``peak`` (estimate()'s ``"peak"`` dict before any FSDP sharding), ``flops`` (or None),
    ``events`` (see :class:`EventTracker`), and what :func:`lowmembp.estimator.fsdp.fsdp_peak` needs."""

    def __init__(self, batch_size: int, peak: dict, flops: int | None, events: list[tuple]):
        self.batch_size, self.peak, self.flops, self.events = batch_size, peak, flops, events


class Steps:
    """One combination at one depth, built once; :meth:`run` is one measured training step at a batch size."""

    def __init__(self, spec: ModelSpec, method: str, *, layers: int | None, seq_len: int | None, dtype: str,
                 overrides: dict | None = None, world_size: int = 1, seed: int = 0, weights: str = "fp32",
                 optimizer: str = DEFAULT_OPTIMIZER, **method_options):
        self.spec, self.seq_len, self.dtype, self.world_size = spec, seq_len or spec.seq_len, dtype, world_size
        if weights == "nf4" and world_size > 1:
            raise ValueError("weights='nf4' with world_size > 1 is not modelled (FSDP2 of 4-bit weights)")
        self.weights = weights
        self.vocab = (overrides or {}).get("vocab_size")
        torch.manual_seed(seed)
        self.mode = RecordingFakeMode(allow_non_fake_inputs=True)
        self.model = prepare_model(spec, method, self.mode, layers=layers, overrides=overrides, weights=weights,
                                   **method_options)
        self.opt = make_optimizer(self.model, optimizer)  # outside the mode, as estimate() makes it
        with self.mode:
            prime_optimizer(self.opt)
        self.blocks = block_names(self.model)
        self.last_block = self.model.get_submodule(self.blocks[-1]) if self.blocks else None

    def run(self, batch_size: int, flops: bool = False, seq_len: int | None = None) -> StepRun:
        """One step at ``batch_size`` (and ``seq_len`` tokens: the built model's own length when None)."""
        with self.mode:
            batch = make_batch(self.spec, self.model, batch_size, seq_len or self.seq_len, self.vocab)
            counter = None
            if flops:
                from lowmembp.measurement.flops import step_flop_counter
                counter = step_flop_counter()
            tracker = EventTracker(counter)
            tracker.track_external(self.model, self.opt, *batch.values())  # as measure_step_peak registers them
            tracker.watch(self.model)
            tracker.watch_phases(self.model, self.last_block)
            with tracker.recording(self.mode):
                train_step(self.spec, self.model, batch, self.opt, self.dtype, around_forward=tracker.saved_hooks())
        peak = _peak_dict(tracker.peak, dict(tracker.peak_by_category), tracker, tracker.peak_saved,
                          tracker.peak_phase)
        return StepRun(batch_size, peak, counter.get_total_flops() if counter is not None else None, tracker.events)

    def shard(self, peak: dict, weights: str | None = None) -> dict:
        """``peak`` with the weights as stored (``weights``, default the built model's; NF4:
        :func:`lowmembp.estimator.weights.nf4_peak`) and as one rank's under FSDP2 when ``world_size > 1``
        (estimate's :func:`fsdp_peak`), else itself."""
        if (weights or self.weights) == "nf4":
            peak = nf4_peak(peak, self.model)
        if self.world_size > 1:
            return fsdp_peak(peak, self.model, self.opt, self.blocks, self.world_size)
        return peak


class BatchLine:
    """The peak at any batch from two steps at batches ``b₁ < b₂`` with the same creation events
    (docs/planner.md, "How a row is stepped")."""

    def __init__(self, a: StepRun, b: StepRun):
        self.ok = len(a.events) == len(b.events) and a.batch_size != b.batch_size and min(a.batch_size,
                                                                                          b.batch_size) >= MIN_BATCH
        self.a, self.b = a, b

    def peak(self, batch_size: int) -> dict | None:
        """The tracker's ``{"bytes", "how", "by_category"}`` at ``batch_size``; None without a line (or when a
        line's value at that batch is not a whole number of bytes, which a real step cannot give; batch 1)."""
        if not self.ok or batch_size < MIN_BATCH:
            return None
        b1, b2 = self.a.batch_size, self.b.batch_size
        d = b2 - b1
        best, best_at = 0, None
        for (t1, *e1), (t2, *e2) in zip(self.a.events, self.b.events):
            num = (t2 - t1) * (batch_size - b1)
            if num % d:
                return None
            total = t1 + num // d
            if total > best:
                best, best_at = total, (e1, e2)
        if best_at is None:
            return {"bytes": 0, "how": _HOW, "by_category": dict.fromkeys(CATEGORIES, 0), "saved_bytes": 0,
                    "phase": None}
        (c1, s1, phase), (c2, s2, _) = best_at
        cats = {}
        for name, x, y in list(zip(CATEGORIES, c1, c2)) + [("saved", s1, s2)]:
            num = (y - x) * (batch_size - b1)
            if num % d:
                return None
            cats[name] = x + num // d
        saved = cats.pop("saved")
        return {"bytes": int(best), "how": _HOW, "by_category": cats, "saved_bytes": saved, "phase": phase}


_HOW = "fake-tensor storage tracker (exact bytes)"  # measure_step_peak's words for a fake step


def _peak_dict(total: int, by_category: dict, tracker: StorageTracker, saved: int = 0,
               phase: str | None = None) -> dict:
    out = {"bytes": int(total), "how": _HOW, "by_category": {k: int(v) for k, v in by_category.items()},
           "saved_bytes": int(saved), "phase": phase}
    if tracker.host_peak:
        out["host"] = {"bytes": int(tracker.host_peak), "by_category": {"activations": int(tracker.host_peak)},
                       "at_device_peak": int(tracker.host_at_peak),
                       "how": "storages the offload method keeps in host memory"}
    return out

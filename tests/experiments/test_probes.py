"""experiments.probes: measurements wrap a step on an explicit schedule; measured steps are not timed; a failing
tracker is a note, not a failed run; a new probe needs no change to the loop."""
from __future__ import annotations

import contextlib

import pytest
import torch

from experiments.probes import (MemoryBudgetExceeded, PeakProbe, SavedBytesProbe, Schedule, StepResult, StepTimer,
                                run_step)


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 6)

    def step(forward) -> StepResult:
        with forward:
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return StepResult(loss=float(loss.detach()), samples=5, tokens=None)
    return model, opt, step


def test_schedule_times_only_unmeasured_steps():
    s = Schedule(saved_bytes_at=0, peak_at=1, time_from=0)
    assert [s.timed(i) for i in range(4)] == [False, False, True, True]
    s = Schedule(saved_bytes_at=None, peak_at=3, time_from=2)
    assert [s.timed(i) for i in range(5)] == [False, False, True, False, True]
    with pytest.raises(ValueError):
        Schedule(peak_at=-1)


def test_probes_fill_their_sections_on_their_steps():
    model, opt, step = tiny()
    schedule = Schedule(saved_bytes_at=0, peak_at=1, time_from=2)
    probes = [SavedBytesProbe(model, 0), PeakProbe(model, opt, 1), StepTimer("cpu", schedule)]
    losses = [run_step(i, step, probes).loss for i in range(5)]
    assert losses[0] > losses[-1]  # the wrapped steps train like plain ones
    out = {}
    for p in probes:
        p.report(out)
    # saved for backward by one forward, fp32: each linear's input (5×6, 5×8), GELU's input (5×8), square's (5×2)
    assert out["saved_bytes"]["total"] == 4 * (5 * 6 + 5 * 8 + 5 * 8 + 5 * 2)
    assert out["peak"]["device"]["bytes"] > 0 and out["notes"] == []
    assert out["step_time_s"]["n"] == 3 and out["throughput"]["samples_per_s"] > 0
    assert out["throughput"]["tokens_per_s"] is None


def test_the_same_steps_with_and_without_probes_train_identically():
    _, _, plain = tiny()
    a = [run_step(i, plain, []).loss for i in range(4)]
    model, opt, step = tiny()
    probes = [SavedBytesProbe(model, 0), PeakProbe(model, opt, 1), StepTimer("cpu", Schedule())]
    b = [run_step(i, step, probes).loss for i in range(4)]
    assert a == b


def test_a_failing_tracker_is_a_note_and_the_step_still_runs(monkeypatch):
    import lowmembp.measurement.peak

    def broken(model, optimizer, step, warmup=0, external=()):
        raise RuntimeError("tracker broke")
    monkeypatch.setattr(lowmembp.measurement.peak, "measure_step_peak", broken)
    model, opt, step = tiny()
    probe = PeakProbe(model, opt, 0)
    before = [p.detach().clone() for p in model.parameters()]
    run_step(0, step, [probe])
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # it trained
    out = {}
    probe.report(out)
    assert "peak" not in out and "tracker broke" in out["notes"][0]


def test_a_peak_over_the_budget_raises_after_recording_it():
    model, opt, step = tiny()
    probe = PeakProbe(model, opt, 0, budget_bytes=10)
    with pytest.raises(MemoryBudgetExceeded, match="exceeds --max-memory-mb"):
        run_step(0, step, [probe])
    out = {}
    probe.report(out)
    assert out["peak"]["device"]["bytes"] > 10


def test_a_new_probe_plugs_in_without_touching_the_loop():
    class HostBytes:  # the shape an offloading method's host-memory probe takes
        def __init__(self):
            self.seen = []

        def wants(self, step):
            return step == 2

        def wrap(self, fn):
            def step(forward):
                out = fn(forward)
                self.seen.append(out.samples)
                return out
            return step

        def report(self, sections):
            sections.setdefault("peak", {})["host"] = {"bytes": 123, "how": "test", "by_category": {}}

    model, opt, step = tiny()
    probe = HostBytes()
    for i in range(4):
        run_step(i, step, [probe])
    out = {}
    probe.report(out)
    assert probe.seen == [5] and out["peak"]["host"]["bytes"] == 123


def test_probes_nest_outermost_first():
    calls = []

    class Mark:
        def __init__(self, name):
            self.name = name

        def wants(self, step):
            return True

        def wrap(self, fn):
            def step(forward):
                calls.append(f"{self.name}>")
                out = fn(forward)
                calls.append(f"<{self.name}")
                return out
            return step

    run_step(0, lambda forward: StepResult(0.0, 1, None), [Mark("a"), Mark("b")])
    assert calls == ["a>", "b>", "<b", "<a"]
    assert isinstance(contextlib.nullcontext(), contextlib.AbstractContextManager)

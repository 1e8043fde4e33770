"""Step-time statistics (lowmembp.measurement.timing): percentiles from given samples, no timed asserts."""
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from lowmembp.measurement import timing
from lowmembp.measurement.timing import summarize, throughput, time_interleaved, time_steps


def test_summarize_percentiles_linear_interpolation():
    rng = np.random.default_rng(7)
    samples = rng.exponential(0.3, size=13).tolist()
    s = summarize(samples, "x")
    srt = sorted(samples)
    # numpy's linear method: position q*(n-1) between order statistics
    for q, key in ((0.2, "p20"), (0.5, "p50"), (0.8, "p80")):
        pos = q * (len(srt) - 1)
        lo, frac = int(pos), pos - int(pos)
        want = srt[lo] + frac * (srt[min(lo + 1, len(srt) - 1)] - srt[lo])
        assert s[key] == pytest.approx(want, rel=1e-12)
    assert s["n"] == 13 and s["how"] == "x"
    assert s["p20"] <= s["p50"] <= s["p80"]


def test_summarize_single_and_constant():
    assert summarize([0.25]) == {"p20": 0.25, "p50": 0.25, "p80": 0.25, "n": 1, "how": ""}
    s = summarize([2.0] * 5)
    assert s["p20"] == s["p80"] == 2.0


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [-0.1, 1.0]])
def test_summarize_rejects_bad_samples(bad):
    with pytest.raises(ValueError):
        summarize(bad)


def test_time_steps_runs_warmup_and_repeats():
    calls = []
    s = time_steps(lambda: calls.append(1), warmup=3, repeats=7)
    assert len(calls) == 10 and s["n"] == 7 and s["how"] == "cpu perf_counter"
    with pytest.raises(ValueError):
        time_steps(lambda: None, repeats=0)


def test_throughput():
    t = throughput({"p50": 0.5}, batch_size=8, tokens_per_sample=197)
    assert t == {"samples_per_s": 16.0, "tokens_per_s": 16.0 * 197}
    assert throughput({"p50": 2.0}, 4)["tokens_per_s"] is None


def test_time_interleaved_takes_turns_rotates_and_skips_warmup():
    calls = []

    def step(name):
        return lambda r: calls.append((name, r))

    times = time_interleaved({"a": step("a"), "b": step("b"), "c": step("c")}, rounds=3, warmup=2, rotate=True)
    assert [len(t) for t in times.values()] == [3, 3, 3] and all(x >= 0 for t in times.values() for x in t)
    # one step of each per round, each round starting one name later; warm-up rounds run but are not timed
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2),
                     ("a", 3), ("b", 3), ("c", 3), ("b", 4), ("c", 4), ("a", 4)]
    calls.clear()
    time_interleaved({"a": step("a"), "b": step("b")}, rounds=2)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]


@pytest.mark.parametrize("kw", [dict(rounds=0), dict(rounds=2, warmup=-1)])
def test_time_interleaved_rejects_bad_counts(kw):
    with pytest.raises(ValueError, match="time_interleaved"):
        time_interleaved({"a": lambda r: None}, **kw)
    with pytest.raises(ValueError, match="no steps"):
        time_interleaved({}, rounds=1)


_ROUNDS, _PAGES = 10, 3 * 6_000_000 * 4 // 4096  # measured churns; pages of one churn's three tensors
_CHURN = f"""
ROUNDS = {_ROUNDS}
import ctypes, resource, sys, torch
from lowmembp.measurement.timing import hold_freed_memory
# first glibc's behaviour whenever its adaptive threshold is below the tensors' size: every one mapped fresh
mallopt = ctypes.CDLL(None).mallopt
assert mallopt(-3, 128 * 1024) and mallopt(-1, 128 * 1024)
held = hold_freed_memory() if sys.argv[1] == "hold" else False  # must override that

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def churn():  # three 24 MB tensors (about 5900 pages each), filled and freed
    a = torch.empty(6_000_000).fill_(1.0)
    b = torch.empty(6_000_000).fill_(1.0)
    c = torch.empty(6_000_000).fill_(1.0)
    del a, b, c

for _ in range(3):
    churn()
f0 = faults()
for _ in range(ROUNDS):
    churn()
print(int(held), faults() - f0)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_hold_freed_memory_stops_the_page_faults_of_fresh_tensors():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "GLIBC_TUNABLES": ""})
        held, faults = map(int, out.stdout.split())
        return held, faults

    held, hold_faults = run("hold")
    assert held == 1
    held, fresh_faults = run("fresh")
    assert held == 0 and fresh_faults > 0.9 * _ROUNDS * _PAGES  # each fresh 24 MB tensor faults its ~5860 pages in
    # held: the freed heap memory is reused. Not always zero: a run on this machine now and then faults one churn's
    # tensors in again (one tensor in 40 runs here, all three once in CI; cause not found), so the bound allows
    # a quarter of the fresh faults (two and a half churns' worth, against all ten).
    assert hold_faults < 0.25 * fresh_faults, (hold_faults, fresh_faults)


def test_hold_freed_memory_is_a_no_op_without_glibc(monkeypatch):
    monkeypatch.setattr(timing.platform, "libc_ver", lambda: ("", ""))
    assert timing.hold_freed_memory() is False


# --- the one timing protocol: the median with its interval, ratios paired by round ----------------------------------
def test_median_interval_is_the_order_statistics_of_95_percent_coverage():
    from math import comb

    from lowmembp.measurement.timing import median_interval

    xs = [float(i) for i in range(20, 0, -1)]  # 20 samples, given out of order
    m = median_interval(xs)
    # Binomial(20, 1/2): P(B <= 5) = 0.0207 -> x(6), x(15) cover 95.9 %; x(7), x(14) would cover only 88.5 %
    assert (m["low"], m["high"], m["median"], m["n"]) == (6.0, 15.0, 10.5, 20)
    assert m["coverage"] == pytest.approx(1 - 2 * sum(comb(20, i) for i in range(6)) / 2 ** 20)
    assert m["coverage"] >= 0.95
    few = median_interval([3.0, 1.0, 2.0])  # below 6 samples no pair reaches 95 %: the range, its coverage said
    assert (few["low"], few["high"], few["median"]) == (1.0, 3.0, 2.0) and few["coverage"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="no samples"):
        median_interval([])


def test_ratio_interval_pairs_rounds_so_a_shared_drift_cancels():
    from lowmembp.measurement.timing import median_interval, ratio_interval

    drift = [1.0 + 0.5 * i for i in range(12)]  # the machine slows down over the run, for both rows alike
    a = [1.2 * d for d in drift]
    b = list(drift)
    r = ratio_interval(a, b)
    assert r["median"] == pytest.approx(1.2) and r["low"] == pytest.approx(1.2) and r["high"] == pytest.approx(1.2)
    unpaired = median_interval(a)["median"] / median_interval(b)["median"]
    assert unpaired == pytest.approx(1.2)  # the medians' ratio agrees here, but their own intervals are wide:
    assert median_interval(a)["high"] / median_interval(a)["low"] > 2
    with pytest.raises(ValueError, match="equal"):
        ratio_interval([1.0], [1.0, 2.0])


def test_event_timer_on_the_cpu_keeps_only_the_blocks_asked_for():
    from lowmembp.measurement.timing import EventTimer

    t = EventTimer("cpu")
    with t.time(keep=False):
        pass
    with t.time():
        pass
    assert len(t.seconds()) == 1 and t.how == "cpu perf_counter"


@pytest.mark.gpu
def test_time_interleaved_on_cuda_uses_events():
    import torch

    x = torch.randn(1024, 1024, device="cuda")
    times = time_interleaved({"mm": lambda r: x @ x, "add": lambda r: x + x}, rounds=5, device="cuda")
    assert all(len(v) == 5 and all(t > 0 for t in v) for v in times.values())
    assert np.median(times["mm"]) > np.median(times["add"])

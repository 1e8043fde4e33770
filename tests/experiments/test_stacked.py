"""The stacked table (``python -m experiments.repro stacked``) and the Pareto figure (workflow/scripts/plots_pareto.py):
every row is an estimate (reproduced by a direct call), rows add one technique each, changes are against the row
before, GPU-only rows carry the method's refusal; the Pareto front is the non-dominated set; the figure is drawn."""
import importlib.util
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments.repro import REPROS, run
from experiments.repro._common import MiB
from experiments.repro.stacked import GPU_ONLY, STACKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vit_table():  # ViT-B/16 at full width, two blocks, batch 2: six estimates (~30 s on a shared 2-core machine)
    return run("stacked", small=True, models=("vit-b16",))


@pytest.mark.slow
def test_rows_are_estimates_and_add_one_technique_each(vit_table):
    from lowmembp.estimator.step import estimate

    assert "stacked" in REPROS
    df = vit_table
    stack = STACKS["vit-b16"][2]
    assert list(df["row"]) == [label for label, _ in stack]
    measured = df[df["peak_MiB"].notna()]
    specs = [spec for _, spec in stack]
    for prev, spec in zip(specs, specs[1:]):  # each measured row's methods contain the previous row's (LoRA-FA
        if set(spec.split("+")) & GPU_ONLY:   # replaces LoRA)
            continue
        assert set(prev.replace("lora-fa", "lora").split("+")) <= set(spec.replace("lora-fa", "lora").split("+"))
    # one row again, by a direct call: the same bytes
    row = measured.iloc[3]
    spec = row["method"].split(" (")[0]
    est = estimate("vit-b16", spec, batch_size=2, layers=2, rank=4, policy="save-attention")
    assert math.isclose(row["peak_MiB"], est["peak"]["bytes"] / MiB)
    assert math.isclose(row["saved_for_backward_MiB"], est["saved"]["total"] / MiB)
    # the change columns are against the previous measured row
    peaks = measured["peak_MiB"].tolist()
    changes = measured["peak_change_MiB"].tolist()[1:]
    assert all(math.isclose(c, b - a, abs_tol=1e-9) for a, b, c in zip(peaks, peaks[1:], changes))
    # what each promises: LoRA-FA, LowMemoryBP and SAC cut the saved bytes; offloading moves them all to the host
    assert (measured["saved_change_%"].iloc[1:4] < 0).all()
    off = measured[measured["row"] == "+ activation offloading"].iloc[0]
    assert off["saved_change_%"] == 0 and math.isclose(off["host_MiB"], off["saved_for_backward_MiB"], rel_tol=1e-3)
    assert off["peak_change_MiB"] < 0


@pytest.mark.slow
def test_gpu_only_rows_carry_the_refusal(vit_table):
    liger = vit_table[vit_table["method"].str.contains("liger")].iloc[0]
    assert pd.isna(liger["peak_MiB"]) and "liger:" in liger["note"]


def _pareto_module():
    spec = importlib.util.spec_from_file_location("plots_pareto", ROOT / "workflow/scripts/plots_pareto.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pareto_front_and_figure(tmp_path):
    mod = _pareto_module()
    rows = []
    for method, peak, time, host in [("a", 10, 1.0, None), ("b", 5, 2.0, None), ("c", 12, 3.0, None),
                                      ("d", 5, 2.5, None), ("e", 2, 4.0, 8.0)]:
        rows.append(dict(task="t", model="m", method=method, batch_size=8, seed=0, status="ok",
                         peak_bytes=peak * MiB, step_time_p50=time, host_peak_bytes=host and host * MiB))
    rows.append(dict(task="t", model="m", method="a", batch_size=32, seed=0, status="ok", peak_bytes=1,
                     step_time_p50=1.0, host_peak_bytes=None))  # another batch size: not in the same run
    rows.append(dict(task="t", model="m", method="f", batch_size=8, seed=0, status="oom", peak_bytes=None,
                     step_time_p50=None, host_peak_bytes=None))
    runs = pd.DataFrame(rows)
    pts = mod.points(runs)
    assert set(pts["method"]) == {"a", "b", "c", "d", "e"} and set(pts["batch_size"]) == {8}
    assert list(mod.pareto_front(pts)["method"]) == ["a", "b", "e"]  # c and d are beaten on both
    csv = tmp_path / "runs.csv"
    runs.to_csv(csv, index=False)
    mod.main(csv, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 10_000

"""The ``compiled-budget`` reproduction (experiments.repro.compiled_budget): each compiled row's bytes are the
partitioner's per-tensor count at that budget and equal the accountant's count of the very model that was timed
(so no timed step ran a graph partitioned at another budget); eager rows equal the accountant on a fresh model;
savings and time ratios follow from the rows; the figure draws one line per method. The whole table
(3 families x 3 methods x 3 budgets) is config/repro.yaml's, not run here."""
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

import lowmembp  # noqa: E402
from lowmembp.measurement.saved import saved_bytes  # noqa: E402
from experiments.repro.compiled_budget import compiled_budget  # noqa: E402
from experiments.repro.compiled_saving import build  # noqa: E402

pytestmark = pytest.mark.slow  # the full suite only: compiled steps

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))  # plots_repro
sys.path.insert(0, str(ROOT / "workflow"))  # its catalogue


@pytest.mark.slow
def test_budget_rows_are_the_partitioners_and_the_timed_models_counts():
    """BERT, 1 block, L = 16, budgets 1 and 0.1 (4 compilations, ~20 s on one idle core)."""
    df = compiled_budget(small=True, families=("bert",), methods=("baseline", "lowmembp"), steps=1)
    assert list(zip(df["method"], df["mode"], df["memory_budget"].fillna(-1))) == [
        ("baseline", "eager", -1), ("lowmembp", "eager", -1), ("baseline", "compiled", 1.0),
        ("baseline", "compiled", 0.1), ("lowmembp", "compiled", 1.0), ("lowmembp", "compiled", 0.1)]
    for method in ("baseline", "lowmembp"):  # eager: the accountant on a freshly converted model
        model, forward = build("bert", 16, depth=1)
        model = lowmembp.apply(model, method) if method != "baseline" else model
        row = df[(df["method"] == method) & (df["mode"] == "eager")].iloc[0]
        assert row["saved_KiB"] * 1024 == saved_bytes(model, lambda: forward(model))["total"]
    # compiled: the partitioner's sum == the accountant's count of the timed model, after its steps
    assert (df["saved_KiB"] == df["timed_KiB"]).all()
    base = df[(df["method"] == "baseline") & (df["mode"] == "eager")].iloc[0]
    for _, r in df.iterrows():
        assert math.isclose(r["saving_%"], 100 * (1 - r["saved_KiB"] / base["saved_KiB"]), abs_tol=1e-9)
        assert math.isclose(r["step_vs_eager"], r["step_ms"] / r["baseline_step_ms"], rel_tol=1e-9)
        assert r["step_ms"] > 0 and r["baseline_step_ms"] > 0
    c = df[df["mode"] == "compiled"].set_index(["method", "memory_budget"])["saved_KiB"]
    # the budget is in force: 0.1 keeps ~a tenth of the way from the graph's inputs to the budget-1 cut
    assert c["baseline", 0.1] < 0.25 * c["baseline", 1.0] and c["lowmembp", 0.1] < 0.25 * c["lowmembp", 1.0]
    assert c["lowmembp", 1.0] < c["baseline", 1.0]  # BERT keeps lowmembp's saving at budget 1 (compiled-saving)
    note = df[(df["method"] == "baseline") & (df["memory_budget"] == 0.1)]["note"].iloc[0]
    assert note.startswith("at or below eager lowmembp's")  # 0.1 saves less than eager lowmembp does


def test_bad_budget_is_a_clear_error():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        compiled_budget(budgets=(1.5,), families=("bert",))


def test_figure_reads_alone_on_synthetic_rows():
    """Two rows of panels per family (KiB, step-time ratio), one line per method over the budgets, eager dashed."""
    import plots_repro

    rows = []
    for f in ("bert", "llama"):
        for m, e, scale in (("baseline", 100.0, 1.0), ("lowmembp", 70.0, 0.7)):
            rows.append({"family": f, "method": m, "mode": "eager", "memory_budget": None, "saved_KiB": e,
                         "step_vs_eager": 1.0 if m == "baseline" else 1.2})
            rows += [{"family": f, "method": m, "mode": "compiled", "memory_budget": b, "saved_KiB": 90 * scale * b,
                      "step_vs_eager": 2 - b} for b in (0.1, 0.5, 1.0)]
    fig = plots_repro.figure("compiled_budget", pd.DataFrame(rows))
    assert len(fig.axes) == 4
    top, bottom = fig.axes[0], fig.axes[2]
    assert "KiB" in top.get_ylabel() and "eager baseline" in bottom.get_ylabel()
    assert bottom.get_xlabel() == "activation_memory_budget" and "fp32, CPU" in top.get_title()
    solid = [ln for ln in top.get_lines() if ln.get_linestyle() == "-"]
    dashed = [ln for ln in top.get_lines() if ln.get_linestyle() == "--"]
    assert [list(ln.get_xdata()) for ln in solid] == [[0.1, 0.5, 1.0]] * 2
    assert sorted(round(ln.get_ydata()[0], 6) for ln in dashed) == [70.0, 100.0]
    assert [t.get_text() for t in top.get_legend().get_texts()] == [
        "baseline, compiled", "baseline, eager", "lowmembp, compiled", "lowmembp, eager"]

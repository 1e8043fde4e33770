"""The ``compiled-saving`` reproduction (experiments.repro.compiled_saving): its eager and compiled figures equal
independent measurements (the accountant on a fresh eager model, the partitioner's own saved values for the compiled
one); the savings and the kept share follow from them; the figure draws them. The whole table (every method x
family, 21 compilations, 2 CPU-min) is not run here, to keep the suite short: config/repro.yaml makes it."""
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402

import lowmembp  # noqa: E402
from lowmembp.measurement.saved import saved_bytes  # noqa: E402
from experiments.repro.compiled_saving import build, compiled_saving  # noqa: E402
from experiments.repro.partitioner_saved import partitioner_saved  # noqa: E402

pytestmark = pytest.mark.slow  # the full suite only: compiled steps

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))  # plots_repro
sys.path.insert(0, str(ROOT / "workflow"))  # its catalogue


def _check_arithmetic(df):
    base = df[df["method"] == "baseline"].set_index("family")
    for _, r in df.iterrows():
        b = base.loc[r["family"]]
        se = 100 * (1 - r["eager_KiB"] / b["eager_KiB"])
        sc = 100 * (1 - r["compiled_KiB"] / b["compiled_KiB"])
        assert math.isclose(r["eager_saving_%"], se, abs_tol=1e-9)
        assert math.isclose(r["compiled_saving_%"], sc, abs_tol=1e-9)
        if r["method"] == "baseline":
            assert se == 0 and sc == 0 and math.isnan(r["kept_%"])
        else:
            assert math.isclose(r["kept_%"], 100 * sc / se, rel_tol=1e-9)


@pytest.mark.slow
def test_figures_equal_independent_measurements():
    """BERT, 1 block, L = 16 (3 compilations, ~20 s on one core): the eager figures are the accountant on a freshly
    converted model; lowmembp's compiled figure is the sum of what the min-cut partitioner saves (read off the
    backward graph), parameters left out."""
    df = compiled_saving(small=True, methods=("baseline", "lowmembp"), families=("bert",))
    assert list(df["method"]) == ["baseline", "lowmembp"] and set(df["family"]) == {"bert"}
    _check_arithmetic(df)
    for method in ("baseline", "lowmembp"):
        model, forward = build("bert", 16, depth=1)
        model = lowmembp.apply(model, method) if method != "baseline" else model
        row = df[df["method"] == method].iloc[0]
        assert row["eager_KiB"] * 1024 == saved_bytes(model, lambda: forward(model))["total"]
    torch._dynamo.reset()
    model, forward = build("bert", 16, depth=1)
    model = lowmembp.apply(model, "lowmembp")
    compiled = sum(r["bytes"] for r in partitioner_saved(model, lambda: forward(model)))
    assert df[df["method"] == "lowmembp"].iloc[0]["compiled_KiB"] * 1024 == compiled
    low = df[df["method"] == "lowmembp"].iloc[0]
    assert low["eager_saving_%"] > 20 and low["kept_%"] >= 90  # BERT keeps the saving (README)


def test_figure_reads_alone_on_synthetic_rows():
    """Grouped bars, eager beside compiled, per family; units on the axis; the kept share written on top."""
    import pandas as pd
    import plots_repro

    rows = [{"family": f, "method": m, "eager_KiB": e, "compiled_KiB": c, "eager_saving_%": se,
             "compiled_saving_%": sc, "kept_%": None if m == "baseline" else 100 * sc / se, "note": ""}
            for f in ("vit", "llama")
            for m, e, c, se, sc in (("baseline", 100.0, 80.0, 0.0, 0.0), ("lowmembp", 60.0, 70.0, 40.0, 12.5))]
    fig = plots_repro.figure("compiled_saving", pd.DataFrame(rows))
    assert len(fig.axes) == 2
    ax = fig.axes[0]
    assert "(%)" in ax.get_ylabel() and "fp32, CPU" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["eager", "torch.compile"]
    assert {t.get_text() for a in fig.axes for t in a.texts} == {"kept\n31 %"}
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == [12.5, 40.0]  # one eager bar, one compiled bar: the baseline is not drawn


def test_the_partitioner_command_fails_when_its_block_filter_matches_nothing(capsys):
    """``--block`` naming no block of the model: exit 1 naming the blocks there are (not an empty table and 0 bytes);
    an unknown method or a budget out of [0, 1]: a usage error before anything is built."""
    from experiments.repro.partitioner_saved import main

    assert main(["--family", "llama", "--method", "baseline", "--seq-len", "16", "--block", "1"]) == 0
    out = capsys.readouterr().out
    assert "| model.layers.1." in out and "| model.layers.0." not in out
    assert main(["--family", "llama", "--method", "baseline", "--seq-len", "16", "--block", "7"]) == 1
    assert "no saved tensor belongs to block 7; the model's blocks: 0, 1" in capsys.readouterr().err
    for argv, needle in ((["--method", "lowmembpp"], "unknown method 'lowmembpp'"),
                         (["--memory-budget", "1.5"], "--memory-budget must be in [0, 1], got 1.5")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and needle in capsys.readouterr().err

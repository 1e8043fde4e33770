"""The figures read alone (issue #19): titles name the device, dtype and seeds; axes carry units; legends are words,
not column names; ratios say what over what; accuracy is in % on an axis from 0. Checked on the figures' text (the
scripts return matplotlib Figures), on the reference set kept in git and on small synthetic rows."""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "results" / "reference"
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
sys.path.insert(0, str(ROOT / "workflow"))

import paper_claims  # noqa: E402
import plots  # noqa: E402
import plots_repro  # noqa: E402
import table_maths  # noqa: E402

COLUMN_NAMES = ("paper_MiB", "ours_MiB", "paper_MB", "_ratio_ours", "peak_bytes", "metric_value", "1 seeds")


def texts(fig: plt.Figure) -> str:
    """Every piece of text of a figure: suptitle, titles, axis labels, tick labels, legends, annotations."""
    out = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
        out += [t.get_text() for t in ax.texts]
        if ax.get_legend():
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    for leg in fig.legends:
        out += [t.get_text() for t in leg.get_texts()]
    return "\n".join(out)


@pytest.fixture(scope="module")
def runs():
    return table_maths.read_runs(REFERENCE / "runs.csv")[0]


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _no_column_names(text: str):
    bad = [c for c in COLUMN_NAMES if c in text]
    assert not bad, f"column names / bad plurals in the figure: {bad}"


def test_memory_vs_batch_names_device_dtype_units_and_memory_cells(runs):
    fig = plots.memory_vs_batch(runs)
    t = texts(fig)
    assert "cpu" in t and "fp32" in t
    assert "(MiB)" in t and "batch size" in t
    assert "hollow" in t and "5 steps" in t and "training cell" in t  # which cells are the 5-step memory cells
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)
    _no_column_names(t)


def test_step_time_ratio_says_what_over_what_and_the_spread(runs):
    fig = plots.step_time_ratio(runs)
    t = texts(fig)
    assert "method / compared method" in t and "p20" in t and "cpu" in t
    assert "paper's ratio" not in t  # the reference set runs CPU stand-ins: no paper value belongs beside them
    assert "(vs baseline)" in t and "(vs lora)" in t
    assert fig.axes[0].get_ylim()[0] == 0
    _no_column_names(t)
    # the same rows as a paper model's, LoRA on q and v (Fig. 1's setting): the paper's ratio is drawn beside them
    paper = runs[runs["task"] == "mnist5k"].assign(task="cifar100", model="vit-b16")
    paper["opt_targets"] = ["qkv" if m.startswith("lora") else None for m in paper["method"]]
    assert "paper's ratio" in texts(plots.step_time_ratio(paper))


def test_accuracy_in_percent_from_zero_with_seeds_and_markers_explained(runs):
    fig = plots.accuracy(runs)
    t = texts(fig)
    assert "accuracy (%)" in t and "perplexity" in t
    assert "2 seeds" in t and "1 seed" in t and "1 seeds" not in t
    assert "one seed" in t and "mean" in t  # dots and squares say what they are
    acc_axes = [ax for ax in fig.axes if "accuracy (%)" in ax.get_ylabel()]
    assert acc_axes and all(ax.get_ylim() == (0.0, 100.0) for ax in acc_axes)
    mnist = next(ax for ax in fig.axes if "mnist5k" in ax.get_title())
    ys = [y for coll in mnist.collections for _, y in coll.get_offsets()]
    assert 50 < max(ys) <= 100  # in %, not a fraction
    assert "200 steps" in mnist.get_title()  # the trained cells, not the 5-step ones
    _no_column_names(t)


def test_headline_figure_ours_beside_paper(runs):
    table = table_maths.headline_table(runs, paper_claims.load_claims())
    fig = plots.headline_figure(runs, table)
    t = texts(fig)
    assert "peak memory saved (%)" in t and "step time change (%" in t and "points of %" in t
    assert "paper" in t and "ours" in t and "cpu" in t and "fp32" in t
    assert "lowmembp (vs baseline)" in t and "lora+lowmembp (vs lora)" in t
    _no_column_names(t)


def test_seeds_text():
    assert plots.seeds_text(1) == "1 seed" and plots.seeds_text(2) == "2 seeds"


@pytest.mark.parametrize("stem", ["fig1", "mesa_table", "block_breakdown", "tokentune_memory"])
def test_repro_figures_say_units_and_ours_over_paper(stem):
    name = stem.replace("_", "-")
    fig = plots_repro.figure(stem, pd.read_csv(REFERENCE / "repro" / f"{name}.csv"))
    t = texts(fig)
    _no_column_names(t)
    if stem in ("fig1", "mesa_table"):
        assert "ours / paper" in t and "paper, as published" in t and "fake tensors" in t
        assert "(MiB)" in t
    if stem == "block_breakdown":
        assert "b·s·d" in t and "saves" in t and "Hadamard product" in t  # every op kind in the legend (LLaMA's too)
    if stem == "tokentune_memory":
        assert "(MiB)" in t and "batch size" in t


def test_fig1_figure_draws_the_official_code_emulated_beside_ours():
    """fig1 rows with official_code_MiB (experiments.repro.fig1): a third bar set, its ratio to the paper on top."""
    df = pd.DataFrame({"setting": ["lora_qv", "lora_qv"], "method": ["LoRA", "LoRA + MS-LN"], "spec": ["a", "b"],
                       "paper_MiB": [100.0, 80.0], "ours_MiB": [90.0, 60.0], "official_code_MiB": [99.0, 78.0],
                       "ratio": [0.9, 0.75], "note": ["", ""]})
    fig = plots_repro.figure("fig1", df)
    t = texts(fig)
    _no_column_names(t)
    assert "official code's choices emulated" in t and "official / paper 0.99" in t and "ours / paper 0.75" in t
    assert len(fig.axes[0].patches) == 6
    two = plots_repro.figure("fig1", df.drop(columns="official_code_MiB"))
    assert len(two.axes[0].patches) == 4 and "official" not in texts(two)


def test_synthetic_one_seed_cells_and_failed_cell_are_drawn():
    """A sweep with one batch size and one seed: no 'hollow' memory cells, '1 seed', a failed cell marked."""
    rows = []
    for method, peak, t in [("baseline", 100, 1.0), ("lowmembp", 70, 1.02), ("checkpointing", 50, 1.3)]:
        rows.append(dict(task="t", model="vit-mnist", method=method, batch_size=8, seed=0, status="ok", steps=50,
                         peak_bytes=peak * 2**20, activation_bytes=peak * 2**19, step_time_p20=t * 0.95,
                         step_time_p50=t, step_time_p80=t * 1.05, samples_per_s=8 / t, metric_name="accuracy",
                         metric_value=0.5, device="cpu (test)", dtype="fp32"))
    rows.append(dict(rows[0], method="mesa", status="oom", peak_bytes=None, metric_value=None))
    runs = pd.DataFrame(rows)
    t = texts(plots.memory_vs_batch(runs))
    assert "hollow" not in t and "ran out of memory / failed" in t and "cpu (test), fp32" in t
    t = texts(plots.accuracy(runs))
    assert "1 seed" in t and "1 seeds" not in t and "no error bar" in t


def test_stacked_figure_names_rows_units_and_categories():
    cats = dict(weights_GiB=12.6, gradients_GiB=0.0, optimizer_GiB=25.1, activations_GiB=4.0, temporaries_GiB=2.0)
    df = pd.DataFrame([dict(lever="full fine-tuning, AdamW", **cats, peak_GiB=43.7, host_GiB=0.0),
                       {"lever": "+ activation offloading", **cats, "peak_GiB": 40.0, "change_%": -8.5,
                        "host_GiB": 0.3}])
    t = texts(plots_repro.figure("stacked", df))
    assert "(GiB" in t and "+ activation offloading" in t and "40.0 GiB (-8 %)" in t
    assert "optimizer" in t and "host memory (offloading" in t


def test_headline_figure_when_no_seed_of_a_compared_method_finished(runs):
    """Every cell of the one compared method failed (the fault-injection pipeline test kills one): the headline
    figure is still drawn, saying no seed finished, instead of crashing on int(NaN) (seen in CI)."""
    sub = runs[(runs["task"] == "mnist5k") & runs["method"].isin(["baseline", "lowmembp"])].copy()
    failed = sub["method"] == "lowmembp"
    sub.loc[failed, "status"] = "error"
    for col in ("metric_value", "final_loss", "peak_bytes", "activation_bytes", "step_time_p50_s"):
        if col in sub:
            sub.loc[failed, col] = float("nan")
    table = table_maths.headline_table(sub, paper_claims.load_claims())
    t = texts(plots.headline_figure(sub, table))
    assert "no seed finished" in t


def test_pareto_draws_the_new_peers_and_names_a_refused_one():
    """The Pareto figure draws every finished method (the peers velora and tiled-mlp among them), names a method
    whose cells did not finish (cce refused on a CPU) under its panel with the status, says on the x axis that a
    CPU step time names the ops the records ran, and names the machine in its title."""
    import plots_pareto

    rows = []
    for i, (m, peak, t) in enumerate([("baseline", 10, 1.0), ("velora", 7, 1.2), ("tiled-mlp", 8, 1.5),
                                      ("lora", 8, 0.9)]):
        rows.append(dict(task="tweets-lm", model="llama-tiny", method=m, batch_size=8, seed=0, status="ok", steps=5,
                         peak_bytes=peak * 2**20, step_time_p50=t / 100, device="cpu (x86_64, 1 threads)",
                         dtype="fp32"))
    rows.append(dict(rows[0], method="cce", status="error", peak_bytes=float("nan"), step_time_p50=float("nan")))
    runs = pd.DataFrame(rows)
    pts = plots_pareto.points(runs)
    assert sorted(pts["method"]) == ["baseline", "lora", "tiled-mlp", "velora"]
    assert list(plots_pareto.pareto_front(pts)["method"]) == ["lora", "velora"]  # lora: fastest; velora: smallest
    t = texts(plots_pareto.pareto_figure(runs))
    assert "velora" in t and "tiled-mlp" in t
    assert "not drawn (no finished cell): cce (error)" in t
    assert "CPU step time p50 (ms), PyTorch reference ops" in t and "(MiB)" in t  # records without ops_backend
    assert plots_pareto.time_label(runs.assign(ops_backend="cpu")) == "CPU step time p50 (ms), CPU fast path"
    assert "cpu (x86_64, 1 threads)" in t
    _no_column_names(t)

"""runs.csv -> the sweep's figures (results/figures/*.png).

- memory_vs_batch: peak and activation memory (MiB) against batch size, one line per method, one row per task;
  cells that ran out of memory or failed are marked with a cross at the batch size where they failed.
- step_time_ratio: step time (p50) as a ratio to the reference run (lora+X against lora, others against baseline),
  median over batch sizes and seeds, with the paper's ratio as a black tick where it gives one.
- accuracy: the evaluation metric per method, every seed as a dot, mean and standard deviation as a bar.

The reproductions' figures are in plots_repro.py. Run by Snakemake (rule run_figure) or by hand:
``python plots.py RUNS.csv FIGURE_NAME OUT.png``.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

HERE = Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).resolve().parent  # noqa: F821
sys.path.insert(0, str(HERE))
from tables import (KEYS, MiB, claim, load_claims, per_cell, read_runs, reference_method,  # noqa: E402
                    with_reference)

METHOD_ORDER = ["baseline", "checkpointing", "mesa-gelu-ln", "mesa", "lowmembp", "tokentune", "lora",
                "lora+lowmembp"]


def _methods(df: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(df["method"]))
    return [m for m in METHOD_ORDER if m in present] + sorted(m for m in present if m not in METHOD_ORDER)


def _colors(methods):
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def _task_label(task, model):
    return f"{task} / {model}"


def memory_vs_batch(runs: pd.DataFrame, out: Path) -> None:
    tasks = runs[["task", "model"]].drop_duplicates().values.tolist()
    methods = _methods(runs)
    colors = _colors(methods)
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.2 * len(tasks)), squeeze=False)
    peak = per_cell(runs, "peak_bytes")
    act = per_cell(runs, "activation_bytes")
    for row, (task, model) in enumerate(tasks):
        for col, (df, what) in enumerate([(peak, "peak_bytes"), (act, "activation_bytes")]):
            ax = axes[row, col]
            sub = df[(df["task"] == task) & (df["model"] == model)]
            for m in methods:
                s = sub[sub["method"] == m].sort_values("batch_size")
                if s.empty:
                    continue
                ax.plot(s["batch_size"], s[what] / MiB, marker="o", color=colors[m], label=m)
                bad = s[s["status"] != "ok"]
                if len(bad):
                    top = np.nanmax(sub[what].to_numpy(dtype=float) / MiB) if sub[what].notna().any() else 1
                    ax.scatter(bad["batch_size"], [top] * len(bad), marker="x", color=colors[m], s=60)
            ax.set_xscale("log", base=2)
            bss = sorted(sub["batch_size"].unique())
            ax.set_xticks(bss, [str(b) for b in bss])
            ax.minorticks_off()
            ax.set_xlabel("batch size")
            ax.set_ylabel(("peak memory" if col == 0 else "activations saved for backward") + " (MiB)")
            ax.set_title(_task_label(task, model), fontsize=10)
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def step_time_ratio(runs: pd.DataFrame, out: Path) -> None:
    claims = load_claims()
    df = per_cell(runs, "step_time_p50", "median")
    df["ratio"] = with_reference(df, "step_time_p50")
    df = df[df["method"].map(reference_method).notna()]
    tasks = df[["task", "model"]].drop_duplicates().values.tolist()
    methods = _methods(df)
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(methods) * max(1, len(tasks)) / 2), 4))
    width = 0.8 / max(1, len(tasks))
    x = np.arange(len(methods))
    for i, (task, model) in enumerate(tasks):
        sub = df[(df["task"] == task) & (df["model"] == model)].groupby("method")["ratio"].median()
        ys = [sub.get(m, np.nan) for m in methods]
        ax.bar(x + (i - (len(tasks) - 1) / 2) * width, ys, width, label=_task_label(task, model))
        for j, m in enumerate(methods):
            p, _ = claim(claims, "step_time_ratio", m, model)
            if not np.isnan(p):
                ax.plot([x[j] + (i - (len(tasks) - 1) / 2) * width] * 1, [p], marker="_", color="k", ms=14,
                        mew=2, label="paper" if (i == 0 and j == methods.index(m) and "paper" not in
                                                 ax.get_legend_handles_labels()[1]) else None)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(x, [f"{m}\n(vs {reference_method(m)})" for m in methods], fontsize=8)
    ax.set_ylabel("step time / reference (p50)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def accuracy_batch_size(sub: pd.DataFrame) -> int:
    """The batch size whose cells carry the accuracy comparison: the most seeds, then the longest training
    (steps × batch size), so short memory/speed cells never stand in for trained ones."""
    per_bs = sub.assign(samples=sub["steps"] * sub["batch_size"]).groupby("batch_size").agg(
        seeds=("seed", "nunique"), samples=("samples", "max"))
    return int(per_bs.sort_values(["seeds", "samples"], ascending=False).index[0])


def accuracy(runs: pd.DataFrame, out: Path) -> None:
    ok = runs[runs["status"] == "ok"].dropna(subset=["metric_value"])
    tasks = runs[["task", "model"]].drop_duplicates().values.tolist()
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4.6 * max(1, len(tasks)), 4), squeeze=False)
    for i, (task, model) in enumerate(tasks):
        ax = axes[0, i]
        sub = ok[(ok["task"] == task) & (ok["model"] == model)]
        if sub.empty:
            ax.set_title(_task_label(task, model) + "\n(no finished runs)", fontsize=9)
            continue
        bs = accuracy_batch_size(sub)
        sub = sub[sub["batch_size"] == bs]
        methods = _methods(sub)
        for j, m in enumerate(methods):
            v = sub[sub["method"] == m]["metric_value"].to_numpy(dtype=float)
            ax.scatter(np.full(len(v), j) + np.linspace(-0.12, 0.12, len(v)), v, s=14, color="C0", zorder=3)
            ax.errorbar(j, v.mean(), yerr=v.std(ddof=1) if len(v) > 1 else 0, fmt="s", color="k", ms=5,
                        capsize=4, zorder=4)
        if "base_metric_before" in sub and sub["base_metric_before"].notna().any():
            before = pd.to_numeric(sub["base_metric_before"], errors="coerce").mean()
            ax.axhline(before, color="C3", ls="--", lw=1, label=f"base before fine-tuning ({before:.3g})")
            ax.legend(fontsize=7, loc="best")
        ax.set_xticks(range(len(methods)), methods, rotation=45, ha="right", fontsize=8)
        name = sub["metric_name"].dropna().iloc[0] if sub["metric_name"].notna().any() else "metric"
        ax.set_ylabel(f"{name} (lower is better)" if name == "perplexity" else name)
        ax.set_title(f"{_task_label(task, model)}\nbatch {bs}, {sub['seed'].nunique()} seeds", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


FIGURES = {"memory_vs_batch": memory_vs_batch, "step_time_ratio": step_time_ratio, "accuracy": accuracy}


def main(runs_csv, name, out, log=None):
    """Figure ``name`` of runs.csv to ``out``; rows of damaged records (status invalid) are left out and counted."""
    runs, invalid = read_runs(runs_csv)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    FIGURES[name](runs, Path(out))
    if log:
        Path(log).write_text(f"{name}: {len(runs)} rows, {len(invalid)} invalid left out"
                             + "".join(f"\n  {r}" for r in invalid.get("record", [])) + "\n")


if "snakemake" in globals():
    main(snakemake.input.runs, snakemake.wildcards.fig, snakemake.output[0], snakemake.log[0])  # noqa: F821
elif __name__ == "__main__":
    main(*sys.argv[1:4])

"""runs.csv -> results/figures/pareto.png: peak memory against step time, every method of one run, per task.

One panel per task / model. Each point is one method (or composition) at the batch size where the most methods were
measured together (the memory batch of the default sweep), mean over seeds: x the step time (p50, ms), y the peak
device memory of one steady step (MiB). The Pareto front — the methods no other method beats on both — is the step
line; a method off it is slower *and* bigger than one on it. Offloading methods also hold host memory: a hollow
marker above the point shows device + host bytes. Only ``ok`` cells with both numbers are drawn; a method whose
cells of that task did not finish (oom, error: e.g. a kernel refused on this device) is named under the panel with
its status (:func:`not_drawn`), so a missing point is never silent. On a CPU the x axis says what the time is: CPU
step time of the ops the records ran (the CPU fast path or the PyTorch reference: ``sweep_layouts.cpu_ops``), not a GPU
throughput.

Run by Snakemake (rule pareto_figure, workflow/rules/pareto.smk) or by hand: ``python plots_pareto.py RUNS.csv
OUT.png``.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from adjustText import adjust_text  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_layouts import cpu_ops  # noqa: E402
from table_maths import devices, on_cpu  # noqa: E402

MiB = 2 ** 20


def points(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, model, method) at each task's most-measured batch size: peak, host, step time (means)."""
    ok = runs[runs["status"] == "ok"].dropna(subset=["peak_bytes", "step_time_p50"]).copy()
    if "host_peak_bytes" not in ok:
        ok["host_peak_bytes"] = np.nan
    ok["host_peak_bytes"] = pd.to_numeric(ok["host_peak_bytes"], errors="coerce")
    out = []
    for (task, model), sub in ok.groupby(["task", "model"], sort=True):
        counts = sub.groupby("batch_size")["method"].nunique()
        bs = int(counts.sort_values(ascending=False, kind="stable").index[0])
        sub = sub[sub["batch_size"] == bs]
        agg = sub.groupby("method").agg(peak=("peak_bytes", "mean"), host=("host_peak_bytes", "mean"),
                                        time=("step_time_p50", "mean")).reset_index()
        agg["task"], agg["model"], agg["batch_size"] = task, model, bs
        out.append(agg)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(
        columns=["method", "peak", "host", "time", "task", "model", "batch_size"])


def not_drawn(runs: pd.DataFrame, drawn: pd.DataFrame) -> dict[tuple[str, str], list[str]]:
    """(task, model) -> "method (status)" for each method with cells at the panel's batch size (all of the task's
    cells where none finished) but no point drawn."""
    out = {}
    for (task, model), sub in runs.groupby(["task", "model"], sort=True):
        panel = drawn[(drawn["task"] == task) & (drawn["model"] == model)]
        if len(panel):
            sub = sub[sub["batch_size"] == panel["batch_size"].iloc[0]]
        missing = sub[~sub["method"].isin(set(panel["method"]))]
        out[(task, model)] = [f"{m} ({'/'.join(sorted(set(g['status'].astype(str))))})"
                              for m, g in missing.groupby("method", sort=True)]
    return out


def time_label(runs: pd.DataFrame) -> str:
    """The x axis: a CPU's step time says which ops ran (``sweep_layouts.cpu_ops``); a GPU's is named."""
    if on_cpu(runs):
        return f"CPU step time p50 (ms), {cpu_ops(runs)}"
    return f"step time p50 (ms) on {', '.join(devices(runs))}"


def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """The rows no other row beats on both step time and peak memory (ties kept), sorted by step time."""
    keep = []
    for i, r in df.iterrows():
        beaten = ((df["time"] <= r["time"]) & (df["peak"] <= r["peak"])
                  & ((df["time"] < r["time"]) | (df["peak"] < r["peak"]))).any()
        if not beaten:
            keep.append(i)
    return df.loc[keep].sort_values("time")


def pareto(runs: pd.DataFrame, out: Path) -> None:
    fig = pareto_figure(runs)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def pareto_figure(runs: pd.DataFrame) -> plt.Figure:
    """The figure: one panel per task / model (see the module's docstring)."""
    pts = points(runs)
    tasks = pts[["task", "model"]].drop_duplicates().values.tolist() or [["(no finished runs)", ""]]
    missing = not_drawn(runs, pts)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.4 * len(tasks), 4.6), squeeze=False)
    methods = sorted(pts["method"].unique()) if len(pts) else []
    cmap = plt.get_cmap("tab20")
    colors = {m: cmap(i % 20) for i, m in enumerate(methods)}
    for ax, (task, model) in zip(axes[0], tasks):
        sub = pts[(pts["task"] == task) & (pts["model"] == model)]
        if sub.empty:
            ax.set_title(f"{task} / {model}\n(no finished runs)", fontsize=9)
            continue
        front = pareto_front(sub)
        ax.step(front["time"] * 1e3, front["peak"] / MiB, where="post", color="0.6", lw=1, zorder=1,
                label="Pareto front")
        labels = []
        for _, r in sub.iterrows():
            on = r.name in front.index
            ax.scatter(r["time"] * 1e3, r["peak"] / MiB, s=46 if on else 26, color=colors[r["method"]],
                       edgecolor="k" if on else "none", zorder=3)
            labels.append(ax.text(r["time"] * 1e3, r["peak"] / MiB, r["method"], fontsize=6.5, zorder=4))
            if r["host"] == r["host"] and r["host"] > 0:  # not NaN: device + host of an offloading method
                total = (r["peak"] + r["host"]) / MiB
                ax.scatter(r["time"] * 1e3, total, s=30, facecolor="none", edgecolor=colors[r["method"]], zorder=2)
                ax.plot([r["time"] * 1e3] * 2, [r["peak"] / MiB, total], color=colors[r["method"]], lw=0.8,
                        ls=":", zorder=2)
        ax.set_xlabel(time_label(runs))
        if missing.get((task, model)):
            ax.text(0.0, -0.2, "not drawn (no finished cell): " + ", ".join(missing[(task, model)]),
                    transform=ax.transAxes, fontsize=6.5, va="top", wrap=True)
        ax.set_ylabel("peak device memory (MiB)")
        ax.set_title(f"{task} / {model}, batch {int(sub['batch_size'].iloc[0])}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.margins(x=0.18, y=0.12)  # room for the labels of the outermost points
        ax.set_ylim(0, ((sub["peak"] + sub["host"].fillna(0)) / MiB).max() * 1.12)  # from 0: a small saving looks small
        ax.legend(fontsize=7, loc="best")
        # labels moved apart (adjustText) once the axes are final, each tied to its point by a thin line
        adjust_text(labels, x=(sub["time"] * 1e3).tolist(), y=(sub["peak"] / MiB).tolist(), ax=ax,
                    arrowprops=dict(arrowstyle="-", color="0.5", lw=0.5), time_lim=5)
    devs = ", ".join(sorted(set(runs["device"].dropna().astype(str)))) if "device" in runs else ""
    dtypes = ", ".join(sorted(set(runs["dtype"].dropna().astype(str)))) if "dtype" in runs else ""
    steps = "/".join(str(int(v)) for v in sorted(set(runs.merge(pts[["task", "model", "batch_size"]].drop_duplicates())
                                                     ["steps"].dropna()))) if "steps" in runs and len(pts) else "?"
    fig.suptitle("Peak device memory against step time per method (mean over seeds; lower left is better); hollow "
                 f"marker: device + host (offloading)\n{devs or 'device unknown'}, {dtypes or 'dtype unknown'}; "
                 f"{steps}-step cells", fontsize=9)
    fig.tight_layout()
    return fig


def main(runs_csv, out, log=None):
    runs = pd.read_csv(runs_csv)
    pareto(runs, Path(out))
    if log:
        Path(log).write_text(f"pareto: {len(points(runs))} points from {runs_csv}\n")


if "snakemake" in globals():
    main(snakemake.input.runs, snakemake.output[0], snakemake.log[0])  # noqa: F821
elif __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    main(*by_hand.arguments("python plots_pareto.py RUNS.csv OUT.png", sys.argv[1:], 2))

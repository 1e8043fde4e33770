"""The convergence evidence's learning curves (results/figures/evidence_curves.png): per task, the test metric
against optimizer steps, one line per method (the mean over seeds, a band from the lowest to the highest seed), the
base's metric at step 0 where the runs fine-tune one. From the records' ``curve`` (``--eval-every``).

Run by Snakemake (rule evidence_figure) or by hand: ``python evidence_plots.py OUT.png RECORD.json ...``.
"""

import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
sys.path.insert(0, str(HERE))
import catalogue  # noqa: E402,F401  (the scripts folder's parent is put on the path by evidence_table)
from evidence_table import read_records  # noqa: E402
from plots import _colors, _methods, measured_on  # noqa: E402
from table_maths import PERCENT_METRICS  # noqa: E402


def curves_figure(runs: pd.DataFrame, curves: pd.DataFrame, label: str = "") -> plt.Figure:
    panels = curves[["task", "model", "batch_size", "metric_name"]].drop_duplicates().values.tolist()
    if not panels:
        raise ValueError("no learning curve in the records: the evidence sweeps need --eval-every in train_args")
    width = max(7.0, 5.2 * len(panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.6), squeeze=False)
    for ax, (task, model, bs, metric) in zip(axes[0], panels):
        cell = curves[(curves.task == task) & (curves.model == model) & (curves.batch_size == bs)]
        methods = _methods(cell)
        colors = _colors(methods)
        for method in methods:
            stats = cell[cell.method == method].groupby("step")["value"].agg(["mean", "min", "max", "count"])
            c = colors[method]
            ax.plot(stats.index, stats["mean"], color=c, lw=1.4, label=method)
            ax.fill_between(stats.index, stats["min"], stats["max"], color=c, alpha=0.12, lw=0)
        seeds = cell.groupby("method")["seed"].nunique()
        seed_text = str(seeds.min()) if seeds.min() == seeds.max() else f"{seeds.min()}–{seeds.max()}"
        ax.set_title(f"{task} / {model}, batch {bs}\n({seed_text} seeds per method)", fontsize=10)
        ax.set_xlabel("optimizer steps")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        unit = " (%)" if metric in PERCENT_METRICS else (" (per byte, lower is better)" if metric == "perplexity"
                                                        else "")
        ax.set_ylabel(f"test {metric}{unit}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    title = catalogue.EVIDENCE_FIGURE.title + (f" — {label}" if label else "")
    lines = textwrap.wrap(title, int(width * 13)) + [f"line: mean over seeds, band: lowest to highest seed; "
                                                      f"{measured_on(runs)}"]
    fig.suptitle("\n".join(lines), fontsize=10)
    fig.tight_layout()
    return fig


def main(records, out: str, label: str = "") -> None:
    from lowmembp.atomic import atomic_open

    runs, curves = read_records(records)
    fig = curves_figure(runs, curves, label)
    with atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


if "snakemake" in globals():
    sm = snakemake  # noqa: F821
    main(list(sm.input.records), sm.output[0], sm.params.label)
elif __name__ == "__main__":
    main(sys.argv[2:], sys.argv[1])

"""A paper-scale reproduction's rows (results/repro/<name>.csv) -> its figure (results/figures/<name>.png).

Every reproduction table pairs a published value with ours (columns ``paper...`` and ``ours...``); the figure shows
the two as bars side by side for each row, labelled by the row's text columns. The per-block breakdown is drawn as
stacked bars by op kind, one bar per (model, variant), when its rows carry an op kind column.

Run by Snakemake (rule repro_figure) or by hand: ``python plots_repro.py REPRO.csv OUT.png [TITLE]``.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


def text_columns(df: pd.DataFrame) -> list[str]:
    skip = {"note", "notes", "why", "source"}
    return [c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c]) and c not in skip]


def paper_ours(df: pd.DataFrame) -> tuple[str | None, str | None]:
    """The first pair of numeric columns named paper<suffix> / ours<suffix>."""
    for c in df.columns:
        if c.startswith("paper") and pd.api.types.is_numeric_dtype(df[c]):
            o = "ours" + c[len("paper"):]
            if o in df.columns:
                return c, o
    return None, None


def side_by_side(df: pd.DataFrame, out: Path, title: str) -> None:
    p, o = paper_ours(df)
    labels = [" / ".join(str(v) for v in row) for row in df[text_columns(df)].itertuples(index=False)]
    if o is None:
        raise SystemExit(f"{title}: no paper/ours column pair in {list(df.columns)}")
    x = np.arange(len(df))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(df) + 2), 4.2))
    ax.bar(x - 0.2, df[p], 0.4, label=f"paper ({p})", color="0.6")
    ax.bar(x + 0.2, df[o], 0.4, label=f"ours ({o})", color="C0")
    for xi, (pv, ov) in enumerate(zip(df[p], df[o])):
        if pd.notna(pv) and pd.notna(ov) and pv:
            ax.text(xi + 0.2, ov, f"{ov / pv:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(csv: str, out: str, title: str = "") -> None:
    df = pd.read_csv(csv)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    side_by_side(df, Path(out), title or Path(csv).stem)


if "snakemake" in globals():
    main(snakemake.input[0], snakemake.output[0], snakemake.wildcards.rfig.replace("_", " "))  # noqa: F821
elif __name__ == "__main__":
    main(*sys.argv[1:4])

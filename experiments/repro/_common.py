"""Shared helpers of the reproductions: MiB, ratio, a markdown table writer."""
from __future__ import annotations

import pandas as pd

MiB = 2 ** 20


def to_markdown(df: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A GitHub markdown table of ``df`` (no extra dependency)."""
    def cell(v):
        if v is None or (isinstance(v, float) and v != v):
            return ""
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v).replace("|", "\\|")
    cols = [str(c) for c in df.columns]
    rows = [[cell(v) for v in r] for r in df.itertuples(index=False)]
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ratio(ours: float | None, paper: float | None) -> float | None:
    if ours is None or paper in (None, 0):
        return None
    return ours / paper

"""Where the notebooks read results from.

The pipeline's own output (``results/runs.csv`` and ``results/tables/``, or the folder named by the environment
variable ``LOWMEMBP_RESULTS``) when it exists; otherwise the small reference set kept in git under
``results/reference/`` (made by the pipeline's default run on the machine named in its MACHINE.md), so the
notebooks open with data on a fresh clone.
"""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "results" / "reference"
MiB = 2**20


def results_dir() -> tuple[Path, str]:
    """(folder, label): the pipeline's results if present, else the reference set."""
    env = os.environ.get("LOWMEMBP_RESULTS")
    cand = Path(env) if env else ROOT / "results"
    if (cand / "runs.csv").exists() or (cand / "tables").is_dir():
        return cand, f"pipeline results in {cand}"
    if env:
        raise FileNotFoundError(f"LOWMEMBP_RESULTS={env} has no runs.csv or tables/; run `snakemake --cores all`")
    machine = (REFERENCE / "MACHINE.md").read_text().strip().splitlines()
    return REFERENCE, "reference set (results/reference): " + (machine[0].lstrip("# ") if machine else "")


def runs() -> pd.DataFrame:
    d, _ = results_dir()
    p = d / "runs.csv"
    if not p.exists():
        return pd.DataFrame(columns=["task", "model", "method", "batch_size", "seed", "status"])
    return pd.read_csv(p)


def table(name: str) -> pd.DataFrame | None:
    """A table the pipeline wrote (results/tables/<name>.csv), or None if this result set has none."""
    d, _ = results_dir()
    p = d / "tables" / f"{name}.csv"
    return pd.read_csv(p) if p.exists() else None


def reference_method(method: str) -> str | None:
    if method == "baseline":
        return None
    return "lora" if method.startswith("lora+") else "baseline"


def ratio_to_reference(df: pd.DataFrame, value: str) -> pd.Series:
    """df[value] divided by the same task/model/batch size's reference method (lora+X -> lora, else baseline)."""
    idx = df.set_index(["task", "model", "method", "batch_size"])[value]
    ref = [idx.get((t, m, reference_method(x), b), float("nan")) if reference_method(x) else float("nan")
           for t, m, x, b in zip(df["task"], df["model"], df["method"], df["batch_size"])]
    return df[value] / pd.Series(ref, index=df.index, dtype=float)

"""runs.csv (and the reproductions' CSVs) -> results/tables/<name>.md and .csv.

Every table puts the paper's value, ours, and the ratio ours/paper side by side. For the sweep's runs the paper's
values are ratios to a reference run (``lora+X`` against ``lora``, every other method against ``baseline``, same
task, model and batch size), taken from workflow/resources/paper_claims.yaml; for the reproductions they come with
the reproduction's own rows (lowmembp.repro).

Each table is written as Markdown, CSV and HTML (table_html.py) by the same call, atomically (``lowmembp.atomic``),
to the paths Snakemake gives (rule outputs); the titles come from workflow/catalogue.py. Rows of runs.csv with status
``invalid`` (a damaged record) are left out and counted in the table's note.

Run by Snakemake (rules run_tables, repro_table), or by hand:
``python tables.py runs RUNS.csv OUTDIR`` / ``python tables.py repro NAME REPRO.csv OUTDIR``.
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

HERE = Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).resolve().parent  # noqa: F821
for _p in (HERE, HERE.parent, HERE.parents[1]):  # scripts, the catalogue, the library
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import catalogue  # noqa: E402
from lowmembp.atomic import atomic_write  # noqa: E402
from table_html import page  # noqa: E402

CLAIMS = HERE.parent / "resources" / "paper_claims.yaml"
MiB = 2**20
KEYS = ["task", "model", "method", "batch_size"]


def reference_method(method: str) -> str | None:
    if method == "baseline":
        return None
    return "lora" if method.startswith("lora+") else "baseline"


def load_claims(path: Path = CLAIMS) -> dict:
    return yaml.safe_load(Path(path).read_text())


def claim(claims: dict, table: str, method: str, model: str) -> tuple[float, str]:
    fam = claims["families"].get(model)
    entry = claims.get(table, {}).get(method, {})
    if fam is None or fam not in entry:
        return np.nan, ""
    return float(entry[fam]), entry.get("source", "")


def _status(s: pd.Series) -> str:
    vals = sorted(set(s.dropna().astype(str)))
    return vals[0] if len(vals) == 1 else "/".join(vals)


def per_cell(runs: pd.DataFrame, value: str, how: str = "mean") -> pd.DataFrame:
    """One row per (task, model, method, batch size): the value over ok seeds, and the cell's status."""
    ok = runs[runs["status"] == "ok"]
    agg = ok.groupby(KEYS, dropna=False)[value].agg(how).rename(value)
    status = runs.groupby(KEYS, dropna=False)["status"].agg(_status)
    return pd.concat([status, agg], axis=1).reset_index()


def with_reference(df: pd.DataFrame, value: str) -> pd.Series:
    """value / value of the reference method in the same task, model and batch size."""
    idx = df.set_index(["task", "model", "method", "batch_size"])[value]
    ref = [idx.get((t, m, reference_method(x), b), np.nan) if reference_method(x) else np.nan
           for t, m, x, b in zip(df["task"], df["model"], df["method"], df["batch_size"])]
    return df[value] / np.asarray(ref, dtype=float)


def add_paper(df: pd.DataFrame, ours: str, table: str, claims: dict, prefix: str) -> pd.DataFrame:
    vals = [claim(claims, table, x, m) for x, m in zip(df["method"], df["model"])]
    df[f"{prefix}_paper"] = [v for v, _ in vals]
    df[f"{prefix}_ours"] = df[ours]
    df[f"{prefix}_ours/paper"] = df[f"{prefix}_ours"] / df[f"{prefix}_paper"]
    df[f"{prefix}_source"] = [s for _, s in vals]
    return df


def memory_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    peak = per_cell(runs, "peak_bytes")
    act = per_cell(runs, "activation_bytes")[KEYS + ["activation_bytes"]]
    df = peak.merge(act, on=KEYS, how="left")
    df["peak_MiB"] = df["peak_bytes"] / MiB
    df["activation_MiB"] = df["activation_bytes"] / MiB
    df["reference"] = df["method"].map(lambda x: reference_method(x) or "")
    df["peak_ratio"] = with_reference(df, "peak_bytes")
    df["act_ratio"] = with_reference(df, "activation_bytes")
    df = add_paper(df, "peak_ratio", "peak_ratio", claims, "peak")
    df = add_paper(df, "act_ratio", "activation_ratio", claims, "act")
    cols = KEYS + ["status", "reference", "peak_MiB", "peak_paper", "peak_ours", "peak_ours/paper",
                   "activation_MiB", "act_paper", "act_ours", "act_ours/paper", "peak_source", "act_source"]
    return df[cols]


def speed_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    df = per_cell(runs, "step_time_p50", "median")
    sps = per_cell(runs, "samples_per_s", "median")[KEYS + ["samples_per_s"]]
    df = df.merge(sps, on=KEYS, how="left")
    df["step_ms"] = df["step_time_p50"] * 1e3
    df["reference"] = df["method"].map(lambda x: reference_method(x) or "")
    df["time_ratio"] = with_reference(df, "step_time_p50")
    df = add_paper(df, "time_ratio", "step_time_ratio", claims, "time")
    cols = KEYS + ["status", "reference", "step_ms", "samples_per_s", "time_paper", "time_ours", "time_ours/paper",
                   "time_source"]
    return df[cols]


def accuracy_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    ok = runs[runs["status"] == "ok"]
    g = ok.groupby(KEYS, dropna=False)["metric_value"]
    df = pd.concat([g.mean().rename("metric_mean"), g.std(ddof=1).rename("metric_std"),
                    g.min().rename("metric_min"), g.max().rename("metric_max"), g.count().rename("seeds")],
                   axis=1).reset_index()
    names = ok.groupby(KEYS, dropna=False)["metric_name"].first().reset_index()
    # runs that start from a pre-trained base (--init) record the base's metric before fine-tuning
    before = ok["base_metric_before"] if "base_metric_before" in ok else pd.Series(np.nan, index=ok.index)
    before = pd.to_numeric(before, errors="coerce").groupby([ok[k] for k in KEYS], dropna=False).mean()
    names = names.merge(before.rename("metric_before").reset_index(), on=KEYS, how="left")
    status = runs.groupby(KEYS, dropna=False)["status"].agg(_status).reset_index()
    df = status.merge(df, on=KEYS, how="left").merge(names, on=KEYS, how="left")
    df["reference"] = df["method"].map(lambda x: reference_method(x) or "")
    df["metric_ratio"] = with_reference(df, "metric_mean")
    df = add_paper(df, "metric_ratio", "metric_ratio", claims, "metric")
    cols = KEYS + ["status", "reference", "metric_name", "seeds", "metric_before", "metric_mean", "metric_std",
                   "metric_min", "metric_max", "metric_paper", "metric_ours", "metric_ours/paper", "metric_source"]
    return df[cols]


RUN_TABLES = {"memory": memory_table, "speed": speed_table, "accuracy": accuracy_table}
TITLES = {name: catalogue.RUN_TABLE[name].title for name in RUN_TABLES}
INVALID = "invalid"


def read_runs(runs_csv: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """runs.csv -> (the rows to use, the rows of damaged records, status ``invalid``, left out)."""
    runs = pd.read_csv(runs_csv)
    bad = runs["status"].astype(str) == INVALID if "status" in runs else pd.Series(False, index=runs.index)
    return runs[~bad].reset_index(drop=True), runs[bad].reset_index(drop=True)


def invalid_note(invalid: pd.DataFrame) -> list[str]:
    if not len(invalid):
        return []
    return [f"Left out: {len(invalid)} damaged record(s) (status invalid in runs.csv; a rerun of the pipeline "
            f"remakes them): {', '.join(map(str, invalid['record'].head(5)))}{' ...' if len(invalid) > 5 else ''}"]


def _fmt(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = out[c].map(lambda v: "-" if pd.isna(v) else (f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"))
        else:
            out[c] = out[c].map(lambda v: "-" if v is None or (isinstance(v, float) and np.isnan(v)) else v)
    return out


def write(df: pd.DataFrame, md: Path, csv: Path, title: str, notes: list[str] = (), html: Path | None = None) -> None:
    """One table as CSV, Markdown and (given ``html``) HTML, each written atomically."""
    src_cols = [c for c in df.columns if c.endswith("source")]
    sources = sorted({s for c in src_cols for s in df[c].dropna().astype(str) if s})
    shown = _fmt(df.drop(columns=src_cols))
    atomic_write(csv, df.to_csv(index=False))
    body = shown.to_markdown(index=False) if len(df) else "(no rows)"
    lines = [f"# {title}", "", *notes, "", body, ""]
    if sources:
        lines += ["Notes and sources:", "", *[f"- {s}" for s in sources], ""]
    if html is not None:
        atomic_write(html, page(shown, title, [*notes, *sources]))
    atomic_write(md, "\n".join(lines))


def machine_note(runs: pd.DataFrame) -> list[str]:
    devs = sorted(set(runs["device"].dropna().astype(str))) if "device" in runs else []
    counts = runs["status"].value_counts().to_dict() if len(runs) else {}
    return [f"Measured on: {', '.join(devs) or 'unknown'}. Cells: "
            + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))]


def run_tables(runs_csv: str | Path, outputs: dict[str, dict[str, str]]) -> None:
    """``outputs``: table name -> {"md": path, "csv": path, "html": path} (the rule's outputs)."""
    runs, invalid = read_runs(runs_csv)
    claims = load_claims()
    for name, out in outputs.items():
        df = RUN_TABLES[name](runs, claims)
        write(df, out["md"], out["csv"], TITLES[name], machine_note(runs) + invalid_note(invalid), out.get("html"))


def repro_table(name: str, repro_csv: str | Path, out: dict[str, str], title: str | None = None) -> None:
    """A reproduction's rows (lowmembp.repro: paper value, ours, ratio and a note already side by side) -> table.

    A table without a ``ratio`` column gets one from its first numeric ``paper...`` / ``ours...`` pair."""
    df = pd.read_csv(repro_csv)
    if "ratio" not in df.columns:
        num = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]
        p = next((c for c in num if c.startswith("paper")), None)
        o = next((c for c in num if c.startswith("ours")), None)
        if p and o:
            df.insert(df.columns.get_loc(o) + 1, "ratio", df[o] / df[p])
    write(df, out["md"], out["csv"], title or name.replace("_", " "),
          [f"From `python -m lowmembp.repro {name.replace('_', '-')}` (fake tensors on the CPU)."], out.get("html"))


def _in(outdir: str, stem: str) -> dict[str, str]:
    """By hand: the table's files in OUTDIR (the command line names the folder)."""
    return {ext: str(Path(outdir) / f"{stem}.{ext}") for ext in catalogue.TABLE_FORMATS}


if "snakemake" in globals():
    sm = snakemake  # noqa: F821
    if sm.params.kind == "runs":
        run_tables(sm.input.runs, {name: {"md": md, "csv": csv, "html": html} for name, md, csv, html in
                                   zip(sm.params.names, sm.output.md, sm.output.csv, sm.output.html)})
    else:
        repro_table(sm.params.name, sm.input[0], {"md": sm.output.md, "csv": sm.output.csv, "html": sm.output.html},
                    sm.params.title)
elif __name__ == "__main__":
    if sys.argv[1] == "runs":
        run_tables(sys.argv[2], {name: _in(sys.argv[3], name) for name in RUN_TABLES})
    else:
        stem = sys.argv[2].replace("-", "_")
        repro_table(stem, sys.argv[3], _in(sys.argv[4], stem), catalogue.REPRO_BY_STEM[stem].title
                    if stem in catalogue.REPRO_BY_STEM else None)

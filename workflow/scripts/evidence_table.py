"""The convergence evidence (config ``evidence:``, workflow/rules/evidence.smk): the records of the evidence sweeps ->
one table of paired differences, each method against the method it is compared with, with a 95 % confidence interval
and a verdict (results/tables/evidence.{md,csv,html}).

Pairing: cells of the same task, model, batch size and seed share the data order and the initial weights (the
training job seeds every generator from ``--seed``), so per seed the difference method − compared method removes
what the two runs share; over the seeds the mean difference gets a paired t interval (:func:`t_interval`):
mean ± t(0.975, n − 1) · sd / √n. The compared method is the one every table of the pipeline uses
(``table_maths.reference_method``: lora+X against lora, every other method against baseline).

Differences, per seed: accuracy in points of % (method − compared; + = better); perplexity in % of the compared
method's (method / compared − 1; + = worse). Verdict (:func:`verdict`) against the equivalence margin m of the
metric (config ``evidence: margins:``), the two one-sided tests (TOST) read off the 95 % interval:

- ``equivalent``: the whole interval inside (−m, +m): neither a loss nor a gain of m or more;
- ``worse``: the interval below 0 and reaching past −m: a loss is shown and one of m or more is not ruled out
  (a loss of at least m is shown when the upper end is below −m too; the table's interval says which);
- ``better``: the mirror image;
- ``undecided``: anything else (the interval holds 0 and reaches past a margin): more seeds are needed to say.

``equivalent within``: the smallest margin the interval fits (max |end|), so a reader can apply another margin.

Run by Snakemake (rule evidence_table) or by hand:
``python evidence_table.py OUTDIR MARGIN_ACCURACY MARGIN_PERPLEXITY RECORD.json ...``.
"""

import math
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
for _p in (HERE, HERE.parent, HERE.parents[1]):  # scripts, the catalogue, the library and experiments/
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import catalogue  # noqa: E402
from make_reference import cpu_name  # noqa: E402
from table_layout import Layout, Part  # noqa: E402
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER  # noqa: E402
from sweep_layouts import machine, machine_note  # noqa: E402
from table_maths import PERCENT_METRICS, reference_method  # noqa: E402
from tables import write  # noqa: E402

LEVEL = 0.95
UNITS = {"accuracy": "pt", "perplexity": "%"}  # the unit of a difference: points of %, or % of the compared value
LOWER_IS_BETTER = {"perplexity"}
VERDICTS = ("equivalent", "worse", "better", "undecided")


def t_interval(diffs, level: float = LEVEL) -> tuple[float, float, float, float, int]:
    """(mean, sd, low, high, n) of the paired t interval of the mean of ``diffs`` (NaN ends below 2 values; a zero
    spread gives the mean at both ends)."""
    from scipy import stats

    d = np.asarray([x for x in diffs if pd.notna(x)], dtype=float)
    n = len(d)
    if n == 0:
        return math.nan, math.nan, math.nan, math.nan, 0
    mean = float(d.mean())
    if n < 2:
        return mean, math.nan, math.nan, math.nan, n
    sd = float(d.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean, sd, mean - half, mean + half, n


def verdict(low: float, high: float, margin: float, higher_is_better: bool = True) -> str:
    """One of :data:`VERDICTS` for the interval (low, high) of a difference and the margin (see the module doc);
    ``higher_is_better`` False for a difference where + is a loss (perplexity)."""
    if not (margin > 0):
        raise ValueError(f"an equivalence margin must be positive, got {margin!r}")
    if math.isnan(low) or math.isnan(high):
        return "undecided"
    if not higher_is_better:
        low, high = -high, -low
    if -margin < low and high < margin:
        return "equivalent"
    if high < 0 and low <= -margin:
        return "worse"
    if low > 0 and high >= margin:
        return "better"
    return "undecided"


def read_records(paths) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per record as runs.csv has it, the learning curves: one row per task, model, method, batch size,
    seed and step, with the base's metric as step 0 where the run started from one). Accuracy in %."""
    from experiments.record import load
    from experiments.record_columns import flatten

    rows, curves = [], []
    for path in paths:
        rec = load(path)
        row = flatten(rec)
        rows.append(row)
        if rec.status != "ok" or rec.curve is None or rec.metric is None:
            continue
        scale = 100.0 if rec.metric.name in PERCENT_METRICS else 1.0
        key = {k: row[k] for k in ("task", "model", "method", "batch_size", "seed")} | {"metric_name": rec.metric.name}
        if rec.base is not None and rec.base.metric_before is not None:
            curves.append({**key, "step": 0, "value": rec.base.metric_before * scale})
        curves += [{**key, "step": p.step, "value": p.metric * scale} for p in rec.curve.points]
    runs = pd.DataFrame(rows)
    cols = ["task", "model", "method", "batch_size", "seed", "metric_name", "step", "value"]
    return runs, pd.DataFrame(curves, columns=cols)


CELL = ["task", "model", "optimizer", "batch_size"]  # runs of one cell but for the method and the seed


def _with_optimizer(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with an optimizer on every row (rows without one: the records' default, as the tables read them)."""
    opt = runs["optimizer"].fillna(DEFAULT_OPTIMIZER) if "optimizer" in runs else DEFAULT_OPTIMIZER
    return runs.assign(optimizer=opt)


def per_seed_differences(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per method (not baseline), compared method and seed that both finished: their metrics and the
    difference in the metric's unit (:data:`UNITS`)."""
    ok = _with_optimizer(runs[runs["status"] == "ok"])
    out = []
    for (task, model, opt, bs), cell in ok.groupby(CELL, sort=False):
        by = {m: g.set_index("seed")["metric_value"] for m, g in cell.groupby("method", sort=False)}
        name = cell["metric_name"].iloc[0]
        for method in by:
            ref = reference_method(method)
            if ref is None or ref not in by:
                continue
            both = pd.concat([by[method].rename("method"), by[ref].rename("compared")], axis=1).dropna()
            for seed, (m, c) in both.iterrows():
                diff = (m - c) * 100.0 if name in PERCENT_METRICS else (m / c - 1.0) * 100.0
                out.append(dict(task=task, model=model, optimizer=opt, batch_size=bs, method=method, compared_with=ref,
                                seed=seed, metric=name, compared_value=c, method_value=m, difference=diff))
    cols = [*CELL, "method", "compared_with", "seed", "metric", "compared_value", "method_value", "difference"]
    return pd.DataFrame(out, columns=cols)


def evidence_table(runs: pd.DataFrame, margins: dict[str, float], level: float = LEVEL) -> pd.DataFrame:
    """Per method against its compared method: seeds paired, means, the mean difference, its sd and interval, the
    margin, the verdict and the smallest margin the interval fits. ``margins``: metric name -> margin in its unit."""
    diffs = per_seed_differences(runs)
    scale = {m: 100.0 if m in PERCENT_METRICS else 1.0 for m in diffs["metric"].unique()}
    steps = _with_optimizer(runs[runs["status"] == "ok"]).groupby([*CELL, "method"])["steps"].max()
    rows = []
    for (task, model, opt, bs, method, ref, metric), g in diffs.groupby(
            [*CELL, "method", "compared_with", "metric"], sort=False):
        if metric not in margins:
            raise ValueError(f"no equivalence margin for metric {metric!r}; config evidence: margins: has "
                             f"{', '.join(margins) or 'none'}")
        mean, sd, low, high, n = t_interval(g["difference"], level)
        margin = float(margins[metric])
        rows.append(dict(
            task=task, model=model, optimizer=opt, batch_size=bs,
            steps=steps.get((task, model, opt, bs, method), np.nan),
            method=method, compared_with=ref, metric=metric, unit=UNITS.get(metric, "%"), seeds=n,
            compared_mean=g["compared_value"].mean() * scale[metric],
            method_mean=g["method_value"].mean() * scale[metric],
            change_mean=mean, change_sd=sd, ci_low=low, ci_high=high, margin=margin,
            verdict=verdict(low, high, margin, metric not in LOWER_IS_BETTER),
            equivalent_within=max(abs(low), abs(high)) if n >= 2 else np.nan))
    from plots import _method_key  # the pipeline's order of methods (its figures and tables)

    rows.sort(key=lambda r: (r["task"], r["model"], r["optimizer"], r["batch_size"], _method_key(r["method"])))
    cols = [*CELL, "steps", "method", "compared_with", "metric", "unit", "seeds",
            "compared_mean", "method_mean", "change_mean", "change_sd", "ci_low", "ci_high", "margin", "verdict",
            "equivalent_within"]
    return pd.DataFrame(rows, columns=cols)


def display(df: pd.DataFrame) -> pd.DataFrame:
    """The table as a person reads it (≤ 8 columns, units in the cells' own words)."""
    def num(v, unit, signed=True):
        return "-" if pd.isna(v) else (f"{v:+.2f} {unit}" if signed else f"{v:.2f} {unit}")

    rows = []
    for d in df.to_dict("records"):
        unit, metric_unit = d["unit"], "%" if d["metric"] in PERCENT_METRICS else ""
        ci = "-" if pd.isna(d["ci_low"]) else f"[{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]"
        rows.append({
            "task / model (steps)": f"{d['task']} / {d['model']} ({'-' if pd.isna(d['steps']) else int(d['steps'])})",
            "method (vs compared)": (f"{d['method']}"
                                     + ("" if d["optimizer"] == DEFAULT_OPTIMIZER else f", {d['optimizer']}")
                                     + f" (vs {d['compared_with']})"),
            "seeds": str(d["seeds"]),
            "metric: compared → method": (f"{d['metric']} {d['compared_mean']:.2f} → {d['method_mean']:.2f}"
                                          f"{' ' + metric_unit if metric_unit else ''}"),
            "mean change (95 % CI)": f"{num(d['change_mean'], unit)} {ci}",
            "margin": f"±{d['margin']:g} {unit}",
            "verdict": d["verdict"],
            "equivalent within": num(d["equivalent_within"], unit, signed=False),
        })
    return pd.DataFrame(rows)


CAPTION = ("Paired over seeds: the same seed gives both runs the same data order and initial weights. Change per "
           "seed: accuracy in points of % (method − compared; + = better), perplexity in % of the compared "
           "method's (method / compared − 1; + = worse); mean and 95 % paired t interval over the seeds. Verdict "
           "(two one-sided tests read off the 95 % interval): `equivalent` = the whole interval inside ±margin; "
           "`worse` / `better` = the interval excludes 0 and reaches past the margin on that side; `undecided` = "
           "neither, more seeds would be needed. `equivalent within` = the smallest margin the interval fits.")


def wall_note(runs: pd.DataFrame) -> str:
    start = pd.to_datetime(runs["started_at"], utc=True, errors="coerce").min()
    end = pd.to_datetime(runs["finished_at"], utc=True, errors="coerce").max()
    if pd.isna(start) or pd.isna(end):
        return "Training jobs: times unknown."
    return (f"Training jobs from {start:%Y-%m-%d %H:%M} to {end:%H:%M} UTC: {(end - start).total_seconds() / 60:.1f} "
            f"min of wall time, {len(runs)} cells.")


def write_evidence(records, out: dict[str, str], margins: dict[str, float], command: str = "",
                   label: str = "") -> pd.DataFrame:
    """The evidence table of ``records`` to ``out`` = {"md", "csv", "html"}; returns it. ``label``: what the run
    is when it is not the evidence itself (a test run), put before the title; ``command``: what made it."""
    runs, _ = read_records(records)
    df = evidence_table(runs, margins)
    title = catalogue.EVIDENCE_TABLE.title + (f" — {label}" if label else "")
    notes = ([f"**{label}**", ""] if label else []) + machine_note(runs) + [wall_note(runs)]
    notes.append(f"Made on {cpu_name()}, {os.cpu_count()} logical cores" + (f", by `{command}`." if command else "."))
    counts = df["verdict"].value_counts()
    notes.append("Verdicts: " + ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS) + ".")
    layout = Layout(title, machine(runs), CAPTION, [Part("", display(df))], notes=[n for n in notes if n])
    write(df, out["md"], out["csv"], layout, out.get("html"))
    return df


if "snakemake" in globals():
    sm = snakemake  # noqa: F821
    write_evidence(list(sm.input.records), {"md": sm.output.md, "csv": sm.output.csv, "html": sm.output.html},
                   dict(sm.params.margins), sm.params.command, sm.params.label)
elif __name__ == "__main__":
    outdir = Path(sys.argv[1])
    write_evidence(sys.argv[4:], {ext: str(outdir / f"{catalogue.EVIDENCE_TABLE.name}.{ext}")
                                  for ext in catalogue.TABLE_FORMATS},
                   {"accuracy": float(sys.argv[2]), "perplexity": float(sys.argv[3])})

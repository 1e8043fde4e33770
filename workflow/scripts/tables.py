"""runs.csv (and the reproductions' CSVs) -> results/tables/<name>.md, .csv and .html.

Every table of the sweep puts ours beside the paper's value: ratios to the method a row is compared with
(``compared_with``: ``lora+X`` against ``lora``, every other method against ``baseline``, same task, model and batch
size), the papers' ratios from workflow/resources/paper_claims.yaml, and ``ours/paper``. A paper's ratio belongs to
one setting (its models and, for LoRA, its targets; :func:`claim`) and is shown only beside rows of that setting: a
CPU stand-in, LoRA on other targets or full fine-tuning beside a LoRA-relative ratio get '-'. Column names say what a
number is: ``*_MiB`` / ``*_ms`` / ``*_%`` carry their unit, ``*_ratio_ours`` and ``*_ratio_paper`` are ratios of
this method to ``compared_with`` (below 1: less memory, less time), ``*_ours/paper`` is our ratio over the paper's.

- memory: peak and activation memory per cell;
- speed: step time p50 with its p20–p80 spread; the ratio's spread (p20 / compared p80 … p80 / compared p20) and
  ``within_noise`` (yes when that spread contains 1: on this machine the two cannot be told apart);
- accuracy: the evaluation metric of the cells long enough to learn (per task the batch size with the most seeds,
  then the longest training: :func:`accuracy_batch_size`, the rule the accuracy figure uses), accuracy in %;
- accuracy_short: the same for the other cells (the few-step memory/speed cells): near chance, not a comparison;
- headline (:func:`headline_table`, rule ``headline``): per method what it saves, what it costs in step time and
  what it changes in the metric, ours beside the papers'.

Each table is written as CSV (every column, for tools) and, for people, as Markdown and HTML (table_html.py) that read
alone (table_layout.py): a title that says what and on which machine (the records' device and dtype; a reproduction: how
its numbers were made), a machine line, parts of at most ten columns with units in the headers, and long notes, messages
and the papers' sources as numbered footnotes. Step times measured on a CPU are labelled :func:`cpu_time` (which ops
ran: the records' ``ops_backend``) and never share a column with the papers' GPU throughput claims: those stand in a
part of their own, beside the FLOP ratio of the row's setting (:func:`flop_ratio`, fake tensors) and a GPU column
(:data:`NO_GPU` until benchmarks/gpu_run.py has written results/gpu/). All three files come from the same call,
atomically (``lowmembp.atomic``), to the paths Snakemake gives (rule outputs); the titles come from
workflow/catalogue.py. Rows of runs.csv with status ``invalid`` (a damaged record) are left out and counted in the
table's note.

Run by Snakemake (rules run_tables, repro_table, headline), or by hand:
``python tables.py runs RUNS.csv OUTDIR`` / ``python tables.py repro NAME REPRO.csv OUTDIR`` /
``python tables.py headline RUNS.csv OUTDIR``.
"""

import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
for _p in (HERE, HERE.parent, HERE.parents[1]):  # scripts, the catalogue, the library
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import catalogue  # noqa: E402
from lowmembp.atomic import atomic_write  # noqa: E402
from lowmembp.estimator.weights import FROZEN_BASE_METHODS  # noqa: E402
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER  # noqa: E402  (a record without an optimizer: this one)
from table_html import page  # noqa: E402
from table_layout import Footnotes, Layout, Part, header, long_text_columns, markdown, split_columns  # noqa: E402

CLAIMS = HERE.parent / "resources" / "paper_claims.yaml"
MiB = 2**20
KEYS = ["task", "model", "method", "optimizer", "batch_size"]  # a cell (_complete: no optimizer column = adamw)
COMPARED = "compared_with"
PERCENT_METRICS = {"accuracy"}  # metrics stored as fractions, shown in %


def reference_method(method: str) -> str | None:
    """The method a row is compared with: lora+X -> lora, every other method -> baseline (baseline: none). A spec
    with options keeps them on its LoRA: lora@rank=8+X -> lora@rank=8 (tokentune@k=4 -> baseline)."""
    from lowmembp.methods.registry import plain_spec

    if method == "baseline":
        return None
    first, plus, _ = method.partition("+")
    try:
        return first if plus and plain_spec(first) == "lora" else "baseline"
    except ValueError:  # not a spec (e.g. a hand-made row): the baseline
        return "baseline"


def load_claims(path: Path = CLAIMS) -> dict:
    return yaml.safe_load(Path(path).read_text())


def _targets_text(v) -> str | None:
    """A LoRA ``targets`` option as one comparable text: None / NaN -> None, a list (or its JSON) -> "a,b"."""
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return None
    if isinstance(v, str) and v.startswith("["):
        import json

        try:
            v = json.loads(v)
        except ValueError:
            pass
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return ",".join(t.strip() for t in str(v).split(","))


def claim(claims: dict, table: str, method: str, model: str, targets=None) -> tuple[float, str]:
    """The paper's ratio for this row and its source, or (NaN, "") where no paper value belongs to the row's setting:
    an entry of ``claims[table][plain method]`` whose ``models`` hold ``model`` and, where it names LoRA ``targets``,
    whose targets are the row's (``targets``: the row's option; one written into the spec wins)."""
    from lowmembp.methods.registry import plain_spec, spec_options

    try:
        plain, fixed = plain_spec(method), spec_options(method)
    except ValueError:  # not a spec (a hand-made row)
        plain, fixed = method, {}
    targets = _targets_text(fixed.get("targets", targets))
    for entry in claims.get(table, {}).get(plain, []):
        models = entry["models"]
        if models != "any" and model not in models:
            continue
        if "targets" in entry and _targets_text(entry["targets"]) != targets:
            continue
        return float(entry["value"]), f"{entry['source']} [setting: {entry['setting']}]"
    return np.nan, ""


def _status(s: pd.Series) -> str:
    vals = sorted(set(s.dropna().astype(str)))
    return vals[0] if len(vals) == 1 else "/".join(vals)


def _first(s: pd.Series):
    s = s.dropna()
    return s.iloc[0] if len(s) else np.nan


def per_cell(runs: pd.DataFrame, value: str, how: str = "mean") -> pd.DataFrame:
    """One row per (task, model, method, batch size): the value over ok seeds, the cell's status and its LoRA
    ``opt_targets`` (the setting a paper value must match, :func:`claim`) where the runs have that column."""
    ok = runs[runs["status"] == "ok"]
    agg = ok.groupby(KEYS, dropna=False)[value].agg(how).rename(value)
    status = runs.groupby(KEYS, dropna=False)["status"].agg(_status)
    parts = [status, agg]
    if "opt_targets" in runs and value != "opt_targets":
        parts.append(runs.groupby(KEYS, dropna=False)["opt_targets"].agg(_first))
    return pd.concat(parts, axis=1).reset_index()


OPTIONAL = ("steps", "step_time_p20", "step_time_p80", "samples_per_s", "message", "dtype")


def _complete(runs: pd.DataFrame) -> pd.DataFrame:
    """runs with the optional columns a hand-made or older runs.csv may lack (as NaN; the optimizer as adamw)."""
    opt = runs["optimizer"].fillna(DEFAULT_OPTIMIZER) if "optimizer" in runs else DEFAULT_OPTIMIZER
    return runs.assign(**{c: np.nan for c in OPTIONAL if c not in runs}, optimizer=opt)


def _ref_values(df: pd.DataFrame, value: str) -> np.ndarray:
    """The compared method's ``value`` in the same task, model, optimizer and batch size."""
    idx = df.set_index(KEYS)[value]
    return np.asarray([idx.get((t, m, reference_method(x), o, b), np.nan) if reference_method(x) else np.nan
                       for t, m, x, o, b in zip(df["task"], df["model"], df["method"], df["optimizer"],
                                                df["batch_size"])], dtype=float)


def same_device(df: pd.DataFrame, runs: pd.DataFrame) -> pd.Series:
    """Per row of ``df`` (one cell each): whether its records and those of its compared method ran on the same device
    kind (:func:`device_kind`; True where either is unknown or there is no compared method), so that a CPU's step
    time is never set against a GPU's."""
    out = []
    for t, m, x, o, b in zip(df["task"], df["model"], df["method"], df["optimizer"], df["batch_size"]):
        ref = reference_method(x)
        mine = cell_devices(runs, t, m, x, o, b)
        theirs = cell_devices(runs, t, m, ref, o, b) if ref else []
        out.append(not mine or not theirs or mine == theirs)
    return pd.Series(out, index=df.index, dtype=bool)


def with_reference(df: pd.DataFrame, value: str, ref_value: str | None = None) -> pd.Series:
    """df[value] / df[ref_value or value] of the compared method in the same task, model, optimizer and batch
    size."""
    return df[value] / _ref_values(df, ref_value or value)


def _notes(runs: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the messages of seeds that did not finish (oom / error), shortened."""
    bad = runs[runs["status"] != "ok"]
    msg = bad.assign(m=bad["status"].astype(str) + ": " + bad.get("message", pd.Series("", index=bad.index))
                     .fillna("").astype(str).str.slice(0, 80))
    notes = msg.groupby(KEYS, dropna=False)["m"].agg(lambda s: "; ".join(dict.fromkeys(s))).rename("notes")
    return notes.reset_index()


def _with_notes(df: pd.DataFrame, runs: pd.DataFrame, extra: pd.Series | None = None) -> pd.DataFrame:
    df = df.merge(_notes(runs), on=KEYS, how="left")
    df["notes"] = df["notes"].fillna("")
    if extra is not None:
        df["notes"] = [("; ".join(x for x in (a, b) if x)) for a, b in zip(extra.fillna(""), df["notes"])]
    return df


def add_paper(df: pd.DataFrame, ours: str, table: str, claims: dict, prefix: str) -> pd.DataFrame:
    """``<prefix>_ratio_ours`` (= df[ours]), ``<prefix>_ratio_paper``, ``<prefix>_ratio_ours/paper``, source."""
    targets = df["opt_targets"] if "opt_targets" in df else [None] * len(df)
    vals = [claim(claims, table, x, m, t) for x, m, t in zip(df["method"], df["model"], targets)]
    df[f"{prefix}_ratio_ours"] = df[ours]
    df[f"{prefix}_ratio_paper"] = [v for v, _ in vals]
    df[f"{prefix}_ratio_ours/paper"] = df[f"{prefix}_ratio_ours"] / df[f"{prefix}_ratio_paper"]
    df[f"{prefix}_source"] = [s for _, s in vals]
    return df


def memory_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    runs = _complete(runs)
    peak = per_cell(runs, "peak_bytes")
    act = per_cell(runs, "activation_bytes")[KEYS + ["activation_bytes"]]
    steps = per_cell(runs, "steps", "max")[KEYS + ["steps"]]
    df = peak.merge(act, on=KEYS, how="left").merge(steps, on=KEYS, how="left")
    df[COMPARED] = df["method"].map(lambda x: reference_method(x) or "")
    df["peak_MiB"] = df["peak_bytes"] / MiB
    df["activation_MiB"] = df["activation_bytes"] / MiB
    df["_peak"] = with_reference(df, "peak_bytes")
    df["_act"] = with_reference(df, "activation_bytes")
    df = add_paper(df, "_peak", "peak_ratio", claims, "peak")
    df = add_paper(df, "_act", "activation_ratio", claims, "act")
    df = _with_notes(df, runs)
    cols = KEYS + ["status", "steps", COMPARED, "peak_MiB", "peak_ratio_ours", "peak_ratio_paper",
                   "peak_ratio_ours/paper", "activation_MiB", "act_ratio_ours", "act_ratio_paper",
                   "act_ratio_ours/paper", "notes", "peak_source", "act_source"]
    return df[cols]


WITHIN_NOISE = "p20–p80 spread of the ratio contains 1"


def speed_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    runs = _complete(runs)
    df = per_cell(runs, "step_time_p50", "median")
    for extra, how in [("step_time_p20", "median"), ("step_time_p80", "median"), ("samples_per_s", "median"),
                       ("steps", "max")]:
        df = df.merge(per_cell(runs, extra, how)[KEYS + [extra]], on=KEYS, how="left")
    df[COMPARED] = df["method"].map(lambda x: reference_method(x) or "")
    for p in ("p20", "p50", "p80"):
        df[f"step_ms_{p}"] = df[f"step_time_{p}"] * 1e3
    df["_time"] = with_reference(df, "step_time_p50").where(same_device(df, runs))
    df = add_paper(df, "_time", "step_time_ratio", claims, "time")
    same = same_device(df, runs)  # a step time is only set against one measured on the same device
    df["time_ratio_ours_p20/p80"] = with_reference(df, "step_time_p20", "step_time_p80").where(same)  # lowest
    df["time_ratio_ours_p80/p20"] = with_reference(df, "step_time_p80", "step_time_p20").where(same)  # highest
    lo, hi = df["time_ratio_ours_p20/p80"], df["time_ratio_ours_p80/p20"]
    df["within_noise"] = np.where(lo.isna() | hi.isna(), "", np.where((lo <= 1) & (hi >= 1), "yes", "no"))
    extra = pd.Series(np.where(df["within_noise"] == "yes", WITHIN_NOISE, ""))
    df = _with_notes(df, runs, extra)
    cols = KEYS + ["status", "steps", COMPARED, "step_ms_p50", "step_ms_p20", "step_ms_p80", "samples_per_s",
                   "time_ratio_ours", "time_ratio_ours_p20/p80", "time_ratio_ours_p80/p20", "within_noise",
                   "time_ratio_paper", "time_ratio_ours/paper", "notes", "time_source"]
    return df[cols]


def accuracy_batch_size(sub: pd.DataFrame) -> int:
    """The batch size whose cells carry the accuracy comparison: the most seeds, then the longest training
    (steps × batch size), so short memory/speed cells never stand in for trained ones."""
    per_bs = sub.assign(samples=sub["steps"] * sub["batch_size"]).groupby("batch_size").agg(
        seeds=("seed", "nunique"), samples=("samples", "max"))
    return int(per_bs.sort_values(["seeds", "samples"], ascending=False).index[0])


def learning_batch_sizes(runs: pd.DataFrame) -> dict[tuple, int]:
    """(task, model) -> the batch size of the cells long enough to learn (:func:`accuracy_batch_size` over the
    finished cells with a metric)."""
    ok = _complete(runs)[runs["status"] == "ok"]
    if "metric_value" in ok:
        ok = ok.dropna(subset=["metric_value"])
    return {(t, m): accuracy_batch_size(sub) for (t, m), sub in ok.groupby(["task", "model"]) if len(sub)}


def is_learning_cell(df: pd.DataFrame, runs: pd.DataFrame) -> pd.Series:
    best = learning_batch_sizes(runs)
    return pd.Series([best.get((t, m)) == b for t, m, b in zip(df["task"], df["model"], df["batch_size"])],
                     index=df.index)


def metric_unit(name) -> str:
    return "%" if name in PERCENT_METRICS else str(name) if isinstance(name, str) else ""


def _metric_before(ok: pd.DataFrame) -> pd.Series:
    for col in ("base_metric_before", "opt_init_metric_before"):  # the latter: runs.csv of schema before base.*
        if col in ok and ok[col].notna().any():
            return pd.to_numeric(ok[col], errors="coerce")
    return pd.Series(np.nan, index=ok.index)


def _accuracy_cells(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    runs = _complete(runs)
    ok = runs[runs["status"] == "ok"]
    g = ok.groupby(KEYS, dropna=False)["metric_value"]
    df = pd.concat([g.mean().rename("metric_mean"), g.std(ddof=1).rename("metric_std"),
                    g.min().rename("metric_min"), g.max().rename("metric_max"), g.count().rename("seeds")],
                   axis=1).reset_index()
    extra = {"opt_targets": ("opt_targets", _first)} if "opt_targets" in ok else {}  # the setting (claim)
    names = ok.groupby(KEYS, dropna=False).agg(metric=("metric_name", _first), steps=("steps", "max"),
                                              **extra).reset_index()
    # runs that start from a pre-trained base (--init) record the base's metric before fine-tuning
    before = _metric_before(ok).groupby([ok[k] for k in KEYS], dropna=False).mean()
    names = names.merge(before.rename("metric_before").reset_index(), on=KEYS, how="left")
    status = runs.groupby(KEYS, dropna=False)["status"].agg(_status).reset_index()
    df = status.merge(df, on=KEYS, how="left").merge(names, on=KEYS, how="left")
    df[COMPARED] = df["method"].map(lambda x: reference_method(x) or "")
    df["_ratio"] = with_reference(df, "metric_mean")
    pct = df["metric"].isin(PERCENT_METRICS)
    for c in ("metric_mean", "metric_std", "metric_min", "metric_max", "metric_before"):
        df[c] = df[c].where(~pct, df[c] * 100)
    df["unit"] = df["metric"].map(metric_unit)
    df["change_vs_compared"] = df["metric_mean"] - _ref_values(df, "metric_mean")
    df = add_paper(df, "_ratio", "metric_ratio", claims, "metric")
    return _with_notes(df, runs)


ACCURACY_COLS = KEYS + ["status", "steps", "seeds", COMPARED, "metric", "unit", "metric_before", "metric_mean",
                        "metric_std", "metric_min", "metric_max", "change_vs_compared", "metric_ratio_ours",
                        "metric_ratio_paper", "metric_ratio_ours/paper", "notes", "metric_source"]


def accuracy_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    """The cells long enough to learn (per task: :func:`learning_batch_sizes`)."""
    df = _accuracy_cells(runs, claims)
    return df[is_learning_cell(df, runs)][ACCURACY_COLS].reset_index(drop=True)


def accuracy_short_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    """Every other cell: too short to learn (the memory/speed cells); their metric is near chance."""
    df = _accuracy_cells(runs, claims)
    df = df[~is_learning_cell(df, runs)]
    return df[[c for c in ACCURACY_COLS if not c.startswith("metric_ratio") and c != "metric_source"]] \
        .reset_index(drop=True)


def device_kind(name) -> str:
    """A record's device as the tables name it: ``cpu`` for any CPU (its thread count aside), else the GPU's name."""
    text = str(name) if isinstance(name, str) else ""
    return "cpu" if not text or text.lower().startswith("cpu") else text


def cell_devices(runs: pd.DataFrame, task, model, method, opt, bs) -> list[str]:
    """The device kinds (:func:`device_kind`) of a cell's records."""
    if "device" not in runs:
        return []
    sel = runs[(runs["task"] == task) & (runs["model"] == model) & (runs["method"] == method)
               & (runs["batch_size"] == bs)]
    if "optimizer" in sel:
        sel = sel[sel["optimizer"].fillna(DEFAULT_OPTIMIZER) == opt]
    return sorted({device_kind(d) for d in sel["device"]})


def headline_table(runs: pd.DataFrame, claims: dict) -> pd.DataFrame:
    """One row per task, model and method (baseline left out): memory saved, step-time change and metric change
    against ``compared_with``, ours beside the paper's. Memory and speed come from the largest batch size where
    the method and the one it is compared with both finished; the metric from the cells long enough to learn.
    ``device``: where the method's cells at that batch ran (``cpu``, or the GPU's name); a step-time change is only
    given where the method and the one it is compared with ran on the same device (a CPU time is never set against
    a GPU time)."""
    mem, spd, acc = memory_table(runs, claims), speed_table(runs, claims), accuracy_table(runs, claims)
    rows = []
    groups = mem[mem[COMPARED] != ""].groupby(["task", "model", "method", "optimizer"], sort=False)
    for (task, model, method, opt), sub in groups:
        both = sub.dropna(subset=["peak_ratio_ours"])
        m = both.sort_values("batch_size").iloc[-1] if len(both) else sub.sort_values("batch_size").iloc[-1]
        s = spd[(spd["task"] == task) & (spd["model"] == model) & (spd["method"] == method)
                & (spd["optimizer"] == opt) & (spd["batch_size"] == m["batch_size"])]
        s = s.iloc[0] if len(s) else None
        dev = cell_devices(runs, task, model, method, opt, m["batch_size"])
        ref_dev = cell_devices(runs, task, model, m[COMPARED], opt, m["batch_size"])
        device_note = ""
        if s is not None and dev and ref_dev and dev != ref_dev:
            device_note = (f"step time not compared: {method} ran on {', '.join(dev)}, {m[COMPARED]} on "
                           f"{', '.join(ref_dev)}")
            s = None
        a = acc[(acc["task"] == task) & (acc["model"] == model) & (acc["method"] == method)
                & (acc["optimizer"] == opt)]
        a = a.iloc[0] if len(a) else None
        ref_mean = (a["metric_mean"] - a["change_vs_compared"]) if a is not None else np.nan

        def pct_saved(r):
            return 100 * (1 - r)

        def pct_more(r):
            return 100 * (r - 1)

        rows.append({
            "task": task, "model": model, "method": method, "optimizer": opt, COMPARED: m[COMPARED],
            "memory_batch": int(m["batch_size"]),
            "peak_saved_%_ours": pct_saved(m["peak_ratio_ours"]),
            "peak_saved_%_paper": pct_saved(m["peak_ratio_paper"]),
            "activations_saved_%_ours": pct_saved(m["act_ratio_ours"]),
            "activations_saved_%_paper": pct_saved(m["act_ratio_paper"]),
            "step_time_change_%_ours": pct_more(s["time_ratio_ours"]) if s is not None else np.nan,
            "step_time_change_%_p20/p80": pct_more(s["time_ratio_ours_p20/p80"]) if s is not None else np.nan,
            "step_time_change_%_p80/p20": pct_more(s["time_ratio_ours_p80/p20"]) if s is not None else np.nan,
            "within_noise": s["within_noise"] if s is not None else "",
            "step_time_change_%_paper": pct_more(s["time_ratio_paper"]) if s is not None else np.nan,
            "metric": a["metric"] if a is not None else "",
            "accuracy_batch": int(a["batch_size"]) if a is not None else np.nan,
            "seeds": a["seeds"] if a is not None else np.nan,
            "metric_compared": ref_mean,
            "metric_method": a["metric_mean"] if a is not None else np.nan,
            "metric_change_ours": a["change_vs_compared"] if a is not None else np.nan,
            "metric_change_paper": ((a["metric_ratio_paper"] - 1) * ref_mean) if a is not None else np.nan,
            "unit": a["unit"] if a is not None else "",
            "status": m["status"], "notes": "; ".join(x for x in (m["notes"], device_note) if isinstance(x, str) and x),
            "device": ", ".join(dev),
            "sources": " | ".join(dict.fromkeys(x for x in [m["peak_source"], m["act_source"],
                                                           s["time_source"] if s is not None else "",
                                                           a["metric_source"] if a is not None else ""] if x)),
        })
    cols = ["task", "model", "method", "optimizer", COMPARED, "memory_batch", "peak_saved_%_ours", "peak_saved_%_paper",
            "activations_saved_%_ours", "activations_saved_%_paper", "step_time_change_%_ours",
            "step_time_change_%_p20/p80", "step_time_change_%_p80/p20", "within_noise", "step_time_change_%_paper",
            "accuracy_batch", "seeds", "metric", "unit", "metric_compared", "metric_method", "metric_change_ours",
            "metric_change_paper", "status", "notes", "sources", "device"]
    return pd.DataFrame(rows, columns=cols)


# The peers' sections of the peers table, each the docs page of one method (docs/methods/<name>.md), which includes
# its section alone: the method's cells beside the cells of the method they are compared with.
PEER_METHODS = ("velora", "cce", "tiled-mlp", "compact")
# shown beside a peer besides its compared method: the method it modifies, or (compact) the one it composes with
PEER_ALSO = {"velora": ("lora",), "compact": ("lowmembp",)}
OPTIMIZERS_SECTION = "optimizers"  # the same cell with each optimizer (docs/methods/optimizers.md)
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")  # peak_<c>_bytes


def _plain_names(method: str) -> set[str]:
    from lowmembp.methods.registry import plain_spec

    names = set()
    for part in str(method).split("+"):
        try:
            names.add(plain_spec(part))
        except ValueError:  # not a spec (a hand-made row)
            names.add(part)
    return names


def peers_table(runs: pd.DataFrame, claims: dict | None = None) -> pd.DataFrame:
    """The cells of the newer peers (:data:`PEER_METHODS`), each beside the cell it is compared with (same task,
    model, optimizer and batch size), and every cell run with more than one optimizer, each optimizer beside AdamW:
    peak and its split by category, bytes saved for backward, step time and final loss (mean / median over seeds).
    ``section`` names the docs page a row belongs to; a compared cell appears in each section that needs it."""
    cols = ["peak_bytes", "activation_bytes", "final_loss", "steps"] + [
        f"peak_{c}_bytes" for c in CATEGORIES + ("activations_and_temporaries",)]
    runs = _complete(runs)
    runs = runs.assign(**{c: np.nan for c in cols if c not in runs})  # a runs.csv without them: '-'
    df = per_cell(runs, "step_time_p50", "median")
    for c in cols:
        df = df.merge(per_cell(runs, c, "max" if c == "steps" else "mean")[KEYS + [c]], on=KEYS, how="left")
    df[COMPARED] = df["method"].map(lambda x: reference_method(x) or "")
    names = df["method"].map(_plain_names)
    rows = []
    for section in PEER_METHODS:
        mine = df[names.map(lambda n, s=section: s in n)]
        wanted = {(t, m, ref, o, b) for t, m, c, o, b in zip(mine["task"], mine["model"], mine[COMPARED],
                                                              mine["optimizer"], mine["batch_size"])
                  for ref in (c, *PEER_ALSO.get(section, ()))}
        compared = df[[k in wanted for k in zip(df["task"], df["model"], df["method"], df["optimizer"],
                                                df["batch_size"])]]
        rows.append(pd.concat([compared, mine]).assign(section=section))
    cell = ["task", "model", "method", "batch_size"]
    multi = df.groupby(cell)["optimizer"].transform("nunique") > 1
    rows.append(df[multi].assign(section=OPTIMIZERS_SECTION))
    out = pd.concat(rows, ignore_index=True)
    out = _with_notes(out, runs)
    out["peak_MiB"] = out["peak_bytes"] / MiB
    out["saved_MiB"] = out["activation_bytes"] / MiB
    for c in CATEGORIES:
        out[f"{c}_at_peak_MiB"] = out[f"peak_{c}_bytes"] / MiB
    both = out["activations_at_peak_MiB"] + out["temporaries_at_peak_MiB"]  # a peak from the allocator's events:
    out["activations_and_temporaries_at_peak_MiB"] = both.fillna(       # the two not apart
        out["peak_activations_and_temporaries_bytes"] / MiB)
    out["step_ms_p50"] = out["step_time_p50"] * 1e3
    out["_order"] = [0 if reference_method(x) is None else 1 if sec not in _plain_names(x) else 2
                     for x, sec in zip(out["method"], out["section"])]
    out = out.sort_values(["section", "task", "model", "batch_size", "_order", "method", "optimizer"],
                          key=lambda c: c.map({s: i for i, s in enumerate(PEER_METHODS + (OPTIMIZERS_SECTION,))})
                          if c.name == "section" else c, kind="stable")
    keep = ["section"] + KEYS + ["status", "steps", COMPARED, "peak_MiB", "saved_MiB",
                                 *[f"{c}_at_peak_MiB" for c in CATEGORIES], "activations_and_temporaries_at_peak_MiB",
                                 "step_ms_p50", "final_loss", "notes"]
    return out[keep].reset_index(drop=True)


def peers_layout(df: pd.DataFrame, runs: pd.DataFrame, notes: Footnotes) -> list[Part]:
    """One part per section, each a snippets section of its name (docs/methods/<name>.md includes it)."""
    parts = []
    for section, sub in df.groupby("section", sort=False):
        rows = []
        for d in sub.to_dict("records"):
            k = _keys(d, notes)
            row = {**k, "peak (MiB)": _num(d["peak_MiB"], ".1f")}
            if section == OPTIMIZERS_SECTION:
                row.update({"gradients at peak (MiB)": _num(d["gradients_at_peak_MiB"], ".2f"),
                            "optimizer state (MiB)": _num(d["optimizer_state_at_peak_MiB"], ".2f"),
                            "activations and temporaries at peak (MiB)":
                                _num(d["activations_and_temporaries_at_peak_MiB"], ".2f")})
            else:
                row["saved for backward (MiB)"] = _num(d["saved_MiB"], ".2f")
            row.update({step_time_label(runs).split(",")[0] + ", p50 (ms)": _num(d["step_ms_p50"], ".1f"),
                        "final loss": _num(d["final_loss"], ".6f")})
            rows.append(row)
        title = ("Each optimizer on the same cell" if section == OPTIMIZERS_SECTION
                 else f"{section} beside the method it is compared with")
        parts.append(Part(title, pd.DataFrame(rows), section=section))
    return parts


RUN_TABLES = {"memory": memory_table, "speed": speed_table, "accuracy": accuracy_table,
              "accuracy_short": accuracy_short_table, "peers": peers_table}
TITLES = {name: catalogue.RUN_TABLE[name].title for name in RUN_TABLES}
CPU_OPS = {"cpu": "CPU fast path", "torch": "PyTorch reference ops"}  # what a record's ops_backend ran on a CPU
CPU_TIME = "CPU step time, {ops} (this machine)"  # what a step time measured on a CPU is: cpu_time(runs)
TIME = "{time}"  # where a caption names the step time (step_time_label)
NO_GPU = "—, no GPU run yet"  # the GPU column until benchmarks/gpu_run.py has written results/gpu/
GPU_RESULTS = HERE.parents[1] / "results" / "gpu"  # benchmarks/gpu_run.py --out (docs/gpu-run.md)
RATIO_NOTE = ("Ratios divide by the compared method (vs …: lora+X against lora, every other method against "
              "baseline; same task, model, optimizer and batch size); paper: the same ratio as published, ours / "
              "paper = 1 where we reproduce it; '-' = no number for this row's setting (a paper value is shown only "
              "beside rows of the models and LoRA targets it was measured on: workflow/resources/paper_claims.yaml).")
CAPTIONS = {
    "memory": "Peak memory of one training step and the activation bytes saved for backward, in MiB (mean over "
              "seeds), and as ratios to the compared method (below 1 = the method saves memory). " + RATIO_NOTE,
    "speed": f"{TIME}: step time in ms (p50 over the timed steps after warm-up, median over seeds; p20–p80 "
             "beside it) and the ratio to the compared method (above 1 = slower) with its spread p20/p80 … p80/p20; "
             "within noise = yes when that spread contains 1 (the two cannot be told apart on this machine). "
             "Not comparable with the papers' GPU throughput, which is shown apart, beside the FLOP ratio.",
    "accuracy": "Evaluation metric of the cells long enough to learn (per task the batch size with the most seeds, "
                "then the longest training): accuracy in % (higher is better), perplexity per byte (lower is "
                "better); mean ± sample std and min … max over seeds; change = mean minus the compared method's, "
                "in the metric's unit (points of % for accuracy). " + RATIO_NOTE,
    "accuracy_short": "The metric of the short cells (a few steps, run for memory and step time): too short to "
                      "learn, so near chance (10 % on mnist5k) — not an accuracy comparison; accuracy in %. The "
                      "comparison is the accuracy table.",
    "peers": "The newer peers (VeLoRA, Cut Cross-Entropy, tiled MLP) each beside the method it is compared with "
             "(lora+X against lora, others against baseline; VeLoRA beside LoRA too; same task, model, optimizer "
             "and batch size), and each optimizer on the same cell: peak memory of one training step in MiB (mean over "
             "seeds), the bytes saved for backward or the peak's split by category, the "
             f"{TIME} (p50, median over seeds) and the final training loss (equal where a method is exact).",
    "headline": "Per method against the method it is compared with (lora+X: lora; others: baseline): peak and "
                "activation memory saved in % (at the memory batch, the largest batch where both ran), the "
                f"{TIME} change in % (+ = slower; [p20 … p80] its spread) and the metric change at the accuracy "
                "batch (points of % for accuracy, perplexity per byte for the LM; paper: 0 where it claims no "
                "change); ours beside the paper's, '-' = the paper gives no number for this setting. The papers' "
                "GPU throughput claims are never set against CPU step times: they stand apart, beside the FLOP ratio.",
}


def read_runs(runs_csv: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """runs.csv -> (the rows to use, the rows of damaged records, status ``invalid``, left out)."""
    runs = pd.read_csv(runs_csv)
    bad = runs["status"].astype(str) == INVALID if "status" in runs else pd.Series(False, index=runs.index)
    return runs[~bad].reset_index(drop=True), runs[bad].reset_index(drop=True)


INVALID = "invalid"


def invalid_note(invalid: pd.DataFrame) -> list[str]:
    if not len(invalid):
        return []
    return [f"Left out: {len(invalid)} damaged record(s) (status invalid in runs.csv; a rerun of the pipeline "
            f"remakes them): {', '.join(map(str, invalid['record'].head(5)))}{' ...' if len(invalid) > 5 else ''}"]


def _fmt_value(col: str, v) -> str:
    if pd.isna(v):
        return "-"
    if (col.startswith("metric_") and not col.startswith("metric_ratio")) or col == "change_vs_compared":
        return f"{v:+.2f}" if "change" in col else f"{v:.2f}"  # accuracy in % and perplexity alike
    if "%" in col or "MiB" in col.split("_") or col.endswith("MB") or col.endswith("_pct"):
        return f"{v:+.1f}" if "change" in col else f"{v:.1f}"
    if "_ms_" in col or col.endswith("_ms"):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"


def _fmt(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            if c in ("seeds", "steps", "memory_batch", "accuracy_batch"):
                out[c] = out[c].map(lambda v: "-" if pd.isna(v) else str(int(v)))
            else:
                out[c] = out[c].map(lambda v, c=c: _fmt_value(c, v))
        else:
            out[c] = out[c].map(lambda v: "-" if v is None or (isinstance(v, float) and np.isnan(v)) else v)
    return out


def write(df: pd.DataFrame, md: Path, csv: Path, layout: Layout, html: Path | None = None) -> None:
    """One table as CSV (every column of ``df``, for tools), Markdown and (given ``html``) HTML (``layout``: what a
    person reads), each written atomically."""
    layout.check()
    atomic_write(csv, df.to_csv(index=False))
    if html is not None:
        atomic_write(html, page(layout))
    atomic_write(md, markdown(layout))


def devices(runs: pd.DataFrame) -> list[str]:
    return sorted(set(runs["device"].dropna().astype(str))) if "device" in runs else []


def on_cpu(runs: pd.DataFrame) -> bool:
    """Whether every measured cell ran on a CPU (its step times are then CPU measurements: :func:`cpu_time`)."""
    devs = devices(runs)
    return not devs or all(d.lower().startswith("cpu") for d in devs)


def machine(runs: pd.DataFrame) -> str:
    """The title's machine: the records' device(s) and dtype(s)."""
    dtypes = sorted(set(runs["dtype"].dropna().astype(str))) if "dtype" in runs else []
    return f"{', '.join(devices(runs)) or 'device unknown'}, {', '.join(dtypes) or 'dtype unknown'}"


def machine_note(runs: pd.DataFrame) -> list[str]:
    """The cells behind the table and the software they ran with (the records' host, torch)."""
    counts = runs["status"].value_counts().to_dict() if len(runs) else {}
    host = ", ".join(sorted(set(runs["hostname"].dropna().astype(str)))) if "hostname" in runs else ""
    torch_v = ", ".join(sorted(set(runs["torch"].dropna().astype(str)))) if "torch" in runs else ""
    return [f"Cells: {', '.join(f'{v} {k}' for k, v in sorted(counts.items())) or 'none'}"
            + (f"; host {host}" if host else "") + (f"; torch {torch_v}" if torch_v else "") + "."]


def cpu_ops(runs: pd.DataFrame) -> str:
    """Which ops the records' CPU step times ran (:data:`CPU_OPS`, by their ``ops_backend``): records without it were
    written while the PyTorch reference was what CPU tensors ran."""
    kinds = sorted(set(runs["ops_backend"].fillna("torch").astype(str))) if "ops_backend" in runs else ["torch"]
    return " and ".join(CPU_OPS.get(k, k) for k in kinds) or CPU_OPS["torch"]


def cpu_time(runs: pd.DataFrame) -> str:
    """:data:`CPU_TIME` for these records: "CPU step time, <the ops they ran> (this machine)"."""
    return CPU_TIME.format(ops=cpu_ops(runs))


def step_time_label(runs: pd.DataFrame) -> str:
    return cpu_time(runs) if on_cpu(runs) else f"step time on {', '.join(devices(runs))}"


def caption(name: str, runs: pd.DataFrame) -> str:
    """The table's caption (:data:`CAPTIONS`) with its step time named for these records."""
    return CAPTIONS[name].replace(TIME, step_time_label(runs))


def _num(v, fmt: str = ".3f", unit: str = "") -> str:
    return "-" if v is None or pd.isna(v) else f"{v:{fmt}}{unit}"


def _keys(d: dict, notes: Footnotes, batch: str = "batch_size") -> dict:
    """The columns every run table starts with: task / model, the method (and its optimizer, status, notes as
    footnotes) against the compared method, the batch size and steps."""
    method = d["method"] + ("" if d.get("optimizer", DEFAULT_OPTIMIZER) == DEFAULT_OPTIMIZER
                            else f", {d['optimizer']}")
    vs = f" (vs {d[COMPARED]})" if d.get(COMPARED) else ""
    status = str(d.get("status", "ok"))
    flag = "" if status in ("ok", "nan", "") else f" — {status}"
    mark = notes.mark(d.get("notes", "") if isinstance(d.get("notes", ""), str) else "")
    steps = d.get("steps")
    return {"task / model": f"{d['task']} / {d['model']}", "method (vs compared)": f"{method}{vs}{flag}{mark}",
            "batch (steps)": f"{int(d[batch])}" + ("" if steps is None or pd.isna(steps) else f" ({int(steps)})")}


def _paper(v, source, notes: Footnotes, fmt=".3f") -> str:
    return "-" if pd.isna(v) else f"{v:{fmt}}{notes.mark(*str(source).split(' | '))}"


def memory_layout(df: pd.DataFrame, runs: pd.DataFrame, notes: Footnotes) -> list[Part]:
    peak, act = [], []
    for d in df.to_dict("records"):
        k = _keys(d, notes)
        peak.append({**k, "peak (MiB)": _num(d["peak_MiB"], ".1f"), "peak ratio: ours": _num(d["peak_ratio_ours"]),
                     "paper": _paper(d["peak_ratio_paper"], d["peak_source"], notes),
                     "ours / paper": _num(d["peak_ratio_ours/paper"])})
        act.append({**k, "activations (MiB)": _num(d["activation_MiB"], ".1f"),
                    "activation ratio: ours": _num(d["act_ratio_ours"]),
                    "paper": _paper(d["act_ratio_paper"], d["act_source"], notes),
                    "ours / paper": _num(d["act_ratio_ours/paper"])})
    return [Part("Peak memory of one training step", pd.DataFrame(peak)),
            Part("Activations saved for backward", pd.DataFrame(act))]


def flop_ratio(model: str, method: str, compared: str, batch_size: int, dtype: str | None, targets=None,
               rank=None) -> float:
    """FLOPs of one training step of ``method`` over ``compared``'s at a paper model's setting (fake tensors,
    :func:`lowmembp.estimator.step.estimate_by_depth` with ``flops=True``): hardware-independent, pointwise work
    counted zero (lowmembp.measurement.flops). NaN for a model the estimator does not know (a CPU stand-in)."""
    return _flop_ratio(model, method, compared, int(batch_size), dtype if isinstance(dtype, str) else None,
                       _targets_text(targets), None if rank is None or pd.isna(rank) else int(rank))


@lru_cache(maxsize=None)
def _flop_ratio(model, method, compared, batch_size, dtype, targets, rank) -> float:
    from lowmembp.estimator.step import estimate_by_depth, paper_model_name

    if paper_model_name(model) is None:
        return np.nan
    kw = dict(batch_size=batch_size, flops=True, **({"dtype": dtype} if dtype else {}))

    def count(m):
        lora = m.split("+")[0].split("@")[0] in FROZEN_BASE_METHODS
        opts = {k: v for k, v in (("targets", targets), ("rank", rank)) if v and lora}
        return estimate_by_depth(model, m, **kw, **opts)["flops"]

    return count(method) / count(compared)


def throughput_part(df: pd.DataFrame, runs: pd.DataFrame, notes: Footnotes, paper_col: str, source_col: str,
                    as_ratio) -> list[Part]:
    """The papers' GPU throughput claims for the rows of ``df`` that have one, each beside the FLOP ratio of that
    row's setting and the GPU figure (ours on a GPU where these rows ran on one, else :data:`NO_GPU`); no part
    (a footnote) when no row has a claim. ``as_ratio``: the table's step-time column as a ratio (change % -> ratio)."""
    rows = []
    claimed = df[df[paper_col].notna()] if paper_col in df else df.iloc[:0]
    for d in claimed.to_dict("records"):
        targets = d.get("opt_targets")
        fr = flop_ratio(d["model"], d["method"], d[COMPARED], d.get("batch_size", d.get("memory_batch")),
                        d.get("dtype"), targets, d.get("opt_rank")) if d.get(COMPARED) else np.nan
        gpu = NO_GPU if on_cpu(runs) else _num(as_ratio(d), ".3f")
        rows.append({"task / model": f"{d['task']} / {d['model']}",
                     "method (vs compared)": f"{d['method']} (vs {d[COMPARED]})",
                     "paper: step-time ratio (GPU)": _paper(as_ratio({"v": d[paper_col]}, "v"), d[source_col], notes),
                     "FLOP ratio (fake tensors)": _num(fr), "GPU step-time ratio (ours)": gpu})
    if not rows:
        notes.number("No row here is at a setting for which a paper states a throughput, so no GPU claim stands "
                     "beside these CPU figures; the papers' GPU throughput at their own settings, beside the FLOP "
                     "ratio and a column for GPU figures, is in the fig1 table (part: Throughput).")
        return []
    return [Part("The papers' GPU throughput claims for these rows (not CPU figures)", pd.DataFrame(rows))]


def speed_layout(df: pd.DataFrame, runs: pd.DataFrame, notes: Footnotes) -> list[Part]:
    rows = []
    for d in df.to_dict("records"):
        d["notes"] = "; ".join(x for x in str(d["notes"]).split("; ") if x and x != WITHIN_NOISE)  # a column here
        rows.append({**_keys(d, notes), "step p50 (ms)": _num(d["step_ms_p50"], ".2f"),
                     "p20–p80 (ms)": (f"{d['step_ms_p20']:.2f}–{d['step_ms_p80']:.2f}"
                                      if pd.notna(d["step_ms_p20"]) else "-"),
                     "samples/s": _num(d["samples_per_s"], ".1f"),
                     "step-time ratio to compared": _num(d["time_ratio_ours"]),
                     "ratio spread p20/p80 … p80/p20": (f"{d['time_ratio_ours_p20/p80']:.3f} … "
                                                        f"{d['time_ratio_ours_p80/p20']:.3f}"
                                                        if pd.notna(d["time_ratio_ours_p20/p80"]) else "-"),
                     "within noise": d["within_noise"] or "-"})
    return [Part(step_time_label(runs), pd.DataFrame(rows)),
            *throughput_part(df, runs, notes, "time_ratio_paper", "time_source",
                             lambda d, c="time_ratio_ours": d[c])]


def _mean_std(d: dict) -> str:
    if pd.isna(d["metric_mean"]):
        return "-"
    return f"{d['metric_mean']:.2f}" + ("" if pd.isna(d.get("metric_std")) else f" ± {d['metric_std']:.2f}")


def _metric_name(d: dict) -> str:
    return "-" if not isinstance(d.get("metric"), str) else d["metric"] + (f" ({d['unit']})" if d["unit"] == "%"
                                                                          else "")


def accuracy_layout(df: pd.DataFrame, runs: pd.DataFrame, notes: Footnotes, short: bool = False) -> list[Part]:
    rows = []
    for d in df.to_dict("records"):
        seeds = "" if pd.isna(d["seeds"]) else f", {int(d['seeds'])} seed{'s' if d['seeds'] != 1 else ''}"
        row = {**_keys(d, notes), "metric": _metric_name(d), "before fine-tuning": _num(d["metric_before"], ".2f"),
               "mean ± std": _mean_std(d),
               "min … max": ("-" if pd.isna(d["metric_min"]) else f"{d['metric_min']:.2f} … {d['metric_max']:.2f}"),
               "change vs compared": _num(d["change_vs_compared"], "+.2f")}
        row["batch (steps)"] += seeds
        if not short:
            row.update({"ratio: ours": _num(d["metric_ratio_ours"]),
                        "paper": _paper(d["metric_ratio_paper"], d["metric_source"], notes)})
        rows.append(row)
    table = pd.DataFrame(rows).rename(columns={"batch (steps)": "batch (steps, seeds)"})
    return [Part("", table)]


def run_layout(name: str, df: pd.DataFrame, runs: pd.DataFrame, notes: list[str] = ()) -> Layout:
    fn = Footnotes()
    parts = {"memory": memory_layout, "speed": speed_layout, "accuracy": accuracy_layout,
             "accuracy_short": lambda d, r, n: accuracy_layout(d, r, n, short=True),
             "peers": peers_layout}[name](df, runs, fn)
    return Layout(TITLES[name], machine(runs), caption(name, runs), parts, fn.texts, list(notes))


def run_tables(runs_csv: str | Path, outputs: dict[str, dict[str, str]]) -> None:
    """``outputs``: table name -> {"md": path, "csv": path, "html": path} (the rule's outputs)."""
    runs, invalid = read_runs(runs_csv)
    claims = load_claims()
    for name, out in outputs.items():
        df = RUN_TABLES[name](runs, claims)
        write(df, out["md"], out["csv"], run_layout(name, df, runs, machine_note(runs) + invalid_note(invalid)),
              out.get("html"))


def headline(runs_csv: str | Path, out: dict[str, str]) -> pd.DataFrame:
    """The headline table (rule headline) to ``out`` = {"md", "csv", "html"}; returns it."""
    runs, invalid = read_runs(runs_csv)
    df = headline_table(runs, load_claims())
    write(df, out["md"], out["csv"], headline_layout(df, runs, machine_note(runs) + invalid_note(invalid)),
          out.get("html"))
    return df


def _pct(v, signed=False) -> str:
    return "-" if pd.isna(v) else (f"{v:+.0f} %" if signed else f"{v:.0f} %")


def _change(v, unit) -> str:
    if pd.isna(v):
        return "-"
    return f"{v:+.1f} pt" if unit == "%" else f"{v:+.2f}"


def headline_display(df: pd.DataFrame, notes: Footnotes | None = None,
                     time_label: str = CPU_TIME.format(ops=CPU_OPS["cpu"])) -> pd.DataFrame:
    """The headline table as a person reads it: one phrase per cell, ours / paper; step time ours only (the
    papers' GPU throughput claims stand apart: :func:`headline_layout`). A method whose cells did not finish says
    so, its message a footnote (``notes``)."""
    notes = notes if notes is not None else Footnotes()
    rows = []
    on_gpu = "device" in df and any(device_kind(x) != "cpu" for x in df["device"].dropna() if x)
    paper = {k: k in df and df[k].notna().any() for k in ("peak_saved_%_paper", "activations_saved_%_paper",
                                                         "metric_change_paper")}

    def pair(ours: str, theirs: str, key: str) -> str:
        return f"{ours} / {theirs}" if paper[key] else ours

    for d in df.to_dict("records"):
        unit = d["unit"]
        before = "-" if pd.isna(d["metric_compared"]) else (
            f"{d['metric_compared']:.1f} → {d['metric_method']:.1f} %" if unit == "%"
            else f"{d['metric_compared']:.2f} → {d['metric_method']:.2f}")
        noise = " (within noise)" if d["within_noise"] == "yes" else ""
        spread = ("" if pd.isna(d["step_time_change_%_p20/p80"]) else
                  f" [{d['step_time_change_%_p20/p80']:+.0f} … {d['step_time_change_%_p80/p20']:+.0f}]")
        status = str(d.get("status", "ok"))
        flag = "" if status in ("ok", "nan", "") else f" — {status}"
        msg = d.get("notes", "")
        rows.append({
            "task / model": f"{d['task']} / {d['model']}" + (f" ({d.get('device') or '?'})" if on_gpu else ""),
            "method (compared with)": (f"{d['method']}"
                                       + ("" if d["optimizer"] == DEFAULT_OPTIMIZER else f", {d['optimizer']}")
                                       + f" (vs {d[COMPARED]}){flag}"
                                       + notes.mark(msg if isinstance(msg, str) else "")),
            "peak memory saved" + (": ours / paper" if paper["peak_saved_%_paper"] else " (no paper figure)"):
                pair(_pct(d["peak_saved_%_ours"]), _pct(d["peak_saved_%_paper"]), "peak_saved_%_paper"),
            "activations saved" + (": ours / paper" if paper["activations_saved_%_paper"] else
                                   " (no paper figure)"):
                pair(_pct(d["activations_saved_%_ours"]), _pct(d["activations_saved_%_paper"]),
                     "activations_saved_%_paper"),
            f"{time_label}: change (%) [p20 … p80]": f"{_pct(d['step_time_change_%_ours'], True)}{spread}{noise}",
            "metric change" + (": ours / paper" if paper["metric_change_paper"] else " (no paper figure)"):
                pair(_change(d["metric_change_ours"], unit), _change(d["metric_change_paper"], unit),
                     "metric_change_paper"),
            "metric (compared → method)": (f"{d['metric']} {before}" if d["metric"] else "-"),
            "batch (memory, metric)": f"{d['memory_batch']}, " + _batch_seeds(d["accuracy_batch"], d["seeds"]),
        })
    return pd.DataFrame(rows)


def headline_layout(df: pd.DataFrame, runs: pd.DataFrame, notes: list[str] = ()) -> Layout:
    fn = Footnotes()
    shown = headline_display(df, fn, step_time_label(runs))
    for s in sorted({p for v in df["sources"].dropna() for p in str(v).split(" | ") if p}):
        fn.number(f"Source of a paper value: {s}")
    claims = df.rename(columns={"memory_batch": "batch_size"}).assign(
        dtype=runs["dtype"].dropna().iloc[0] if "dtype" in runs and runs["dtype"].notna().any() else None)
    thr = throughput_part(claims, runs, fn, "step_time_change_%_paper", "sources",
                          lambda d, c="step_time_change_%_ours": 1 + d[c] / 100)
    parts = [Part("What each method saves and costs", shown), *thr]
    return Layout(catalogue.HEADLINE.title, machine(runs), caption("headline", runs), parts, fn.texts, list(notes))


def _batch_seeds(batch, seeds) -> str:
    """``"32 (2 seeds)"``; ``"-"`` without an accuracy batch, the batch alone when no seed of the method finished."""
    if pd.isna(batch):
        return "-"
    if pd.isna(seeds) or int(seeds) == 0:
        return f"{int(batch)} (no seed finished)"
    return f"{int(batch)} ({int(seeds)} seed{'s' if seeds > 1 else ''})"


REPRO_CAPTIONS = {
    "block_breakdown": "Unit: activation bytes of one block in 16-bit units of b·s·d (batch × sequence length × "
                       "width; 1 unit = 2·b·s·d bytes), by op kind; paper: the paper's idealised accounting, real: "
                       "the real timm / transformers code measured on fake tensors.",
    "fig1": "Peak memory in MiB (paper: CUDA allocator on a GPU; ours: estimated on fake tensors on the CPU); "
            "official emulated: the same step measured with the official code's choices emulated (its "
            "LoraFunction, lomem's fp32 MS-LN output), each choice's measured share in the second part; the "
            "paper's GPU throughput in the third, beside the FLOP ratio (hardware-independent) and a column for GPU "
            "figures.",
    "mesa_table": "Training memory in MB as the Mesa README gives it, ours estimated on fake tensors; `ratio` = "
                  "ours / paper.",
    "tokentune_memory": "Peak memory of a training step in MiB per batch size (fake tensors on the CPU).",
    "stacked": "Each row adds one lever to the row above (or puts one in place of another, as it says); GiB at the "
               "peak of one steady step by category, estimated on fake tensors (temporaries include the batch); "
               "`change_%` against the row above; `host_GiB` what offloading holds in host memory; "
               "`measured / estimated` the same row at hidden 128, 2 blocks: the CPU allocator over the estimate.",
    "compiled_saving": "Saved-for-backward KiB of one training forward of small random models, real tensors on the "
                       "CPU (not fake tensors), fp32, eager and under torch.compile; `*_saving_%` against the "
                       "baseline in the same mode, `kept_%` = compiled saving / eager saving.",
    "compiled_budget": "Saved-for-backward KiB of one training forward of small random models, real tensors on the "
                       "CPU, fp32: eager (accountant) and compiled at each `memory_budget` (torch's "
                       "activation_memory_budget; inductor's partitioner, per saved tensor); `saving_%` against the "
                       "eager baseline; `step_ms` median CPU forward + backward time, `step_vs_eager` / the eager "
                       "baseline's (a shared CPU: indicative); `timed_KiB` the timed model's own count.",
    "lowmembp_headline": "Peak of one training step without / with LowMemoryBP at the paper's settings (fake "
                         "tensors); saving in %, the paper's beside ours and ours / paper; official run: the same "
                         "step as the official QLoRA run holds memory (LLaMA rows); band: the paper's stated "
                         "'20–30 %'.",
    "stacked_full": "GiB at the peak of one steady training step, by category (temporaries include the batch), "
                    "estimated on fake tensors with the real transformers / timm code; `measured / estimated`: the "
                    "same row at a small width measured by the CPU allocator (- where the optimizer needs CUDA).",
    "lever_estimates": "Each part one lever's page: the peak of one steady training step and the bytes saved for "
                       "backward by one forward, in GiB, and the peak's split by category at that moment "
                       "(lowmembp.measurement.peak; temporaries include the batch), estimated on fake tensors with "
                       "the real transformers LLaMA code at LLaMA-7B's shapes.",
    "grad_fidelity": "One training step of real weights on a real batch, CPU. `cos_*`: cosine of the whole gradient "
                     "(every tensor the method trains) with its exact reference's; `rel_err_*`: ||g - g_exact|| / "
                     "||g_exact|| (0 = bit-identical); `blocks_*`: the transformer blocks' tensors alone (no "
                     "embeddings, no head); `worst_depth`: the depth (embed, block index, head) with the largest fp32 "
                     "relative error, `worst_rel_err` that error. Per-depth values: the CSV and the figure.",
}
# Reproductions whose rows are data for the figure: the table shows a summary, (values, formatted) from the rows.
REPRO_TABLE_VIEWS = {"grad_fidelity": "experiments.repro.grad_fidelity:table_view"}


def gpu_step_ratios(gpu_dir: Path = GPU_RESULTS) -> dict[tuple[str, str], float]:
    """(setting, method) -> GPU step time / LoRA's from benchmarks/gpu_run.py's ``fig1.csv`` (``fig1-qkv`` ->
    lora_qv, ``fig1-all`` -> lora_all; p50 step ms); empty until a GPU run's results are there."""
    path = Path(gpu_dir) / "fig1.csv"
    if not path.is_file():
        return {}
    g = pd.read_csv(path)
    g = g[(g["status"] == "ok") & g["step_ms_p50"].notna()]
    out = {}
    for config, sub in g.groupby("config"):
        setting = {"fig1-qkv": "lora_qv", "fig1-all": "lora_all"}.get(config, config)
        ms = sub.set_index("method")["step_ms_p50"].astype(float)
        if "lora" in ms:
            out.update({(setting, m): v / ms["lora"] for m, v in ms.items()})
    return out


def fig1_layout(df: pd.DataFrame, notes: Footnotes, gpu_dir: Path = GPU_RESULTS) -> list[Part]:
    """Fig. 1 as three tables: peak memory (paper, ours, the official code emulated), where ours and the official
    code differ (measured MiB), and throughput (the paper's GPU claim beside the FLOP ratio and the GPU run)."""
    mem, diff, thr = [], [], []
    gpu = gpu_step_ratios(gpu_dir)
    for d in df.to_dict("records"):
        setting = str(d["setting"])
        key = {"setting": setting, "method": d["method"] + notes.mark(d.get("note", ""))}
        mem.append({**key, "paper (MiB)": _num(d["paper_MiB"], ".0f") + notes.mark(d.get("paper_source", "")),
                    "ours (MiB)": _num(d["ours_MiB"], ".1f"), "ours / paper": _num(d["ratio"]),
                    "official emulated (MiB)": _num(d["official_code_MiB"], ".1f"),
                    "emulated / paper": _num(d["official_ratio"]),
                    "saved vs LoRA, paper / ours / emulated (%)": (f"{d['paper_saving_%']:.1f} / "
                                                                   f"{d['ours_saving_%']:.1f} / "
                                                                   f"{d['official_saving_%']:.1f}")})
        diff.append({**key, "their LoraFunction (MiB)": _num(d["diff_lora_function_MiB"], "+.1f"),
                     "fp32 MS-LN output (MiB)": _num(d["diff_msln_fp32_MiB"], "+.1f"),
                     "both beyond their sum (MiB)": _num(d["diff_interaction_MiB"], "+.1f"),
                     "unexplained: paper − emulated (MiB)": _num(d["unexplained_MiB"], "+.1f"),
                     "saved for backward: ours / emulated (MiB)": (f"{d['saved_for_backward_MiB']:.1f} / "
                                                                   f"{d['official_saved_for_backward_MiB']:.1f}"),
                     "parameters (MiB)": _num(d["params_MiB"], ".1f"),
                     "activations at peak (MiB)": _num(d["activations_at_peak_MiB"], ".1f")})
        if "(default)" in setting:  # the paper's throughput is its own setting's (lora_qv)
            plain = setting.split(" ")[0]
            g = gpu.get((plain, d["spec"]))
            thr.append({**key, "paper (GPU, img/s)": _num(d["paper_img_per_s"], ".0f"),
                        "paper: step-time ratio to LoRA (GPU)": _num(d.get("paper_step_time_ratio", np.nan)),
                        "FLOP ratio to LoRA (fake tensors)": _num(d.get("flop_ratio", np.nan)),
                        "training step (GFLOP)": _num(d.get("step_GFLOP", np.nan), ".0f"),
                        "GPU step-time ratio to LoRA (ours)": NO_GPU if g is None else f"{g:.3f}"})
    thr_note = notes.mark(
        "Throughput: the paper's is images over the epoch's wall time on one GPU, data loading included; "
        "its step-time ratio = LoRA's img/s / the method's. The FLOP ratio counts one training step "
        "(forward, backward with any recomputation, optimizer) with torch's formulas on the real model code "
        "on fake tensors; pointwise work (activations, norms, quantisation) counts zero, so it is a "
        "compute-bound estimate, not a time. The GPU column is read from results/gpu/fig1.csv "
        "(benchmarks/gpu_run.py, docs/gpu-run.md): p50 step time / LoRA's, the setting lora_qv. No CPU "
        "step time is set against the paper's GPU figures.")
    parts = [Part("Peak memory", pd.DataFrame(mem)),
             Part("Where ours and the official code differ: each difference measured alone", pd.DataFrame(diff))]
    if thr:
        parts.append(Part("Throughput: the paper's GPU claim, the FLOP ratio and GPU figures" + thr_note,
                          pd.DataFrame(thr)))
    return parts


def lowmembp_headline_layout(df: pd.DataFrame, notes: Footnotes) -> list[Part]:
    rows = []
    for d in df.to_dict("records"):
        paper, ours = d["paper_saving_pct"], d["ours_saving_pct"]
        off = d.get("official_run_saving_pct")
        rows.append({"model (setting)": d["model"] + notes.mark(d.get("note", ""), d.get("spec", "")),
                     "paper saving (%)": _num(paper, ".1f") + notes.mark(d.get("paper_source", "")),
                     "ours saving (%)": _num(ours, ".1f"),
                     "ours / paper": _num(ours / paper if pd.notna(paper) and paper else np.nan),
                     "without (MiB)": _num(d["baseline_MiB"], ".0f"), "with LowMemoryBP (MiB)": _num(d["lowmembp_MiB"],
                                                                                                   ".0f"),
                     "official run saving (%)": _num(off, ".1f"),
                     "official run without / with (MiB)": ("-" if pd.isna(d.get("official_run_baseline_MiB"))
                                                           else f"{d['official_run_baseline_MiB']:.0f} / "
                                                                f"{d['official_run_lowmembp_MiB']:.0f}"),
                     f"in the paper's {d['band_low_pct']:.0f}–{d['band_high_pct']:.0f} % band": (
                         "yes" if str(d["in_band"]) == "True" else "no")})
    return [Part("", pd.DataFrame(rows))]


REPRO_UNITS = {"block_breakdown": "2·b·s·d B"}  # a reproduction's unit where its columns' names carry none


def generic_layout(df: pd.DataFrame, notes: Footnotes, unit: str = "") -> list[Part]:
    """Any other reproduction: long text (notes, specs, sources) as footnotes marked on the row's first cell,
    the rest rounded, the headers with their units (:func:`table_layout.header`; ``unit`` for numbers whose name
    has none) and split into parts of at most :data:`MAX_COLUMNS` columns (the text columns repeated)."""
    long = long_text_columns(df)
    shown = _fmt(df.drop(columns=long))
    if len(shown.columns):
        first = shown.columns[0]
        shown[first] = [f"{v}{notes.mark(*[str(r[c]) for c in long if pd.notna(r[c])])}"
                        for v, (_, r) in zip(shown[first], df.iterrows())]
    keys = [c for c in shown.columns[:3] if not pd.api.types.is_numeric_dtype(df[c])] or list(shown.columns[:1])
    names = {c: header(c, unit if pd.api.types.is_float_dtype(df[c]) and "ratio" not in c else "")
             for c in shown.columns}
    return split_columns(shown.rename(columns=names), [names[k] for k in keys])


def lever_estimates_layout(df: pd.DataFrame, notes: Footnotes) -> list[Part]:
    """One part per section (its setting as the heading), each a snippets section of its name: the method page
    (docs/methods/<section>.md) includes it alone."""
    parts = []
    for section, sub in df.groupby("section", sort=False):
        rows = []
        for d in sub.to_dict("records"):
            row = ({"optimizer": d["optimizer"]} if section == "optimizers" else {"method": d["method"]})
            row.update({"peak (GiB)": _num(d["peak_GiB"], ".2f")})
            if section != "optimizers":
                row["saved for backward (GiB)"] = _num(d["saved_GiB"], ".2f")
            row.update({f"{c.replace('_', ' ')} at peak (GiB)": _num(d[f"{c}_at_peak_GiB"], ".2f")
                        for c in CATEGORIES})
            rows.append(row)
        parts.append(Part(str(sub["setting"].iloc[0]), pd.DataFrame(rows), section=section))
    return parts


def stacked_full_layout(df: pd.DataFrame, notes: Footnotes) -> list[Part]:
    """The full-fine-tuning levers (experiments/repro/stacked_full.py): the optimizers at LLaMA-7B (snippet section
    ``optimizers``), then one stacked part per model (section ``stacked-<model>``)."""
    cats = ("weights", "gradients", "optimizer", "activations", "temporaries")
    parts = []
    for (part, model), sub in df.groupby(["part", "model"], sort=False):
        rows = []
        if part == "compact":
            for d in sub.to_dict("records"):
                rows.append({"method": d["lever"], "saved for backward (GiB)": _num(d["saved_GiB"], ".2f"),
                             "one block (GiB)": _num(d["block_saved_GiB"], ".3f"),
                             "saved / baseline's": _num(d["saved_vs_baseline"], ".3f"),
                             "peak (GiB)": _num(d["peak_GiB"], ".2f"),
                             "activations at peak (GiB)": _num(d["activations_GiB"], ".2f"),
                             "measured / estimated (small width)": _num(d.get("measured / estimated"), ".3f")})
            parts.append(Part(f"{model}: CompAct and LowMemoryBP, alone and together", pd.DataFrame(rows),
                              section=f"compact-{model}"))
            continue
        for d in sub.to_dict("records"):
            row = {"optimizer" if part == "optimizers" else "lever": d["lever"]}
            if part != "optimizers":
                row["category"] = d["category"]
            row["peak (GiB)"] = _num(d["peak_GiB"], ".2f")
            if part == "optimizers":
                row["state / AdamW's"] = _num(d.get("state_vs_adamw"), ".3f")
            else:
                row["change"] = _num(d.get("change_%"), "+.1f", " %")
            row.update({f"{c} (GiB)": _num(d[f"{c}_GiB"], ".2f") for c in cats})
            if part != "optimizers":
                row["measured / estimated (small width)"] = _num(d.get("measured / estimated"), ".3f")
            rows.append(row)
        title = ("LLaMA-7B full fine-tuning, batch 1 × 512, bf16 weights and autocast, per optimizer"
                 if part == "optimizers" else f"{model}: one lever at a time")
        parts.append(Part(title, pd.DataFrame(rows), section="optimizers" if part == "optimizers"
                          else f"stacked-{model}"))
    return parts


REPRO_LAYOUTS = {"fig1": fig1_layout, "lowmembp_headline": lowmembp_headline_layout,
                 "lever_estimates": lever_estimates_layout, "stacked_full": stacked_full_layout}


def repro_machine(repro) -> str:
    """The title's machine of a reproduction: how its numbers were made (fake tensors need no device)."""
    return repro.how if repro is not None else "not stated"


def repro_table(name: str, repro_csv: str | Path, out: dict[str, str], title: str | None = None) -> None:
    """A reproduction's rows (experiments.repro: paper value, ours, ratio and a note already side by side) -> table.

    A table without a ``ratio`` column gets one (ours / paper) from its first numeric ``paper...`` / ``ours...``
    pair."""
    import platform

    df = pd.read_csv(repro_csv)
    repro = catalogue.REPRO_BY_STEM.get(name)
    caption = REPRO_CAPTIONS.get(name, "")
    shown = None
    if name in REPRO_TABLE_VIEWS:
        import importlib
        module, fn = REPRO_TABLE_VIEWS[name].split(":")
        df, shown = getattr(importlib.import_module(module), fn)(df)
    if "ratio" not in df.columns:
        num = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]
        p = next((c for c in num if c.startswith("paper")), None)
        o = next((c for c in num if c.startswith("ours")), None)
        if p and o:
            df.insert(df.columns.get_loc(o) + 1, "ratio", df[o] / df[p])
            caption = caption or f"`ratio` = {o} / {p}."
    fn = Footnotes()
    if shown is not None:  # a summary view of the rows (REPRO_TABLE_VIEWS); the comparison rides in the method cell
        if "compared_with" in shown.columns:
            shown = shown.assign(method=shown["method"] + " (vs " + shown.pop("compared_with") + ")")
        parts = split_columns(shown, list(shown.columns[:2]))
    else:
        parts = (REPRO_LAYOUTS[name](df, fn) if name in REPRO_LAYOUTS
                 else generic_layout(df, fn, REPRO_UNITS.get(name, "")))
    import torch

    made = (f"From `python -m experiments.repro {repro.name}`; table made on {platform.machine()} "
            f"({os.cpu_count()} cores), torch {torch.__version__}." if repro else "")
    write(df, out["md"], out["csv"], Layout(title or (repro.title if repro else name.replace("_", " ")),
                                            repro_machine(repro), caption, parts, fn.texts, [made] if made else []),
          out.get("html"))


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
    elif sys.argv[1] == "headline":
        headline(sys.argv[2], _in(sys.argv[3], catalogue.HEADLINE.name))
    else:
        stem = sys.argv[2].replace("-", "_")
        repro_table(stem, sys.argv[3], _in(sys.argv[4], stem), catalogue.REPRO_BY_STEM[stem].title
                    if stem in catalogue.REPRO_BY_STEM else None)

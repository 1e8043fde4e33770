"""The sweep's tables as numbers: runs.csv -> one frame per table (:data:`RUN_TABLES`, and the headline), every column
a tool reads (the CSV); sweep_layouts.py shows them to people.

Every table of the sweep puts ours beside the paper's value: ratios to the method a row is compared with
(``compared_with``: ``lora+X`` against ``lora``, every other method against ``baseline``, same task, model and batch
size), the papers' ratios (paper_claims.py), and ``ours/paper``. Column names say what a number is: ``*_MiB`` /
``*_ms`` / ``*_%`` carry their unit, ``*_ratio_ours`` and ``*_ratio_paper`` are ratios of this method to
``compared_with`` (below 1: less memory, less time), ``*_ours/paper`` is our ratio over the paper's.

- memory: peak and activation memory per cell;
- speed: step time p50 with its p20–p80 spread; the ratio's spread (p20 / compared p80 … p80 / compared p20) and
  ``within_noise`` (yes when that spread contains 1: on this machine the two cannot be told apart);
- accuracy: the evaluation metric of the cells long enough to learn (per task the batch size with the most seeds,
  then the longest training: :func:`accuracy_batch_size`, the rule the accuracy figure uses), accuracy in %;
- accuracy_short: the same for the other cells (the few-step memory/speed cells): near chance, not a comparison;
- headline (:func:`headline_table`, rule ``headline``): per method what it saves, what it costs in step time and
  what it changes in the metric, ours beside the papers'.

Rows of runs.csv with status ``invalid`` (a damaged record) are left out (:func:`read_runs`) and counted in the
table's note.
"""
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # the library
    sys.path.insert(0, str(HERE.parents[1]))
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER  # noqa: E402  (a record without an optimizer: this one)
from paper_claims import add_paper  # noqa: E402

MiB = 2**20
KEYS = ["task", "model", "method", "optimizer", "batch_size"]  # a cell (_complete: no optimizer column = the default)
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


def _status(s: pd.Series) -> str:
    vals = sorted(set(s.dropna().astype(str)))
    return vals[0] if len(vals) == 1 else "/".join(vals)


def _first(s: pd.Series):
    s = s.dropna()
    return s.iloc[0] if len(s) else np.nan


def per_cell(runs: pd.DataFrame, value: str, how: str = "mean") -> pd.DataFrame:
    """One row per (task, model, method, batch size): the value over ok seeds, the cell's status and its LoRA
    ``opt_targets`` (the setting a paper value must match, :func:`paper_claims.claim`) where the runs have that
    column."""
    ok = runs[runs["status"] == "ok"]
    agg = ok.groupby(KEYS, dropna=False)[value].agg(how).rename(value)
    status = runs.groupby(KEYS, dropna=False)["status"].agg(_status)
    parts = [status, agg]
    if "opt_targets" in runs and value != "opt_targets":
        parts.append(runs.groupby(KEYS, dropna=False)["opt_targets"].agg(_first))
    return pd.concat(parts, axis=1).reset_index()


OPTIONAL = ("steps", "step_time_p20", "step_time_p80", "samples_per_s", "message", "dtype")


def _complete(runs: pd.DataFrame) -> pd.DataFrame:
    """runs with the optional columns a hand-made or older runs.csv may lack (as NaN; the optimizer as the default)."""
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
                     .astype(object).fillna("").astype(str).str.slice(0, 80))
    notes = msg.groupby(KEYS, dropna=False)["m"].agg(lambda s: "; ".join(dict.fromkeys(s))).rename("notes")
    return notes.reset_index()


def _with_notes(df: pd.DataFrame, runs: pd.DataFrame, extra: pd.Series | None = None) -> pd.DataFrame:
    df = df.merge(_notes(runs), on=KEYS, how="left")
    df["notes"] = df["notes"].fillna("")
    if extra is not None:
        df["notes"] = [("; ".join(x for x in (a, b) if x)) for a, b in zip(extra.fillna(""), df["notes"])]
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


RUN_TABLES = {"memory": memory_table, "speed": speed_table, "accuracy": accuracy_table,
              "accuracy_short": accuracy_short_table, "peers": peers_table}


INVALID = "invalid"


def read_runs(runs_csv: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """runs.csv -> (the rows to use, the rows of damaged records, status ``invalid``, left out)."""
    runs = pd.read_csv(runs_csv)
    bad = runs["status"].astype(str) == INVALID if "status" in runs else pd.Series(False, index=runs.index)
    return runs[~bad].reset_index(drop=True), runs[bad].reset_index(drop=True)


def devices(runs: pd.DataFrame) -> list[str]:
    return sorted(set(runs["device"].dropna().astype(str))) if "device" in runs else []


def on_cpu(runs: pd.DataFrame) -> bool:
    """Whether every measured cell ran on a CPU (its step times are then CPU measurements:
    :func:`sweep_layouts.cpu_time`)."""
    devs = devices(runs)
    return not devs or all(d.lower().startswith("cpu") for d in devs)

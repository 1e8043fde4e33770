"""How the sweep's tables read: table_maths.py's frames -> a :class:`table_layout.Layout` each (:func:`run_layout`,
:func:`headline_layout`), what a person reads beside the CSV's every column.

A title that says what (workflow/catalogue.py) and on which machine (the records' device and dtype), a machine line,
a caption (:data:`CAPTIONS`), parts of at most ten columns with units in the headers, and long notes, messages and
the papers' sources as numbered footnotes. Step times measured on a CPU are labelled :func:`cpu_time` (which ops ran:
the records' ``ops_backend``) and never share a column with the papers' GPU throughput claims: those stand in a part
of their own (:func:`throughput_part`), beside the FLOP ratio of the row's setting (paper_claims.flop_ratio, fake
tensors) and a GPU column (:data:`NO_GPU` until benchmarks/gpu_run.py has written results/gpu/).
"""
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
for _p in (HERE.parent, HERE.parents[1]):  # the catalogue, the library
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import catalogue  # noqa: E402
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER  # noqa: E402
from paper_claims import flop_ratio  # noqa: E402
from table_layout import Footnotes, Layout, Part, format_number  # noqa: E402
from table_maths import (COMPARED, OPTIMIZERS_SECTION, RUN_TABLES, WITHIN_NOISE, device_kind, devices,  # noqa: E402
                         on_cpu)

TITLES = {name: catalogue.RUN_TABLE[name].title for name in RUN_TABLES}
CPU_OPS = {"cpu": "CPU fast path", "torch": "PyTorch reference ops"}  # what a record's ops_backend ran on a CPU
CPU_TIME = "CPU step time, {ops} (this machine)"  # what a step time measured on a CPU is: cpu_time(runs)
TIME = "{time}"  # where a caption names the step time (step_time_label)
NO_GPU = "—, no GPU run yet"  # the GPU column until benchmarks/gpu_run.py has written results/gpu/
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


def invalid_note(invalid: pd.DataFrame) -> list[str]:
    if not len(invalid):
        return []
    return [f"Left out: {len(invalid)} damaged record(s) (status invalid in runs.csv; a rerun of the pipeline "
            f"remakes them): {', '.join(map(str, invalid['record'].head(5)))}{' ...' if len(invalid) > 5 else ''}"]


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
        peak.append({**k, "peak (MiB)": format_number(d["peak_MiB"], ".1f"),
                     "peak ratio: ours": format_number(d["peak_ratio_ours"]),
                     "paper": _paper(d["peak_ratio_paper"], d["peak_source"], notes),
                     "ours / paper": format_number(d["peak_ratio_ours/paper"])})
        act.append({**k, "activations (MiB)": format_number(d["activation_MiB"], ".1f"),
                    "activation ratio: ours": format_number(d["act_ratio_ours"]),
                    "paper": _paper(d["act_ratio_paper"], d["act_source"], notes),
                    "ours / paper": format_number(d["act_ratio_ours/paper"])})
    return [Part("Peak memory of one training step", pd.DataFrame(peak)),
            Part("Activations saved for backward", pd.DataFrame(act))]


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
        gpu = NO_GPU if on_cpu(runs) else format_number(as_ratio(d), ".3f")
        rows.append({"task / model": f"{d['task']} / {d['model']}",
                     "method (vs compared)": f"{d['method']} (vs {d[COMPARED]})",
                     "paper: step-time ratio (GPU)": _paper(as_ratio({"v": d[paper_col]}, "v"), d[source_col], notes),
                     "FLOP ratio (fake tensors)": format_number(fr), "GPU step-time ratio (ours)": gpu})
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
        rows.append({**_keys(d, notes), "step p50 (ms)": format_number(d["step_ms_p50"], ".2f"),
                     "p20–p80 (ms)": (f"{d['step_ms_p20']:.2f}–{d['step_ms_p80']:.2f}"
                                      if pd.notna(d["step_ms_p20"]) else "-"),
                     "samples/s": format_number(d["samples_per_s"], ".1f"),
                     "step-time ratio to compared": format_number(d["time_ratio_ours"]),
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
        row = {**_keys(d, notes), "metric": _metric_name(d),
               "before fine-tuning": format_number(d["metric_before"], ".2f"),
               "mean ± std": _mean_std(d),
               "min … max": ("-" if pd.isna(d["metric_min"]) else f"{d['metric_min']:.2f} … {d['metric_max']:.2f}"),
               "change vs compared": format_number(d["change_vs_compared"], "+.2f")}
        row["batch (steps)"] += seeds
        if not short:
            row.update({"ratio: ours": format_number(d["metric_ratio_ours"]),
                        "paper": _paper(d["metric_ratio_paper"], d["metric_source"], notes)})
        rows.append(row)
    table = pd.DataFrame(rows).rename(columns={"batch (steps)": "batch (steps, seeds)"})
    return [Part("", table)]


def peers_layout(df: pd.DataFrame, runs: pd.DataFrame, notes: Footnotes) -> list[Part]:
    """One part per section, each a snippets section of its name (docs/methods/<name>.md includes it)."""
    parts = []
    for section, sub in df.groupby("section", sort=False):
        rows = []
        for d in sub.to_dict("records"):
            k = _keys(d, notes)
            row = {**k, "peak (MiB)": format_number(d["peak_MiB"], ".1f")}
            if section == OPTIMIZERS_SECTION:
                row.update({"gradients at peak (MiB)": format_number(d["gradients_at_peak_MiB"], ".2f"),
                            "optimizer state (MiB)": format_number(d["optimizer_state_at_peak_MiB"], ".2f"),
                            "activations and temporaries at peak (MiB)":
                                format_number(d["activations_and_temporaries_at_peak_MiB"], ".2f")})
            else:
                row["saved for backward (MiB)"] = format_number(d["saved_MiB"], ".2f")
            row.update({step_time_label(runs).split(",")[0] + ", p50 (ms)": format_number(d["step_ms_p50"], ".1f"),
                        "final loss": format_number(d["final_loss"], ".6f")})
            rows.append(row)
        title = ("Each optimizer on the same cell" if section == OPTIMIZERS_SECTION
                 else f"{section} beside the method it is compared with")
        parts.append(Part(title, pd.DataFrame(rows), section=section))
    return parts


def run_layout(name: str, df: pd.DataFrame, runs: pd.DataFrame, notes: list[str] = ()) -> Layout:
    fn = Footnotes()
    parts = {"memory": memory_layout, "speed": speed_layout, "accuracy": accuracy_layout,
             "accuracy_short": lambda d, r, n: accuracy_layout(d, r, n, short=True),
             "peers": peers_layout}[name](df, runs, fn)
    return Layout(TITLES[name], machine(runs), caption(name, runs), parts, fn.texts, list(notes))


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

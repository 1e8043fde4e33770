"""runs.csv -> the sweep's figures (results/figures/*.png), each readable alone: a title naming the device, dtype
and seeds, axes with units, a legend in words.

- memory_vs_batch: peak and activation memory (MiB) against batch size, one line per method (per method and optimizer
  where a sweep lists several ``optimizers``: "lora (adamw8bit)"; the default, AdamW, unnamed), one row per task;
  filled markers are the training cells, hollow ones the short (few-step) memory cells, a cross a cell that ran out
  of memory or failed.
- step_time_ratio: step time (p50) / the compared method's (lora+X against lora, others against baseline) at the
  largest batch where both ran; error bars the ratio's p20/p80 … p80/p20 spread; the paper's ratio as a black tick.
- accuracy: the metric of the cells long enough to learn (table_maths.accuracy_batch_size), accuracy in %: every seed a
  dot, the mean (± std over seeds where there are two or more) a black square.
- accuracy_vs_option (made when a cell's method spec carries options, e.g. config/tokentune-k.yaml's
  ``tokentune@k=2`` … ``tokentune@k=17``): per task and method the metric against the option's value (the metric's
  batch as in accuracy; dots the seeds, a line the mean ± std), the compared method (baseline: full fine-tuning) as
  a dashed line, the sequence length in the title.
- headline (:func:`headline_figure`, rule headline via headline.py): memory saved, step-time change and metric
  change per method against the compared method, ours as bars, the paper's as black diamonds.

Each figure function takes the rows of runs.csv and returns a matplotlib Figure (the notebooks show them inline;
tests read their text). The reproductions' figures are in plots_repro.py. Run by Snakemake (rule run_figure) or by
hand: ``python plots.py RUNS.csv FIGURE_NAME OUT.png``.
"""

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
sys.path.insert(0, str(HERE))
from paper_claims import load_claims  # noqa: E402
from table_maths import (COMPARED, KEYS, _complete, MiB, PERCENT_METRICS, accuracy_batch_size,  # noqa: E402
                         headline_table, is_learning_cell, per_cell, read_runs, reference_method, speed_table)
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS  # noqa: E402

METHOD_ORDER = ["baseline", "checkpointing", "mesa-gelu-ln", "mesa", "lowmembp", "tokentune", "lora",
                "lora+lowmembp"]


def _method_key(method: str) -> tuple:
    """METHOD_ORDER first, the others by name; a spec with options (``tokentune@k=4``) right after its method, by
    the options' values (k 2 before k 17)."""
    from lowmembp.methods.registry import plain_spec, spec_options

    try:
        plain, opts = plain_spec(method), spec_options(method)
    except ValueError:
        plain, opts = method, {}
    rank = METHOD_ORDER.index(plain) if plain in METHOD_ORDER else len(METHOD_ORDER)
    values = tuple((k, float(v) if isinstance(v, (int, float)) else np.inf, str(v)) for k, v in sorted(opts.items()))
    return rank, plain, values


def _methods(df: pd.DataFrame) -> list[str]:
    return sorted(dict.fromkeys(df["method"]), key=_method_key)


def series_name(method: str, optimizer) -> str:
    """One line / bar of a figure: the method, and its optimizer when that is not the default (AdamW), so a sweep
    with several ``optimizers`` draws one per (method, optimizer)."""
    return method if pd.isna(optimizer) or optimizer == DEFAULT_OPTIMIZER else f"{method} ({optimizer})"


def with_series(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``series`` (:func:`series_name`) per row (the optimizer read as the default where missing)."""
    opt = df["optimizer"] if "optimizer" in df else pd.Series(DEFAULT_OPTIMIZER, index=df.index)
    return df.assign(series=[series_name(m, o) for m, o in zip(df["method"], opt)])


def _series(df: pd.DataFrame) -> list[str]:
    """The series of ``df`` (see :func:`with_series`), by method as :func:`_methods`, then the optimizers' order."""
    opt = df["optimizer"].fillna(DEFAULT_OPTIMIZER) if "optimizer" in df else [DEFAULT_OPTIMIZER] * len(df)
    keys = {series_name(m, o): (_method_key(m), list(OPTIMIZERS).index(o) if o in OPTIMIZERS else len(OPTIMIZERS), o)
            for m, o in zip(df["method"], opt)}
    return sorted(keys, key=keys.get)


def _colors(methods):
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    return {m: cmap(i % cmap.N) for i, m in enumerate(methods)}


def _task_label(task, model):
    return f"{task} / {model}"


def seeds_text(n) -> str:
    """'1 seed', '2 seeds'; 'no seed finished' for 0 or no count (NaN: every cell of the method failed)."""
    if pd.isna(n) or int(n) == 0:
        return "no seed finished"
    n = int(n)
    return f"{n} seed" if n == 1 else f"{n} seeds"


def measured_on(runs: pd.DataFrame) -> str:
    """'cpu (x86_64, 1 threads), fp32': the device(s) and dtype(s) of the rows."""
    devs = sorted(set(runs["device"].dropna().astype(str))) if "device" in runs else []
    dtypes = sorted(set(runs["dtype"].dropna().astype(str))) if "dtype" in runs else []
    return f"{', '.join(devs) or 'device unknown'}, {', '.join(dtypes) or 'dtype unknown'}"


def _steps_text(steps) -> str:
    vals = sorted({int(s) for s in steps if pd.notna(s)})
    return "/".join(map(str, vals)) or "?"


def memory_vs_batch(runs: pd.DataFrame) -> plt.Figure:
    runs = _complete(runs)
    tasks = runs[["task", "model"]].drop_duplicates().values.tolist()
    methods = _series(runs)
    colors = _colors(methods)
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.3 * len(tasks) + 1.2), squeeze=False)
    peak = with_series(per_cell(runs, "peak_bytes"))
    act = with_series(per_cell(runs, "activation_bytes"))
    steps = per_cell(runs, "steps", "max")[KEYS + ["steps"]]
    learn = is_learning_cell(peak, runs)
    peak = peak.assign(learning=learn.to_numpy()).merge(steps, on=KEYS, how="left")
    act = act.assign(learning=learn.to_numpy()).merge(steps, on=KEYS, how="left")
    for row, (task, model) in enumerate(tasks):
        for col, (df, what) in enumerate([(peak, "peak_bytes"), (act, "activation_bytes")]):
            ax = axes[row, col]
            sub = df[(df["task"] == task) & (df["model"] == model)]
            top = np.nanmax(sub[what].to_numpy(dtype=float) / MiB) if sub[what].notna().any() else 1.0
            for m in methods:
                s = sub[sub["series"] == m].sort_values("batch_size")
                if s.empty:
                    continue
                ax.plot(s["batch_size"], s[what] / MiB, color=colors[m], lw=1.2, label=m)
                for learning, face in ((True, colors[m]), (False, "white")):
                    p = s[s["learning"] == learning]
                    ax.scatter(p["batch_size"], p[what] / MiB, marker="o", s=28, facecolor=face,
                               edgecolor=colors[m], zorder=3)
                bad = s[s["status"] != "ok"]
                if len(bad):
                    ax.scatter(bad["batch_size"], [top] * len(bad), marker="x", color=colors[m], s=60, zorder=4)
            bss = sorted(sub["batch_size"].unique())
            if len(bss) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xticks(bss, [str(b) for b in bss])
            ax.minorticks_off()
            ax.set_ylim(bottom=0, top=top * 1.12)
            ax.set_xlabel("batch size (samples per step)")
            ax.set_ylabel(("peak memory of a training step" if col == 0 else "activations saved for backward")
                          + " (MiB)", fontsize=9)
            short = _steps_text(sub.loc[~sub["learning"], "steps"])
            long = _steps_text(sub.loc[sub["learning"], "steps"])
            ax.set_title(f"{_task_label(task, model)}: {'peak' if col == 0 else 'activations'}\n"
                         f"filled: training cells ({long} steps); hollow: memory cells ({short} steps)"
                         if (~sub["learning"]).any() else f"{_task_label(task, model)}: "
                         f"{'peak' if col == 0 else 'activations'} ({long} steps)", fontsize=9)
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if (~peak["learning"]).any():
        handles += [Line2D([], [], marker="o", color="0.3", ls="", label="training cell (filled)"),
                    Line2D([], [], marker="o", color="0.3", mfc="white", ls="", label="short memory cell (hollow)")]
    handles += [Line2D([], [], marker="x", color="0.3", ls="", label="ran out of memory / failed")]
    labels = [h.get_label() for h in handles]
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.985))
    fig.suptitle(f"Peak and activation memory (MiB) against batch size, mean over seeds — {measured_on(runs)}",
                 fontsize=11, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.65 / fig.get_figheight()))
    return fig


def _time_ratios(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (task, model, method): the speed table's row at the largest batch where the method and the one it is
    compared with both finished."""
    spd = speed_table(runs, load_claims())
    spd = spd[(spd[COMPARED] != "")].dropna(subset=["time_ratio_ours"])
    if spd.empty:
        return spd
    by = ["task", "model", "method"] + (["optimizer"] if "optimizer" in spd else [])
    return with_series(spd.sort_values("batch_size").groupby(by, sort=False).tail(1))


def step_time_ratio(runs: pd.DataFrame) -> plt.Figure:
    df = _time_ratios(runs)
    tasks = df[["task", "model"]].drop_duplicates().values.tolist() if len(df) else []
    methods = _series(df) if len(df) else []
    method_of = dict(zip(df["series"], df["method"])) if len(df) else {}
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(methods) * max(1, len(tasks)) / 1.5), 4.8))
    width = 0.8 / max(1, len(tasks))
    x = np.arange(len(methods))
    paper_drawn = False
    for i, (task, model) in enumerate(tasks):
        sub = df[(df["task"] == task) & (df["model"] == model)].set_index("series")
        xs = x + (i - (len(tasks) - 1) / 2) * width
        ys = np.array([sub["time_ratio_ours"].get(m, np.nan) for m in methods], dtype=float)
        lo = np.array([sub["time_ratio_ours_p20/p80"].get(m, np.nan) for m in methods], dtype=float)
        hi = np.array([sub["time_ratio_ours_p80/p20"].get(m, np.nan) for m in methods], dtype=float)
        bs = sorted(set(sub["batch_size"]))
        ax.bar(xs, ys, width, label=f"ours: {_task_label(task, model)} (batch {'/'.join(map(str, bs))})")
        ax.errorbar(xs, ys, yerr=[np.clip(ys - lo, 0, None), np.clip(hi - ys, 0, None)], fmt="none",
                    ecolor="0.25", capsize=2, lw=0.8)
        for j, m in enumerate(methods):
            p = sub["time_ratio_paper"].get(m, np.nan)
            if pd.notna(p):
                ax.plot([xs[j]], [p], marker="_", color="k", ms=14, mew=2.2,
                        label=None if paper_drawn else "paper's ratio")
                paper_drawn = True
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="1 = as fast as the compared method")
    ax.set_xticks(x, [f"{m}\n(vs {reference_method(method_of[m])})" for m in methods], fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("step time: method / compared method\n(p50; above 1 = slower)")
    ax.set_title(f"Step time as a ratio to the compared method — {measured_on(runs)}\n"
                 "bars: p50 ratio; error bars: p20/p80 … p80/p20 of the timed steps (shared-machine noise)",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _metric_label(name: str) -> str:
    if name in PERCENT_METRICS:
        return f"{name} (%), higher is better"
    if name == "perplexity":
        return "perplexity per byte, lower is better"
    return str(name)


def accuracy(runs: pd.DataFrame) -> plt.Figure:
    runs = _complete(runs)
    ok = runs[runs["status"] == "ok"].dropna(subset=["metric_value"])
    tasks = runs[["task", "model"]].drop_duplicates().values.tolist()
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4.8 * max(1, len(tasks)), 4.6), squeeze=False)
    for i, (task, model) in enumerate(tasks):
        ax = axes[0, i]
        sub = ok[(ok["task"] == task) & (ok["model"] == model)]
        if sub.empty:
            ax.set_title(_task_label(task, model) + "\n(no finished runs)", fontsize=9)
            continue
        bs = accuracy_batch_size(sub)
        sub = with_series(sub[sub["batch_size"] == bs])
        name = sub["metric_name"].dropna().iloc[0] if sub["metric_name"].notna().any() else "metric"
        scale = 100.0 if name in PERCENT_METRICS else 1.0
        methods = _series(sub)
        n_seeds = sub["seed"].nunique()
        mean_label = "mean ± std over seeds" if n_seeds > 1 else "mean (1 seed: no error bar)"
        for j, m in enumerate(methods):
            v = sub[sub["series"] == m]["metric_value"].to_numpy(dtype=float) * scale
            ax.scatter(np.full(len(v), j) + np.linspace(-0.12, 0.12, len(v)), v, s=16, color="C0", zorder=3,
                       label="one seed" if j == 0 else None)
            ax.errorbar(j, v.mean(), yerr=v.std(ddof=1) if len(v) > 1 else 0, fmt="s", color="k", ms=5,
                        capsize=4, zorder=4, label=mean_label if j == 0 else None)
        before_col = next((c for c in ("base_metric_before", "opt_init_metric_before") if c in sub
                           and sub[c].notna().any()), None)
        if before_col:
            before = pd.to_numeric(sub[before_col], errors="coerce").mean() * scale
            ax.axhline(before, color="C3", ls="--", lw=1, label=f"base before fine-tuning ({before:.3g})")
        top = np.nanmax(sub["metric_value"].to_numpy(dtype=float) * scale)
        ax.set_ylim(0, 100 if scale == 100 else top * 1.15)  # from 0: a 2-point gap stays a 2-point gap
        ax.legend(fontsize=7, loc="lower right")
        ax.set_xticks(range(len(methods)), methods, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(_metric_label(name))
        steps = _steps_text(sub["steps"]) if "steps" in sub else "?"
        ax.set_title(f"{_task_label(task, model)}\nbatch {bs}, {steps} steps, {seeds_text(sub['seed'].nunique())}",
                     fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Metric after training per method (dots: seeds; square: mean) — {measured_on(runs)}",
                 fontsize=10)
    fig.tight_layout()
    return fig


def option_sweeps(runs: pd.DataFrame) -> pd.DataFrame:
    """Rows of cells whose method spec carries options, with ``plain`` (the spec without them), ``option`` (its name;
    one row per option written) and ``value`` (a number; NaN when the text is not one)."""
    from lowmembp.methods.registry import plain_spec, spec_parts

    rows = []
    for i, method in runs["method"].astype(str).items():
        try:
            parts = spec_parts(method)
        except ValueError:
            continue
        for opt, text in ((k, v) for _, o in parts for k, v in o.items()):
            rows.append({"index": i, "plain": plain_spec(method), "option": opt,
                         "value": pd.to_numeric(text, errors="coerce")})
    found = pd.DataFrame(rows, columns=["index", "plain", "option", "value"])
    return runs.loc[found["index"]].reset_index(drop=True).assign(**found.drop(columns="index").reset_index(drop=True))


def accuracy_vs_option(runs: pd.DataFrame) -> plt.Figure:
    runs = _complete(runs)
    ok = runs[runs["status"] == "ok"].dropna(subset=["metric_value"])
    swept = option_sweeps(ok).dropna(subset=["value"])
    panels = swept[["task", "model", "plain", "option"]].drop_duplicates().values.tolist()
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.2 * max(1, len(panels)), 4.4), squeeze=False)
    if not panels:
        axes[0, 0].set_title("no finished cell has options in its method spec (e.g. tokentune@k=4)", fontsize=9)
    for i, (task, model, plain, option) in enumerate(panels):
        ax = axes[0, i]
        sub = swept[(swept["task"] == task) & (swept["model"] == model) & (swept["plain"] == plain)
                    & (swept["option"] == option)]
        bs = accuracy_batch_size(sub)
        sub = with_series(sub[sub["batch_size"] == bs])
        name = sub["metric_name"].dropna().iloc[0] if sub["metric_name"].notna().any() else "metric"
        scale = 100.0 if name in PERCENT_METRICS else 1.0
        ax.scatter(sub["value"], sub["metric_value"] * scale, s=16, color="C0", zorder=3, label="one seed")
        per = (sub.assign(v=sub["metric_value"] * scale).groupby("value")["v"]
               .agg(["mean", lambda v: v.std(ddof=1) if len(v) > 1 else 0.0]))
        per.columns = ["mean", "std"]
        ax.errorbar(per.index, per["mean"], yerr=per["std"], fmt="-s", color="k", ms=5, capsize=4, zorder=4,
                    label="mean ± std over seeds" if sub["seed"].nunique() > 1 else "mean (1 seed)")
        for x, y in per["mean"].items():
            ax.annotate(f"{y:.1f}" if scale == 100 else f"{y:.3g}", (x, y), xytext=(4, 4),
                        textcoords="offset points", fontsize=7)
        ref = reference_method(plain)
        same = ok[(ok["task"] == task) & (ok["model"] == model) & (ok["batch_size"] == bs)]
        for j, (other, ls) in enumerate(((ref, "--"), (plain, ":"))):
            vals = same[same["method"] == other]["metric_value"].to_numpy(dtype=float) * scale if other else []
            if len(vals):
                ax.axhline(np.mean(vals), color=f"C{3 + j}", ls=ls, lw=1.2,
                           label=f"{other}{' (the config default)' if other == plain else ''}: {np.mean(vals):.3g}")
        if (per.index > 0).all() and per.index.max() / per.index.min() >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(per.index, [f"{v:g}" for v in per.index])
        ax.set_xlabel(f"{option} (in the spec {plain}@{option}=…)")
        ax.set_ylabel(_metric_label(name))
        lens = sorted({int(v) for v in sub["seq_len"].dropna()}) if "seq_len" in sub else []
        ax.set_title(f"{_task_label(task, model)}: {plain}\nbatch {bs}, {_steps_text(sub['steps'])} steps, "
                     f"{seeds_text(sub['seed'].nunique())}"
                     + (f", sequence length {'/'.join(map(str, lens))}" if lens else ""), fontsize=9)
        top = max(np.nanmax(sub["metric_value"].to_numpy(dtype=float) * scale), ax.get_ylim()[1])
        ax.set_ylim(0, 100 if scale == 100 else top * 1.15)  # from 0, as the accuracy figure
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Metric against a method option written into the spec\n{measured_on(runs)}", fontsize=10)
    fig.tight_layout()
    return fig


HEADLINE_PANELS = [  # (column of ours, column of the paper's, x label)
    ("peak_saved_%_ours", "peak_saved_%_paper", "peak memory saved (%)"),
    ("step_time_change_%_ours", "step_time_change_%_paper", "step time change (%, + = slower)"),
    ("metric_change_ours", "metric_change_paper", "metric change"),
]


def headline_figure(runs: pd.DataFrame, table: pd.DataFrame | None = None) -> plt.Figure:
    """Per task a row of three panels — peak memory saved, step-time change, metric change against the compared
    method — one bar per method (ours), the paper's value as a black diamond, the step-time spread as error bars."""
    df = headline_table(runs, load_claims()) if table is None else table
    tasks = df[["task", "model"]].drop_duplicates().values.tolist() or [["(no comparisons)", ""]]
    fig, axes = plt.subplots(len(tasks), 3, figsize=(14, 0.32 * max(8, df.groupby("task").size().max()
                                                                      if len(df) else 8) * len(tasks) + 1.6),
                             squeeze=False)
    for row, (task, model) in enumerate(tasks):
        sub = df[(df["task"] == task) & (df["model"] == model)]
        sub = with_series(sub)  # one bar per (method, optimizer)
        methods = _series(sub) if len(sub) else []
        sub = sub.set_index("series").reindex(methods)
        y = np.arange(len(methods))
        for col, (ours, paper, xlabel) in enumerate(HEADLINE_PANELS):
            ax = axes[row, col]
            vals = sub[ours].to_numpy(dtype=float) if len(sub) else np.array([])
            ax.barh(y, vals, color=["C0" if v >= 0 else "C1" for v in np.nan_to_num(vals)] if col == 0
                    else "C0", height=0.6, label="ours")
            ends = vals.copy()
            if col == 1 and len(sub):
                lo = sub["step_time_change_%_p20/p80"].to_numpy(dtype=float)
                hi = sub["step_time_change_%_p80/p20"].to_numpy(dtype=float)
                ax.errorbar(vals, y, xerr=[np.clip(vals - lo, 0, None), np.clip(hi - vals, 0, None)], fmt="none",
                            ecolor="0.25", capsize=2, lw=0.8, label="ours p20–p80 spread")
                ends = np.where(np.isfinite(hi), np.fmax(hi, vals), vals)
            pv = sub[paper].to_numpy(dtype=float) if len(sub) else np.array([])
            if np.isfinite(pv).any():
                ax.scatter(pv, y, marker="D", color="k", s=22, zorder=4, label="paper")
            for yi, v, e in zip(y, vals, ends):
                if np.isfinite(v):  # beyond the bar's end (and its spread), left of a negative bar
                    neg = v < 0 and col == 2
                    ax.annotate(f"{v:+.1f}" if col else f"{v:.0f}", (v if neg else max(e, 0), yi),
                                xytext=(-3 if neg else 3, -3), textcoords="offset points", fontsize=7,
                                ha="right" if neg else "left")
            if col == 2 and len(sub):  # a range that keeps a small change small: ±10 points / ±10 % of the metric
                ref = sub["metric_compared"].abs().max()
                unit_pct = (sub["unit"] == "%").any()
                span = max(np.nanmax(np.abs(np.r_[vals, pv, 0.0])) * 1.25, 10.0 if unit_pct else 0.1 * ref)
                ax.set_xlim(-span, span)
            ax.axvline(0, color="0.4", lw=0.8)
            ax.set_yticks(y, [f"{m} (vs {sub.loc[m, COMPARED]})" for m in methods] if col == 0 else
                          ["" for _ in methods], fontsize=8)
            ax.invert_yaxis()
            if col == 2:
                unit = sub["unit"].dropna().iloc[0] if len(sub) and sub["unit"].notna().any() else ""
                name = sub["metric"].dropna().iloc[0] if len(sub) and sub["metric"].notna().any() else "metric"
                xlabel = (f"{name} change (points of %, + = better)" if unit == "%"
                          else f"{name} change (+ = worse)" if name == "perplexity" else f"{name} change")
            ax.set_xlabel(xlabel, fontsize=9)
            bs = sub["memory_batch"].dropna() if len(sub) else pd.Series([], dtype=float)
            where = (f"batch {int(bs.max())}" if col < 2 and len(bs) else
                     f"batch {int(sub['accuracy_batch'].dropna().max())}, "
                     f"{seeds_text(sub['seeds'].max())}" if col == 2 and len(sub)
                     and sub["accuracy_batch"].notna().any() else "")
            ax.set_title(f"{_task_label(task, model) if col == 0 else task}: {xlabel.split(' (')[0]}, {where}",
                         fontsize=9)
            ax.grid(axis="x", alpha=0.3)
            if row == 0:
                ax.legend(fontsize=7, loc="lower right")
    seeds = runs.groupby(["task", "model"])["seed"].nunique().max() if len(runs) else 0
    fig.suptitle("What each method saves, costs and changes against the method it is compared with "
                 f"(lora+X vs lora, others vs baseline) — ours (bars) beside the papers' (black diamonds)\n"
                 f"{measured_on(runs)}; up to {seeds_text(seeds)} per cell", fontsize=10)
    fig.tight_layout()
    return fig


FIGURES = {"memory_vs_batch": memory_vs_batch, "step_time_ratio": step_time_ratio, "accuracy": accuracy}
OPTION_FIGURES = {"accuracy_vs_option": accuracy_vs_option}  # catalogue.OPTION_FIGURES: made when specs carry options


def save(fig: plt.Figure, out) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(runs_csv, name, out, log=None):
    """Figure ``name`` of runs.csv to ``out``; rows of damaged records (status invalid) are left out and counted."""
    runs, invalid = read_runs(runs_csv)
    save({**FIGURES, **OPTION_FIGURES}[name](runs), out)
    if log:
        Path(log).write_text(f"{name}: {len(runs)} rows, {len(invalid)} invalid left out"
                             + "".join(f"\n  {r}" for r in invalid.get("record", [])) + "\n")


if "snakemake" in globals():
    plt.switch_backend("Agg")
    main(snakemake.input.runs, snakemake.wildcards.fig, snakemake.output[0], snakemake.log[0])  # noqa: F821
elif __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    plt.switch_backend("Agg")
    main(*by_hand.arguments("python plots.py RUNS.csv FIGURE_NAME OUT.png", sys.argv[1:], 3))

"""A paper-scale reproduction's rows (results/repro/<name>.csv, from experiments.repro) -> its figure.

- block_breakdown: one panel per model; four stacked bars (paper baseline, paper LowMemoryBP, real-code baseline,
  real-code LowMemoryBP), each split by op kind, in 16-bit units of b·s·d per block, the saving written on top.
- fig1, mesa_table: the published memory and ours side by side per method (grey: paper, blue: ours), ratio on top.
- tokentune_memory: peak memory against batch size per method (the slope is what TokenTune changes).
- stacked: one bar per row (each adds one memory lever to the row above), the peak split by category (GiB),
  offloading's host bytes hatched, the peak and its change annotated.
- compiled_saving: per model family, each method's saving (%) eager beside compiled, the share kept on top.
- compiled_budget: per model family, saved-for-backward KiB and step time against torch.compile's memory budget, one
  line per method, eager dashed.
- grad_fidelity: per model (columns) and dtype (rows), each method's relative gradient error against its exact
  reference at each depth (embeddings, blocks, head), log scale; exact controls dashed, bf16 autocast's own rounding
  dotted.
Any other table with a numeric ``paper...`` and ``ours...`` column gets the side-by-side bars.

Run by Snakemake (rule repro_figure) or by hand: ``python plots_repro.py NAME REPRO.csv OUT.png``.
"""
import re
import sys
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
sys.path.insert(0, str(HERE.parent))
from catalogue import REPRO_BY_STEM  # noqa: E402

TITLES = {stem: r.title for stem, r in REPRO_BY_STEM.items()}


def _numeric(df, prefix):
    return [c for c in df.columns if c.startswith(prefix) and pd.api.types.is_numeric_dtype(df[c])
            and not c.endswith("%")]


def _unit(col: str) -> str:
    """'paper_MiB' -> 'MiB', 'paper_MB' -> 'MB' (the unit is the column name's last part)."""
    tail = col.rsplit("_", 1)[-1]
    return "%" if tail == "pct" else tail if tail in ("MiB", "MB", "GiB", "GB", "ms", "%") else ""


def side_by_side(df: pd.DataFrame, ax, title: str) -> None:
    """Bars of the first numeric paper* column against the first numeric ours* column, one pair per row; the
    ratio ours / paper written on top of each pair. A numeric ``official_code*`` column (fig1: the same step with
    the official code's choices emulated) is a third bar, its ratio written below ours."""
    p, o = (_numeric(df, "paper") or [None])[0], (_numeric(df, "ours") or [None])[0]
    if p is None or o is None:
        raise SystemExit(f"{title}: no numeric paper/ours columns in {list(df.columns)}")
    off = (_numeric(df, "official_code") or [None])[0]
    text = [c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c])
            and c not in ("note", "spec", "paper", "check")]
    labels = [" / ".join(str(v) for v in row) for row in df[text].itertuples(index=False)]
    up, uo = _unit(p), _unit(o)
    x = np.arange(len(df))
    w = 0.4 if off is None else 0.27
    ax.bar(x - w / 2 * (1 if off is None else 2), df[p], w, label=f"paper, as published ({up or p})", color="0.65")
    ax.bar(x + (w / 2 if off is None else 0), df[o], w, label=f"ours, estimated on fake tensors on the CPU ({uo or o})",
           color="C0")
    if off is not None:
        ax.bar(x + w, df[off], w, color="C1",
               label=f"ours with the official code's choices emulated, fake tensors ({_unit(off) or off})")
    for xi, (pv, ov) in enumerate(zip(df[p], df[o])):
        if pd.notna(pv) and pd.notna(ov) and pv:
            fv = df[off].iloc[xi] if off is not None else np.nan
            top = max(pv, ov, fv) if pd.notna(fv) else max(pv, ov)
            label = (f"ours / paper\n{ov / pv:.2f}" if pd.isna(fv)
                     else f"ours / paper {ov / pv:.2f}\nofficial / paper {fv / pv:.2f}")
            ax.text(xi, top, label, ha="center", va="bottom", fontsize=7 if pd.isna(fv) else 6)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    unit = up if up == uo else " / ".join(u for u in (up, uo) if u)
    what = "peak memory saved" if "saving" in p else "peak training memory"
    ax.set_ylabel(f"{what} ({unit or 'as in the columns'})")
    tops = [df[c].to_numpy(dtype=float) for c in (p, o, off) if c is not None]
    ax.set_ylim(0, np.nanmax(np.concatenate(tops)) * (1.18 if off is None else 1.75))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def block_breakdown(df: pd.DataFrame, fig) -> None:
    models = list(dict.fromkeys(df["model"]))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    bars = [("paper_base", "paper\nbaseline"), ("paper_lowmembp", "paper\nLowMemoryBP"),
            ("real_base", "real code\nbaseline"), ("real_lowmembp", "real code\nLowMemoryBP")]
    for ax, model in zip(axes, models):
        sub = df[df["model"] == model]
        slices = sub[~sub["slice"].isin(["total", "saving %"])]
        bottom = np.zeros(len(bars))
        for i, row in enumerate(slices.itertuples(index=False)):
            vals = np.array([getattr(row, c) for c, _ in bars], dtype=float)
            ax.bar(range(len(bars)), vals, bottom=bottom, color=plt.get_cmap("tab10")(i), label=str(row.slice))
            bottom += np.nan_to_num(vals)
        for j in (1, 3):
            if bottom[j - 1]:
                ax.text(j, bottom[j], f"saves {100 * (1 - bottom[j] / bottom[j - 1]):.1f} %", ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(bars)), [b for _, b in bars], fontsize=7)
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("activation memory of one block\n(16-bit units of b·s·d: batch × tokens × width)")
        ax.grid(axis="y", alpha=0.3)
    seen = {}
    for ax in axes:  # every op kind of every panel (ViT has no elementwise product, LLaMA has)
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=len(seen), fontsize=8, frameon=False)


def tokentune_memory(df: pd.DataFrame, ax) -> None:
    cols = [c for c in df.columns if re.fullmatch(r"peak_MiB_b\d+", c)]
    bs = [int(c.rsplit("_b", 1)[1]) for c in cols]
    for row in df.itertuples(index=False):
        ys = [getattr(row, c) for c in cols]
        ax.plot(bs, ys, marker="o", label=row.method)
    ax.set_xlabel("batch size")
    ax.set_ylabel("peak memory of a training step (MiB)")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_ylim(bottom=0)
    ax.set_title("BERT-large, estimated on fake tensors on the CPU: the slope is the memory per sequence",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


STACKED_CATEGORIES = ("weights", "gradients", "optimizer", "activations", "temporaries")  # <name>_GiB columns


def stacked(df: pd.DataFrame, ax) -> None:
    """One horizontal bar per row (each adds one lever to the row above, or puts one in place of another): the peak
    of a training step split by category (GiB), the host bytes of offloading hatched beyond it, the peak and its
    change against the row above written at the end."""
    y = np.arange(len(df))
    left = np.zeros(len(df))
    for i, cat in enumerate(STACKED_CATEGORIES):
        vals = pd.to_numeric(df[f"{cat}_GiB"], errors="coerce").fillna(0).to_numpy(dtype=float)
        ax.barh(y, vals, left=left, height=0.65, color=f"C{i}", label=cat)
        left += vals
    host = pd.to_numeric(df.get("host_GiB", pd.Series(0.0, index=df.index)), errors="coerce").fillna(0).to_numpy()
    if (host > 0).any():
        ax.barh(y, host, left=left, height=0.65, color="white", edgecolor="0.4", hatch="//",
                label="host memory (offloading; not in the peak)")
    for yi, peak, ch, h in zip(y, df["peak_GiB"], df["change_%"], host):
        text = f"{peak:.1f} GiB" + ("" if pd.isna(ch) else f" ({ch:+.0f} %)")
        ax.annotate(text, (left[yi] + h, yi), xytext=(3, -3), textcoords="offset points", fontsize=7)
    ax.set_yticks(y, [str(r) for r in df["lever"]], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, float(np.nanmax(left + host)) * 1.3 if len(df) else 1)
    ax.set_xlabel("memory at the peak of one training step (GiB; estimated on fake tensors, CPU)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)


LEVER_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")  # <c>_at_peak_GiB


def lever_estimates(df: pd.DataFrame, fig) -> None:
    """One panel per section (the optimizers, tiled MLP, VeLoRA): a horizontal bar per method (and optimizer), the
    peak of one training step split by category (GiB), the peak written at the end."""
    sections = list(dict.fromkeys(df["section"]))
    axes = fig.subplots(len(sections), 1, squeeze=False,
                        gridspec_kw={"height_ratios": [max(2, (df["section"] == s).sum()) for s in sections]})[:, 0]
    for ax, section in zip(axes, sections):
        sub = df[df["section"] == section].reset_index(drop=True)
        y = np.arange(len(sub))
        left = np.zeros(len(sub))
        for i, cat in enumerate(LEVER_CATEGORIES):
            vals = pd.to_numeric(sub[f"{cat}_at_peak_GiB"], errors="coerce").fillna(0).to_numpy(dtype=float)
            ax.barh(y, vals, left=left, height=0.65, color=f"C{i}", label=cat.replace("_", " "))
            left += vals
        for yi, peak in zip(y, sub["peak_GiB"]):
            ax.annotate(f"{peak:.1f} GiB", (left[yi], yi), xytext=(3, -3), textcoords="offset points", fontsize=7)
        labels = [m if section != "optimizers" else o for m, o in zip(sub["method"], sub["optimizer"])]
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, float(np.nanmax(left)) * 1.25 if len(sub) else 1)
        ax.set_title(textwrap.fill(f"{section}: {sub['setting'].iloc[0]}", 110), fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("memory at the peak of one training step (GiB; estimated on fake tensors, CPU)")
    axes[0].legend(fontsize=7, loc="lower right")


def tokentune_k(df: pd.DataFrame, ax) -> None:
    """Accuracy (%) against TokenTune's k (mean, spread over seeds as error bars); full fine-tuning and LoRA as
    horizontal lines."""
    tt = df[df["k"].notna()].sort_values("k")
    ax.errorbar(tt["k"], tt["accuracy_%"], yerr=tt["spread_%"] / 2, marker="o", capsize=3, label="TokenTune")
    for (_, row), style in zip(df[df["k"].isna()].iterrows(), ("--", ":")):
        ax.axhline(row["accuracy_%"], ls=style, color="0.4", label=row["method"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(tt["k"], [str(int(k)) for k in tt["k"]])
    ax.set_xlabel("k (tokens per sequence with gradients)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def compiled_saving(df: pd.DataFrame, fig) -> None:
    """One panel per model family: each method's saving of saved-for-backward bytes (%) against the baseline in the
    same mode, eager (grey) beside torch.compile (blue), the compiled share of the eager saving written on top."""
    families = list(dict.fromkeys(df["family"]))
    axes = fig.subplots(1, len(families), squeeze=False, sharey=True)[0]
    for ax, family in zip(axes, families):
        sub = df[(df["family"] == family) & (df["method"] != "baseline")].reset_index(drop=True)
        x = np.arange(len(sub))
        eager = sub["eager_saving_%"].to_numpy(dtype=float)
        comp = sub["compiled_saving_%"].to_numpy(dtype=float)
        ax.bar(x - 0.2, eager, 0.4, color="0.65", label="eager")
        ax.bar(x + 0.2, comp, 0.4, color="C0", label="torch.compile")
        for xi, (e, c, k) in enumerate(zip(eager, comp, pd.to_numeric(sub["kept_%"], errors="coerce"))):
            if np.isfinite(k):
                ax.text(xi, max(e, c), f"kept\n{k:.0f} %", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [str(m) for m in sub["method"]], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{family} (fp32, CPU)", fontsize=10)
        ax.axhline(0, color="0.3", lw=0.8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("saved-for-backward bytes saved\nvs the baseline in the same mode (%)")
    top = np.nanmax(np.r_[df["eager_saving_%"].to_numpy(dtype=float), df["compiled_saving_%"].to_numpy(dtype=float),
                          1.0])
    axes[0].set_ylim(top=top * 1.2)
    axes[0].legend(fontsize=8, loc="upper left")


def compiled_budget(df: pd.DataFrame, fig) -> None:
    """Per model family (columns): saved-for-backward KiB (top) and CPU step time / the eager baseline's (bottom)
    against torch.compile's activation_memory_budget, one line per method; the eager value of each method dashed in
    the same colour."""
    families = list(dict.fromkeys(df["family"]))
    methods = list(dict.fromkeys(df["method"]))
    axes = fig.subplots(2, len(families), squeeze=False, sharex=True)
    for j, family in enumerate(families):
        for i, method in enumerate(methods):
            sub = df[(df["family"] == family) & (df["method"] == method)]
            comp = sub[sub["mode"] == "compiled"].sort_values("memory_budget")
            eager = sub[sub["mode"] == "eager"]
            for ax, col in zip(axes[:, j], ("saved_KiB", "step_vs_eager")):
                ax.plot(comp["memory_budget"], comp[col], marker="o", color=f"C{i}", label=f"{method}, compiled")
                if len(eager):
                    ax.axhline(float(eager[col].iloc[0]), ls="--", lw=1, color=f"C{i}", label=f"{method}, eager")
        axes[0, j].set_title(f"{family} (fp32, CPU)", fontsize=10)
        axes[0, j].set_ylim(bottom=0)
        axes[1, j].set_xlabel("activation_memory_budget")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("saved for backward (KiB)")
    axes[1, 0].set_ylabel("CPU step time /\nthe eager baseline's")
    axes[0, 0].legend(fontsize=7, loc="lower right")  # the lines rise to the right: that corner is empty


FIDELITY_FLOOR = 1e-8  # relative errors below this (exact to the last bit: 0) are drawn on the floor


def grad_fidelity(df: pd.DataFrame, fig) -> None:
    """Per model (columns) and dtype (rows): relative error ||g - g_exact|| / ||g_exact|| against depth, one line per
    method (approximate: solid; exact controls: dashed; bf16 autocast against fp32: dotted black), log scale."""
    df = df[~df["depth"].isin(["all", "blocks"])]  # the summaries: the table's
    models, dtypes = list(dict.fromkeys(df["model"])), list(dict.fromkeys(df["dtype"]))
    methods = list(dict.fromkeys(df["method"]))
    colours = {m: f"C{i % 10}" for i, m in enumerate(m for m in methods if not _exact(df, m))}
    axes = fig.subplots(len(dtypes), len(models), squeeze=False, sharey=True)
    for i, dtype in enumerate(dtypes):
        for j, model in enumerate(models):
            ax = axes[i, j]
            sub = df[(df["model"] == model) & (df["dtype"] == dtype)]
            ticks = sub.drop_duplicates("position").sort_values("position")
            for method in methods:
                line = sub[sub["method"] == method].sort_values("position")
                if not len(line):
                    continue
                kind = line["kind"].iloc[0]
                style = (dict(ls=":", color="k", lw=1.5) if kind == "rounding" else
                         dict(ls="--", color="0.55", lw=0.9, marker=".") if kind == "exact" else
                         dict(ls="-", color=colours[method], marker="o", ms=3))
                ax.plot(line["position"], line["rel_error"].clip(lower=FIDELITY_FLOOR), label=method, **style)
            ax.set_yscale("log")
            ax.set_xticks(ticks["position"], [str(d) for d in ticks["depth"]], fontsize=8)
            ax.set_title(f"{model}, {dtype}", fontsize=10)
            ax.grid(alpha=0.3)
            if i == len(dtypes) - 1:
                ax.set_xlabel("depth (embeddings, block index, head)")
        axes[i, 0].set_ylabel(f"relative gradient error ({dtypes[i]})\n(floor {FIDELITY_FLOOR:g} = exact)")
    seen: dict = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), fontsize=7, loc="lower center", ncol=min(7, len(seen)))


def _exact(df: pd.DataFrame, method: str) -> bool:
    return bool((df.loc[df["method"] == method, "kind"] != "approximate").all())


def estimator_error(df: pd.DataFrame, ax) -> None:
    """The estimator's error in % per method, one bar per model family (estimator_error's rows)."""
    ok = df.dropna(subset=["error_%"])
    methods = list(dict.fromkeys(ok["method"]))
    families = list(dict.fromkeys(ok["family"]))
    x = np.arange(len(methods))
    w = 0.8 / max(len(families), 1)
    for i, fam in enumerate(families):
        sub = ok[ok["family"] == fam].set_index("method").reindex(methods)
        ax.bar(x + (i - (len(families) - 1) / 2) * w, sub["error_%"], w, label=fam)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, methods, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("(estimate - CPU allocator peak) / allocator peak (%)")
    ax.legend(fontsize=8, title="model family (tiny width, fp32)", title_fontsize=8)
    if "machine" in ok.columns and len(ok):
        ax.set_title(f"CPU allocator on {ok['machine'].iloc[0]}", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def figure(name: str, df: pd.DataFrame, title: str | None = None) -> plt.Figure:
    """The figure of reproduction ``name`` (a table stem) from its rows."""
    if name == "block_breakdown":
        fig = plt.figure(figsize=(4.6 * df["model"].nunique(), 4.8))
        block_breakdown(df, fig)
    elif name == "compiled_saving" and "compiled_saving_%" in df.columns:
        fig = plt.figure(figsize=(4.2 * df["family"].nunique(), 4.6))
        compiled_saving(df, fig)
    elif name == "compiled_budget" and "memory_budget" in df.columns:
        fig = plt.figure(figsize=(4.2 * df["family"].nunique(), 6.4))
        compiled_budget(df, fig)
    elif name == "grad_fidelity" and "rel_error" in df.columns:
        fig = plt.figure(figsize=(4.4 * df["model"].nunique(), 3.3 * df["dtype"].nunique() + 1.2))
        grad_fidelity(df, fig)
    elif name == "estimator_error" and "error_%" in df.columns:
        fig, ax = plt.subplots(figsize=(10, 4.6))
        estimator_error(df, ax)
    elif name == "lever_estimates" and "section" in df.columns:
        fig = plt.figure(figsize=(9.5, 0.42 * len(df) + 1.2 * df["section"].nunique() + 1.5))
        lever_estimates(df, fig)
    elif name == "stacked" and "peak_GiB" in df.columns:
        fig, ax = plt.subplots(figsize=(9.5, 0.42 * len(df) + 2.0))
        stacked(df, ax)
    else:
        fig, ax = plt.subplots(figsize=(max(6.5, 0.8 * len(df) + 2), 4.6))
        if name in ("tokentune_memory", "tokentune_vs_ckpt") and any(re.fullmatch(r"peak_MiB_b\d+", c)
                                                                      for c in df.columns):
            tokentune_memory(df, ax)
        elif name == "tokentune_k" and "accuracy_%" in df.columns:
            tokentune_k(df, ax)
        else:
            side_by_side(df, ax, name)
    fig.suptitle(textwrap.fill(title or TITLES.get(name, name), 120), fontsize=10)  # long titles wrap
    fig.tight_layout(rect=(0, 0.06, 1, 1) if name == "block_breakdown" else (0, 0.08, 1, 1)
                     if name == "grad_fidelity" else None)
    return fig


def main(name: str, csv: str, out: str, title: str | None = None) -> None:
    fig = figure(name, pd.read_csv(csv), title)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if "snakemake" in globals():
    plt.switch_backend("Agg")
    main(snakemake.wildcards.rfig, snakemake.input[0], snakemake.output[0], snakemake.params.title)  # noqa: F821
elif __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    plt.switch_backend("Agg")
    main(*by_hand.arguments("python plots_repro.py NAME REPRO.csv OUT.png", sys.argv[1:], 3))

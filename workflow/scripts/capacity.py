"""The largest batch that fits in 24 / 40 / 80 GiB, per paper model and method (lowmembp.plan on fake tensors).

    python capacity.py OUT.csv OUT.md OUT.png          # by hand (the defaults below); under Snakemake: rule capacity

TokenTune's claim that memory grows more slowly with the batch, restated as capacity: the batch each method allows
on each GPU size. Every number is the planner's: the peak of a fake-tensor training step (exact tensor bytes) plus
its stated margin, the largest batch checked directly (it fits, the next one does not).
"""

import logging
import os
import sys
import time

from lowmembp.atomic import atomic_open, atomic_write

DEFAULTS = {  # also the rule's (workflow/rules/capacity.smk reads them from here)
    "models": {"bert-large": {}, "llama-7b": {"seq_len": 512}},
    "methods": ["baseline", "lora", "checkpointing", "tokentune", "lora+tokentune"],
    "gpus": ["24GiB", "40GiB", "80GiB"],
}


def capacity(models: dict, methods: list[str], gpus: list[str]):
    """A long table: model, method, gpu, largest_batch, how it was checked, the peak at the paper batch."""
    import pandas as pd

    from lowmembp.estimator.step import MODELS
    from lowmembp.plan import make_plan

    rows = []
    for model, kw in models.items():
        t0 = time.perf_counter()
        spec = MODELS[model]
        p = make_plan(model, batch_size=spec.batch_size, gpu_memory=gpus[0], more_gpus=gpus[1:],
                 combos=[m for m in methods if m != "baseline"], runs=os.devnull, **kw)
        logging.info("%s: %d combinations in %.1f s", model, len(p.rows), time.perf_counter() - t0)
        for r in p.rows:
            for gpu in gpus:
                ok = r["status"] == "ok"
                best = (r["largest_batch"] if gpu == gpus[0] else r["largest_batch_by_gpu"][gpu]) if ok else None
                rows.append({"model": model, "method": r["method"], "seq_len": p.settings["seq_len"],
                             "dtype": p.settings["dtype"], "weights": r.get("weights"), "gpu": gpu,
                             "largest_batch": best,
                             "paper_batch": spec.batch_size, "peak_at_paper_batch_gib":
                                 round(r["peak_bytes"] / 2**30, 2) if ok else None,
                             "note": (r["largest_batch_how"] if gpu == gpus[0] else "") if ok else r["reason"],
                             "margin": p.sources["margin"]})
    df = pd.DataFrame(rows)
    missing = not_estimated(df)
    if df.empty or len(missing) == len(df.drop_duplicates(["model", "method"])):
        raise RuntimeError("capacity: nothing could be estimated: " + ("; ".join(
            f"{r.model} {r.method}: {r.note}" for r in missing.itertuples()) or "the planner returned no rows"))
    for r in missing.itertuples():
        logging.warning("capacity: %s %s not estimated: %s", r.model, r.method, r.note)
    order = {m: i for i, m in enumerate(methods)}
    return df.sort_values(["model", "method"], key=lambda c: c.map(order) if c.name == "method" else
                          c.map(list(models).index), kind="stable").reset_index(drop=True)


def not_estimated(df):
    """One row per (model, method) the planner could not estimate (no peak; ``note`` says why)."""
    return df[df["peak_at_paper_batch_gib"].isna()].drop_duplicates(["model", "method"]) if len(df) else df


def write(df, out_csv: str, out_md: str, out_png: str, gpus: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with atomic_open(out_csv, "w") as fh:
        df.to_csv(fh, index=False)
    wide = df.pivot_table(index=["model", "method"], columns="gpu", values="largest_batch", aggfunc="first",
                          sort=False)[gpus].reset_index()
    # every (model, method) once, in the table's order: pivot_table drops those without a number (not estimated)
    wide = df.drop_duplicates(["model", "method"])[["model", "method"]].merge(wide, how="left")
    peak = df.drop_duplicates(["model", "method"]).set_index(["model", "method"])["peak_at_paper_batch_gib"]
    wide.insert(2, "peak GiB at the paper batch", [peak[(m, x)] for m, x in zip(wide["model"], wide["method"])])
    weights = df.drop_duplicates(["model", "method"]).set_index(["model", "method"])["weights"]
    wide.insert(2, "weights", [weights[(m, x)] for m, x in zip(wide["model"], wide["method"])])
    wide = wide.rename(columns={g: f"largest batch in {g}" for g in gpus})
    missing = not_estimated(df)
    if len(missing):  # the numbers as they would print, the gaps in words
        wide = wide.apply(lambda col: col if col.name in ("model", "method") else col.fillna("-")
                          if col.name == "weights" else col.map(
            lambda v: "not estimated" if v is None or v != v else v if isinstance(v, str)
            else int(v) if float(v).is_integer() else v))
    text = ("# Largest batch that fits, per paper model and method (lowmembp.plan, fake tensors)\n\n"
            f"Margin: {df['margin'].iloc[0]}. Each largest batch is checked: it fits and the next does not.\n"
            "Weights as loaded for each method (the planner's auto: a LoRA-family base in the compute dtype, trained "
            "weights as fp32 masters under autocast).\n"
            "0 = no batch fits (parameters and optimizer state alone, or batch 1, exceed the GPU).\n\n"
            + wide.to_markdown(index=False) + "\n"
            + "".join(f"\nNot estimated: {r.model} {r.method}: {r.note}\n" for r in missing.itertuples()))
    atomic_write(out_md, text)

    models = list(dict.fromkeys(df["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = df[df["model"] == model]
        methods = list(dict.fromkeys(sub["method"]))
        width = 0.8 / len(gpus)
        for i, gpu in enumerate(gpus):
            vals = [sub[(sub["method"] == m) & (sub["gpu"] == gpu)]["largest_batch"].fillna(0).iloc[0]
                    for m in methods]
            ax.bar([j + (i - (len(gpus) - 1) / 2) * width for j in range(len(methods))], vals, width, label=gpu)
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{model} ({sub['dtype'].iloc[0]}" + (f", {int(sub['seq_len'].iloc[0])} tokens)"
                                                            if sub['seq_len'].notna().all() else ")"), fontsize=9)
        ax.set_ylabel("largest batch that fits")
    axes[0][0].legend(title="GPU memory", fontsize=8)
    fig.suptitle("Largest batch per GPU size (estimated on fake tensors, margin included)", fontsize=10)
    fig.tight_layout()
    with atomic_open(out_png, "wb") as fh:
        fig.savefig(fh, dpi=120, format="png")


def main(out_csv, out_md, out_png, models=None, methods=None, gpus=None):
    models = models or DEFAULTS["models"]
    methods = methods or DEFAULTS["methods"]
    gpus = gpus or DEFAULTS["gpus"]
    t0 = time.perf_counter()
    df = capacity(models, methods, gpus)
    write(df, out_csv, out_md, out_png, gpus)
    logging.info("capacity: %d rows in %.1f s", len(df), time.perf_counter() - t0)


if "snakemake" in globals():
    sm = snakemake  # noqa: F821
    logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(message)s")
    main(sm.output.csv, sm.output.md, sm.output.png, sm.params.models, sm.params.methods, sm.params.gpus)
elif __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(*by_hand.arguments("python capacity.py OUT.csv OUT.md OUT.png", sys.argv[1:], 3))

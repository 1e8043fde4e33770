"""How the reproductions' tables read: a reproduction's rows (experiments.repro: paper value, ours, ratio and a note
side by side) -> the parts of a :class:`table_layout.Layout`.

A reproduction with a layout of its own (:data:`REPRO_LAYOUTS`: Fig. 1, LowMemoryBP's headline, the lever estimates,
the full-fine-tuning levers) gets it; one whose rows are data for a figure shows a summary (:data:`REPRO_TABLE_VIEWS`);
any other the generic one (:func:`generic_layout`). Each has its caption (:data:`REPRO_CAPTIONS`) and, in its title,
how its numbers were made (:func:`repro_machine`).
"""
from pathlib import Path

import numpy as np
import pandas as pd

from paper_claims import GPU_RESULTS, gpu_step_ratios
from sweep_layouts import NO_GPU
from table_layout import Footnotes, Part, format_number, format_table, header, long_text_columns, split_columns
from table_maths import CATEGORIES

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


def fig1_layout(df: pd.DataFrame, notes: Footnotes, gpu_dir: Path = GPU_RESULTS) -> list[Part]:
    """Fig. 1 as three tables: peak memory (paper, ours, the official code emulated), where ours and the official
    code differ (measured MiB), and throughput (the paper's GPU claim beside the FLOP ratio and the GPU run)."""
    mem, diff, thr = [], [], []
    gpu = gpu_step_ratios(gpu_dir)
    for d in df.to_dict("records"):
        setting = str(d["setting"])
        key = {"setting": setting, "method": d["method"] + notes.mark(d.get("note", ""))}
        mem.append({**key, "paper (MiB)": format_number(d["paper_MiB"], ".0f") + notes.mark(d.get("paper_source", "")),
                    "ours (MiB)": format_number(d["ours_MiB"], ".1f"), "ours / paper": format_number(d["ratio"]),
                    "official emulated (MiB)": format_number(d["official_code_MiB"], ".1f"),
                    "emulated / paper": format_number(d["official_ratio"]),
                    "saved vs LoRA, paper / ours / emulated (%)": (f"{d['paper_saving_%']:.1f} / "
                                                                   f"{d['ours_saving_%']:.1f} / "
                                                                   f"{d['official_saving_%']:.1f}")})
        diff.append({**key, "their LoraFunction (MiB)": format_number(d["diff_lora_function_MiB"], "+.1f"),
                     "fp32 MS-LN output (MiB)": format_number(d["diff_msln_fp32_MiB"], "+.1f"),
                     "both beyond their sum (MiB)": format_number(d["diff_interaction_MiB"], "+.1f"),
                     "unexplained: paper − emulated (MiB)": format_number(d["unexplained_MiB"], "+.1f"),
                     "saved for backward: ours / emulated (MiB)": (f"{d['saved_for_backward_MiB']:.1f} / "
                                                                   f"{d['official_saved_for_backward_MiB']:.1f}"),
                     "parameters (MiB)": format_number(d["params_MiB"], ".1f"),
                     "activations at peak (MiB)": format_number(d["activations_at_peak_MiB"], ".1f")})
        if "(default)" in setting:  # the paper's throughput is its own setting's (lora_qv)
            plain = setting.split(" ")[0]
            g = gpu.get((plain, d["spec"]))
            thr.append({**key, "paper (GPU, img/s)": format_number(d["paper_img_per_s"], ".0f"),
                        "paper: step-time ratio to LoRA (GPU)": format_number(d.get("paper_step_time_ratio", np.nan)),
                        "FLOP ratio to LoRA (fake tensors)": format_number(d.get("flop_ratio", np.nan)),
                        "training step (GFLOP)": format_number(d.get("step_GFLOP", np.nan), ".0f"),
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
                     "paper saving (%)": format_number(paper, ".1f") + notes.mark(d.get("paper_source", "")),
                     "ours saving (%)": format_number(ours, ".1f"),
                     "ours / paper": format_number(ours / paper if pd.notna(paper) and paper else np.nan),
                     "without (MiB)": format_number(d["baseline_MiB"], ".0f"),
                     "with LowMemoryBP (MiB)": format_number(d["lowmembp_MiB"], ".0f"),
                     "official run saving (%)": format_number(off, ".1f"),
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
    has none) and split into parts of at most :data:`table_layout.MAX_COLUMNS` columns (the text columns repeated)."""
    long = long_text_columns(df)
    shown = format_table(df.drop(columns=long))
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
            row.update({"peak (GiB)": format_number(d["peak_GiB"], ".2f")})
            if section != "optimizers":
                row["saved for backward (GiB)"] = format_number(d["saved_GiB"], ".2f")
            row.update({f"{c.replace('_', ' ')} at peak (GiB)": format_number(d[f"{c}_at_peak_GiB"], ".2f")
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
                rows.append({"method": d["lever"], "saved for backward (GiB)": format_number(d["saved_GiB"], ".2f"),
                             "one block (GiB)": format_number(d["block_saved_GiB"], ".3f"),
                             "saved / baseline's": format_number(d["saved_vs_baseline"], ".3f"),
                             "peak (GiB)": format_number(d["peak_GiB"], ".2f"),
                             "activations at peak (GiB)": format_number(d["activations_GiB"], ".2f"),
                             "measured / estimated (small width)": format_number(d.get("measured / estimated"), ".3f")})
            parts.append(Part(f"{model}: CompAct and LowMemoryBP, alone and together", pd.DataFrame(rows),
                              section=f"compact-{model}"))
            continue
        for d in sub.to_dict("records"):
            row = {"optimizer" if part == "optimizers" else "lever": d["lever"]}
            if part != "optimizers":
                row["category"] = d["category"]
            row["peak (GiB)"] = format_number(d["peak_GiB"], ".2f")
            if part == "optimizers":
                row["state / AdamW's"] = format_number(d.get("state_vs_adamw"), ".3f")
            else:
                row["change"] = format_number(d.get("change_%"), "+.1f", " %")
            row.update({f"{c} (GiB)": format_number(d[f"{c}_GiB"], ".2f") for c in cats})
            if part != "optimizers":
                row["measured / estimated (small width)"] = format_number(d.get("measured / estimated"), ".3f")
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

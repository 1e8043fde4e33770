"""The pipeline's catalogue: every table, figure, reproduction and notebook it makes, with its title, the script
that makes it and where it goes. The Snakemake rules (workflow/rules/*.smk) and the scripts (workflow/scripts/*.py)
both read this file; nothing else lists them.

    from catalogue import RUN_TABLES, RUN_FIGURES, REPRODUCTIONS, NOTEBOOKS, table_paths, figure_path

Paths are relative to the results folder (config ``results:``); :func:`table_paths` and friends put them under it.
A reproduction (``experiments.repro``) is one CSV of rows (``repro/<name>.csv``) that becomes one table and one figure,
both named by its ``stem``. Imported by path (``sys.path`` gets ``workflow/``), not as a package: inside a Snakefile
``workflow`` is Snakemake's own object.
"""
from __future__ import annotations

from dataclasses import dataclass

TABLE_FORMATS = ("md", "csv", "html")  # one job writes all three, so they never disagree


@dataclass(frozen=True)
class Output:
    """A table or a figure made from the sweep's runs.csv."""
    name: str  # file stem under tables/ or figures/
    title: str
    script: str  # under workflow/scripts/


@dataclass(frozen=True)
class Reproduction:
    """A paper-scale reproduction (``python -m experiments.repro <name>``): a CSV, then a table and a figure."""
    name: str  # the experiments.repro name
    stem: str  # tables/<stem>.{md,csv,html} and figures/<stem>.png
    title: str  # of both the table and the figure
    how: str = "the real model code on fake tensors on the CPU"  # what the numbers are (the table's source line)


RUN_TABLES = (
    Output("memory", "Memory per method: peak and activations in MiB, and as ratios to the compared method "
           "(ours beside the papers')", "tables.py"),
    Output("speed", "Step time per method in ms (p50, p20–p80) and its ratio to the compared method, with its "
           "spread (the papers' GPU throughput claims apart, beside the FLOP ratio)", "tables.py"),
    Output("accuracy", "Accuracy (%) / perplexity per method after training: mean and spread over seeds, change "
           "against the compared method", "tables.py"),
    Output("accuracy_short", "Metric of the short memory/speed cells (too few steps to learn: not an accuracy "
           "comparison)", "tables.py"),
    Output("peers", "The newer peers and the optimizers, cell by cell: peak, its split or the bytes saved for "
           "backward, step time and final loss beside the compared method", "tables.py"),
)
RUN_FIGURES = (
    Output("memory_vs_batch", "Peak and activation memory (MiB) against batch size, per method", "plots.py"),
    Output("step_time_ratio", "Step time / compared method's step time (p50, p20–p80 spread), paper's ratio beside",
           "plots.py"),
    Output("accuracy", "Accuracy (%) / perplexity per method after training, every seed and the mean", "plots.py"),
    Output("pareto", "Peak memory against step time per method, per task, with the front", "plots_pareto.py"),
)
# Made only when a cell's method spec carries options (``tokentune@k=4``; e.g. config/tokentune-k.yaml).
OPTION_FIGURES = (
    Output("accuracy_vs_option", "Accuracy (%) / perplexity against a method option swept in the method specs "
           "(e.g. TokenTune's k), the compared method beside", "plots.py"),
)
REPRODUCTIONS = (
    Reproduction("block-breakdown", "block_breakdown",
                 "Activation memory of one block by op kind: baseline vs LowMemoryBP (paper theory beside ours; "
                 "16-bit units of b·s·d)"),
    Reproduction("fig1", "fig1",
                 "LowMemoryBP Fig. 1: peak memory of ViT-B/16, batch 64, LoRA rank 4, fp16 autocast"),
    Reproduction("mesa-table", "mesa_table",
                 "Mesa README: training memory at batch 128, AMP (DeiT-Ti/S/B, Swin-T)"),
    Reproduction("tokentune-memory", "tokentune_memory",
                 "TokenTune: BERT-large memory against batch size (baseline, LoRA, TokenTune k=16, both)"),
    Reproduction("stacked", "stacked",
                 "Each memory lever in turn: LLaMA-7B shapes, batch 2 × 4096 tokens, bf16 — the peak of a training "
                 "step by category (GiB)",
                 how="fake tensors on the CPU at full size; `measured / estimated`: real tensors at a small width, "
                     "the CPU allocator's events"),
    Reproduction("headline", "lowmembp_headline",
                 "LowMemoryBP headline: peak memory saved per model at the paper's settings, ours beside the paper's"),
    Reproduction("mesa-attribution", "mesa_attribution",
                 "Mesa README baselines vs ours: each difference of the 2021 run in MiB (measured or counted), what "
                 "is left unexplained"),
    Reproduction("tokentune-vs-ckpt", "tokentune_vs_ckpt",
                 "TokenTune vs gradient checkpointing: BERT-large peak memory against batch size (fake tensors), "
                 "CPU step time of a small BERT, ratios to full fine-tuning",
                 how="memory: fake tensors on the CPU; step time: real training steps on the CPU"),
    Reproduction("tokentune-k", "tokentune_k",
                 "TokenTune: held-out accuracy against k, full fine-tuning and LoRA beside (small BERT, CPU)",
                 how="real training runs on a generated task, CPU"),
    Reproduction("compiled-saving", "compiled_saving",
                 "Eager vs torch.compile: each method's saving in saved-for-backward bytes both ways, and the share "
                 "that survives compilation (small ViT / BERT / LLaMA, CPU)",
                 how="real tensors on the CPU, eager and torch.compile (inductor)"),
    Reproduction("compiled-budget", "compiled_budget",
                 "torch.compile's memory budget vs LowMemoryBP: saved-for-backward KiB and CPU step time against "
                 "the budget, eager dashed (small ViT / BERT / LLaMA)",
                 how="real tensors on the CPU, eager and torch.compile (inductor's partitioner)"),
    Reproduction("grad-fidelity", "grad_fidelity",
                 "Gradient fidelity: each method's gradient against exact backprop's, same weights and batch, per "
                 "depth (MiniLM-L6, tiny LLaMA, ViT; fp32, bf16 autocast; CPU)",
                 how="one real training step of real weights on real batches, CPU"),
    Reproduction("estimator-error", "estimator_error",
                 "The estimator's error: each method's fake-tensor estimate of a training step's peak beside the CPU "
                 "allocator's peak of the same step (tiny ViT / BERT / LLaMA, fp32)",
                 how="fake tensors (estimate) and real tensors with torch.profiler's allocator events (measured), "
                     "on the CPU"),
    Reproduction("lever-estimates", "lever_estimates",
                 "One lever at a time on a LLaMA-7B training step: the optimizers, tiled MLP and VeLoRA, peak and "
                 "saved bytes by category (GiB)"),
    Reproduction("stacked-full", "stacked_full",
                 "Full fine-tuning levers: each optimizer at LLaMA-7B, and one lever at a time across weights, "
                 "optimizer, activations and loss for LLaMA-7B (batch 4 × 2048) and ViT-B/16 (batch 64), GiB",
                 how="fake tensors on the CPU at full size; `measured / estimated`: real tensors at a small width, "
                     "the CPU allocator's events"),
)
REPRO_SCRIPT = "repro.py"  # reproduction -> repro/<name>.csv
REPRO_TABLE_SCRIPT = "tables.py"
REPRO_FIGURE_SCRIPT = "plots_repro.py"
# What the report opens with (workflow/rules/report.smk): per method, memory saved, step-time cost and metric change
# against the compared method, ours beside the papers'; tables/headline.{md,csv,html} and figures/headline.png.
HEADLINE = Output("headline", "Headline: what each method saves in memory, costs in step time and changes in "
                  "accuracy, ours beside the papers'", "headline.py")
# The convergence evidence (config `evidence:`, workflow/rules/evidence.smk; config/evidence.yaml): paired differences
# over seeds against the compared method with 95 % intervals and a verdict, and the learning curves.
EVIDENCE_TABLE = Output("evidence", "Convergence evidence: each method's change in the metric against the compared "
                        "method, paired over seeds, 95 % interval and verdict", "evidence_table.py")
EVIDENCE_FIGURE = Output("evidence_curves", "Learning curves: test metric against optimizer steps per method",
                         "evidence_plots.py")
TABLE_HTML_SCRIPT = "table_html.py"
NOTEBOOKS = ("memory", "speed", "accuracy", "paper_comparison", "planner")  # notebooks/<name>.ipynb, executed per run

RUN_TABLE = {t.name: t for t in RUN_TABLES}
RUN_FIGURE = {f.name: f for f in RUN_FIGURES + OPTION_FIGURES}
REPRO = {r.name: r for r in REPRODUCTIONS}
REPRO_BY_STEM = {r.stem: r for r in REPRODUCTIONS}


def table_paths(results: str, stem: str) -> dict[str, str]:
    """{"md": ..., "csv": ..., "html": ...} of table ``stem`` under ``results``."""
    return {ext: f"{results}/tables/{stem}.{ext}" for ext in TABLE_FORMATS}


def figure_path(results: str, stem: str) -> str:
    return f"{results}/figures/{stem}.png"


def repro_csv(results: str, name: str) -> str:
    return f"{results}/repro/{name}.csv"


def notebook_path(results: str, name: str) -> str:
    return f"{results}/notebooks/{name}.ipynb"


def check_names(kind: str, given, known) -> None:
    """ValueError naming what is not in the catalogue and what is."""
    bad = [g for g in given if g not in known]
    if bad:
        raise ValueError(f"{kind}: {', '.join(map(repr, bad))} not known; valid: {', '.join(known)}")

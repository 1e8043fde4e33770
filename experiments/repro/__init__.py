"""Reproductions of published memory numbers, each a function returning a pandas DataFrame.

    from experiments.repro import REPROS, run
    df = run("fig1")                 # or REPROS["fig1"](small=True) for a reduced, seconds-long version
    python -m experiments.repro fig1    # prints the table as markdown

Names: ``block-breakdown`` (LowMemoryBP's per-block activation memory by op kind), ``fig1`` (LowMemoryBP Fig. 1 peak
memory), ``mesa-table`` (the Mesa README's memory column), ``tokentune-memory`` (TokenTune memory vs batch size),
``stacked`` (each memory lever in turn, torchtune-style: LLaMA-7B shapes at batch 2 × 4096 tokens, the peak by
category), ``headline``
(LowMemoryBP's headline savings per model at the paper's settings, LLaMA as QLoRA), ``mesa-attribution`` (the
Mesa-table baselines' gap to the README, difference by difference in MiB), ``tokentune-vs-ckpt`` (TokenTune
against gradient checkpointing: peak and CPU step time at growing batch sizes), ``tokentune-k`` (TokenTune's
accuracy against k, beside full fine-tuning and LoRA, on a synthetic task trained on the CPU), ``compiled-saving``
(every method's saved-for-backward bytes eager vs ``torch.compile``d on small ViT / BERT / LLaMA: how much of each
saving survives compilation; small real models on the CPU), ``compiled-budget`` (baseline, lowmembp and
lora+lowmembp at torch.compile memory budgets below 1: saved bytes and CPU step time, eager beside),
``grad-fidelity`` (each approximate method's gradient against exact backprop's: cosine and relative error per layer
on MiniLM, the tiny LLaMA base and a trained ViT, fp32 and bf16, exact methods as controls), ``lever-estimates``
(what the optimizers, tiled MLP and VeLoRA each do to a LLaMA-7B step: the method pages' figures), ``stacked-full``
(the full-fine-tuning levers: each optimizer of another package at LLaMA-7B, and one lever at a time for LLaMA-7B
and ViT-B/16). The
paper-scale ones run the real timm / transformers code on fake tensors (:mod:`lowmembp.estimator.step`): no GPU,
nothing large allocated.
Every table puts the paper's value (where there is one), ours and their ratio side by side, and a ``note`` says why
where they differ by more than 5 %.
"""
from __future__ import annotations

from typing import Callable

import pandas as pd

from experiments.repro._common import MiB, ratio, to_markdown
from experiments.repro.block_breakdown import block_breakdown
from experiments.repro.compiled_budget import compiled_budget
from experiments.repro.compiled_saving import compiled_saving
from experiments.repro.estimator_error import estimator_error
from experiments.repro.fig1 import fig1
from experiments.repro.grad_fidelity import grad_fidelity
from experiments.repro.headline import headline
from experiments.repro.lever_estimates import lever_estimates
from experiments.repro.mesa_attribution import mesa_attribution
from experiments.repro.mesa_table import mesa_table
from experiments.repro.stacked import stacked
from experiments.repro.stacked_full import stacked_full
from experiments.repro.tokentune_k import tokentune_k
from experiments.repro.tokentune_memory import tokentune_memory
from experiments.repro.tokentune_vs_ckpt import tokentune_vs_ckpt

__all__ = ["REPROS", "run", "to_markdown", "MiB", "ratio"]

REPROS: dict[str, Callable[..., pd.DataFrame]] = {
    "block-breakdown": block_breakdown, "fig1": fig1, "mesa-table": mesa_table,
    "tokentune-memory": tokentune_memory, "stacked": stacked, "headline": headline,
    "mesa-attribution": mesa_attribution, "tokentune-vs-ckpt": tokentune_vs_ckpt,
    "tokentune-k": tokentune_k, "compiled-saving": compiled_saving, "compiled-budget": compiled_budget,
    "grad-fidelity": grad_fidelity, "estimator-error": estimator_error, "lever-estimates": lever_estimates,
    "stacked-full": stacked_full}


def run(name: str, **kwargs) -> pd.DataFrame:
    """Run reproduction ``name`` (see :data:`REPROS`); ``small=True`` for the reduced, fast version. A reproduction
    that returns no rows raises ``RuntimeError``: an empty table is a failure, never a result."""
    if name not in REPROS:
        raise ValueError(f"unknown reproduction {name!r}; known: {', '.join(REPROS)}")
    df = REPROS[name](**kwargs)
    if df.empty:
        raise RuntimeError(f"reproduction {name!r} produced no rows (options {kwargs}): nothing to report")
    return df

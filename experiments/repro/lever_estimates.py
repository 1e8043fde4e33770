"""What one lever does to a LLaMA-7B training step, estimated on fake tensors: the figures of the method pages of the
optimizers, tiled MLP and VeLoRA (docs/methods/), each page a ``section`` of the rows.

    df = lever_estimates()                 # one row per (section, method, optimizer)
    python -m experiments.repro lever-estimates

Sections (the settings are the ones where the lever shows; every row the real transformers LLaMA code with LLaMA-7B's
shapes, bf16 autocast, on fake tensors on the CPU — nothing large is allocated):

- ``optimizers``: full fine-tuning, batch 1 × 512 tokens, the weights stored in bf16, once per optimizer of
  :data:`lowmembp.methods.optimizers.OPTIMIZERS`; :func:`lowmembp.estimator.step.estimate_by_depth` (two shallow builds
  extended to 32 blocks);
- ``tiled-mlp``: batch 1 × 16,384 tokens, fp32 weights, all 32 blocks built (:func:`lowmembp.estimator.step.estimate`):
  the baseline, LoRA, block checkpointing and chunked cross-entropy, each without and with ``tiled-mlp``;
- ``velora``: batch 4 × 2048 tokens, fp32 weights, LoRA rank 4 (the library's default), all 32 blocks: LoRA and VeLoRA
  (64 groups, peft's default), alone and with LowMemoryBP or checkpointing.

Columns: ``saved_GiB`` (the bytes saved for backward by one forward), ``peak_GiB`` (the peak of one steady training
step) and the peak's split by category at that moment (``*_at_peak_GiB``: parameters, gradients, optimizer state,
activations, temporaries; :mod:`lowmembp.measurement.peak`). ``small=True``: the same rows at a tiny width (2 blocks,
hidden 64, 64 tokens), seconds in all.
"""
from __future__ import annotations

import pandas as pd

GiB = 2 ** 30
MODEL = "llama-7b"
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# section -> (what the part's heading says, the estimate's settings, the methods)
SECTIONS = {
    "optimizers": ("LLaMA-7B full fine-tuning, batch 1 × 512 tokens, bf16 weights and autocast, per optimizer",
                   dict(batch_size=1, seq_len=512, dtype="bf16", weights="bf16"), ("baseline",)),
    "tiled-mlp": ("LLaMA-7B, batch 1 × 16,384 tokens, fp32 weights, bf16 autocast",
                  dict(batch_size=1, seq_len=16384, dtype="bf16"),
                  ("baseline", "tiled-mlp", "lora", "lora+tiled-mlp", "lora+checkpointing",
                   "lora+checkpointing+tiled-mlp", "lora+checkpointing+chunked-ce",
                   "lora+checkpointing+chunked-ce+tiled-mlp")),
    "velora": ("LLaMA-7B, batch 4 × 2048 tokens, fp32 weights, bf16 autocast, rank 4",
               dict(batch_size=4, seq_len=2048, dtype="bf16"),
               ("lora", "velora", "velora+lowmembp", "lora+checkpointing", "velora+checkpointing")),
}
SMALL = dict(overrides={"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
                        "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 64},
             layers=2, seq_len=64)
SMALL_OPTIONS = {"velora": {"num_groups": 8}}  # below the tiny width (64 features)


def _row(section: str, setting: str, method: str, optimizer: str, est: dict) -> dict:
    cats = est["peak"]["by_category"]
    return {"section": section, "setting": setting, "method": method, "optimizer": optimizer,
            "saved_GiB": est["saved"]["total"] / GiB, "peak_GiB": est["peak"]["bytes"] / GiB,
            **{f"{c}_at_peak_GiB": cats.get(c, 0) / GiB for c in CATEGORIES}}


def lever_estimates(small: bool = False, sections: tuple[str, ...] | None = None) -> pd.DataFrame:
    """One row per (section, method, optimizer); ``sections``: a subset of :data:`SECTIONS`."""
    from lowmembp.estimator.step import estimate, estimate_by_depth
    from lowmembp.methods.optim_levers import LEVERS
    from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS

    rows = []
    for section in sections or tuple(SECTIONS):
        setting, settings, methods = SECTIONS[section]
        settings = {**settings, **(SMALL if small else {})}
        if small:
            setting = f"{section}: the reduced version at a tiny width (2 blocks, hidden 64, 64 tokens)"
        # AdamW and its two levers; the other packages' levers: experiments/repro/stacked_full.py
        optimizers = [o for o in OPTIMIZERS if o not in LEVERS] if section == "optimizers" else (DEFAULT_OPTIMIZER,)
        for method in methods:
            options = SMALL_OPTIONS["velora"] if small and "velora" in method else {}
            for optimizer in optimizers:
                run = estimate if (section != "optimizers" or small) else estimate_by_depth
                est = run(MODEL, method, optimizer=optimizer, **settings, **options)
                rows.append(_row(section, setting, method, optimizer, est))
    return pd.DataFrame(rows)

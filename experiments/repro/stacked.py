"""A torchtune-style stacked table: each row adds one memory technique to the row before (docs/design.md#peers).

For LLaMA-7B (batch 4 × 512 tokens, bf16 autocast, LoRA r 64 α 16 on all seven projections — the paper's QLoRA
setting without the NF4 base) and ViT-B/16 (batch 64, fp16 autocast, LoRA r 4 on qkv/proj/fc1/fc2 — LowMemoryBP
Fig. 1): the peak of one steady training step (device memory), the activation bytes saved for backward, the host
bytes that offloading holds, and each row's change against the row before. Every number is measured by
:func:`lowmembp.estimator.step.estimate_by_depth` (the real model code on fake tensors, two shallow builds extended to
the
full depth); nothing is typed in. A row whose method cannot be estimated on a CPU (``liger``) carries the method's
own refusal in ``note`` and no numbers.

Rows: LoRA → LoRA-FA (A frozen) → + chunked cross-entropy (LLaMA only) → + LowMemoryBP (ReSiLU2/ReGELU2 + MS-norms)
→ + selective activation checkpointing (policy save-attention) → + activation offloading; then Liger-Kernel in place of
the
layers it rewrites (LoRA-FA + Liger + SAC + offload).
"""
from __future__ import annotations

import pandas as pd

from experiments.repro._common import MiB

GPU_ONLY = {"liger"}  # methods with no CPU / fake-tensor path: their rows carry the refusal until a GPU run

# model -> (caption, method options, [(label, spec)]). SAC keeps the attention outputs only: with frozen weights
# (LoRA, LoRA-FA) autograd saves no matmul output, so the "save-matmuls" policy of full fine-tuning would keep more
# than no checkpointing at all (ViT-B/16: 2283 -> 5211 MiB peak; python -m experiments.repro stacked with policy
# changed).
STACKS = {
    "llama-7b": ("LLaMA-7B, batch 4 × 512 tokens, bf16 autocast, LoRA r 64 α 16 on q/k/v/o/gate/up/down",
                 {"rank": 64, "alpha": 16, "policy": "save-attention"}, [
                     ("LoRA", "lora"),
                     ("+ LoRA-FA (A frozen)", "lora-fa"),
                     ("+ chunked cross-entropy", "lora-fa+chunked-ce"),
                     ("+ ReSiLU2 + MS-RMSNorm (LowMemoryBP)", "lora-fa+chunked-ce+lowmembp"),
                     ("+ selective checkpointing (save attention)", "lora-fa+chunked-ce+lowmembp+sac"),
                     ("+ activation offloading", "lora-fa+chunked-ce+lowmembp+sac+offload"),
                     ("Liger-Kernel for chunked CE + LowMemoryBP", "lora-fa+liger+sac+offload"),
                 ]),
    "vit-b16": ("ViT-B/16, 224 px, batch 64, fp16 autocast, LoRA r 4 on qkv/proj/fc1/fc2 (head trainable)",
                {"rank": 4, "policy": "save-attention"}, [
                    ("LoRA", "lora"),
                    ("+ LoRA-FA (A frozen)", "lora-fa"),
                    ("+ ReGELU2 + MS-LayerNorm (LowMemoryBP)", "lora-fa+lowmembp"),
                    ("+ selective checkpointing (save attention)", "lora-fa+lowmembp+sac"),
                    ("+ activation offloading", "lora-fa+lowmembp+sac+offload"),
                    ("Liger-Kernel for LowMemoryBP", "lora-fa+liger+sac+offload"),
                ]),
}


def stacked(small: bool = False, models: tuple[str, ...] = ("llama-7b", "vit-b16")) -> pd.DataFrame:
    """One row per (model, technique added); ``small``: two blocks, batch 2, 64 tokens (seconds, for tests)."""
    from lowmembp.estimator.step import estimate, estimate_by_depth
    from lowmembp.methods.registry import method_options

    rows = []
    for model in models:
        caption, options, stack = STACKS[model]
        kw = {}
        if small:
            kw.update(batch_size=2, layers=2)
            if model.startswith("llama"):
                kw["seq_len"] = 64
        prev = None
        for label, spec in stack:
            row = {"model": model, "row": label, "method": spec}
            takes = method_options(spec)
            opts = dict(kw, **{k: v for k, v in options.items() if k in takes})
            if "policy" in opts:
                row["method"] = f"{spec} (policy {opts['policy']})"
            try:
                est = estimate(model, spec, **opts) if small else estimate_by_depth(model, spec, **opts)
            except (RuntimeError, ValueError, ImportError) as e:
                if not set(spec.split("+")) & GPU_ONLY:
                    raise
                rows.append({**row, "note": str(e).split("\n")[0]})  # the method's own refusal, e.g. "needs a GPU"
                continue
            peak = est["peak"]["bytes"]
            saved = est["saved"]["total"]
            host = (est["peak"].get("host") or {}).get("bytes", 0)
            row.update({"peak_MiB": peak / MiB, "saved_for_backward_MiB": saved / MiB, "host_MiB": host / MiB})
            if prev is not None:
                row.update({"peak_change_MiB": (peak - prev[0]) / MiB, "peak_change_%": 100 * (peak / prev[0] - 1),
                            "saved_change_%": 100 * (saved / prev[1] - 1) if prev[1] else None})
            row["note"] = ""
            rows.append(row)
            prev = (peak, saved)
    cols = ["model", "row", "method", "peak_MiB", "peak_change_MiB", "peak_change_%", "saved_for_backward_MiB",
            "saved_change_%", "host_MiB", "note"]
    df = pd.DataFrame(rows).reindex(columns=cols)
    df.attrs["caption"] = ("Stacked: each row adds one technique to the row before; change against the previous "
                           "measured row. " + "; ".join(f"{m}: {STACKS[m][0]}" for m in models) +
                           ". Peak of one steady training step (AdamW), device bytes on fake tensors (no allocator "
                           "rounding); host_MiB: what offloading holds in host memory at its peak. "
                           + ("Reduced scale (small=True)." if small else "Full depth from 2- and 3-block builds."))
    return df

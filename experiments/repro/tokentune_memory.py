"""TokenTune memory vs batch size: BERT-large, sequence 128, k = 16 selected tokens, fp32.

Ours: the peak of one whole training step (AdamW) on fake tensors for full fine-tuning, LoRA (rank 8 on the
encoder's query/key/value/dense), TokenTune (k = 16) and TokenTune + LoRA, at several batch sizes; and the slope
(MiB per extra sequence), the quantity the paper's figure is about: of the peak, and of what is saved for backward
(``slope_vs_full_ft`` compares the latter: the peak's slope between two batch sizes also moves with where in the
step the peak falls — at small batches full fine-tuning peaks in the optimizer step, on parameters, gradients and
AdamW state, not on activations). The paper (Simoulin et al., arXiv 2501.18824)
gives this as a plot, without a table: it says memory grows far more slowly with the batch for TokenTune than for
full fine-tuning; the ``paper`` column states that claim, ``check`` whether our numbers agree.

Each estimate is measured on 2- and 3-block builds and extended to the 24 blocks
(:func:`lowmembp.estimator.step.estimate_by_depth`: the bytes grow by the same amount per block; equal to the byte to
full-depth runs, ``by_depth=False``).
"""
from __future__ import annotations

import pandas as pd

from experiments.repro._common import MiB

METHODS = {"baseline": "full fine-tuning", "lora": "LoRA (r 8)", "tokentune": "TokenTune (k 16)",
           "lora+tokentune": "TokenTune + LoRA"}


def tokentune_memory(small: bool = False, batch_sizes: tuple[int, ...] = (8, 32), seq_len: int = 128,
                     k: int = 16, by_depth: bool = True) -> pd.DataFrame:
    """One row per method: peak MiB at each batch size, MiB per extra sequence, ratio of slopes to full FT;
    ``by_depth=False`` builds all 24 blocks (slower, the same numbers)."""
    from lowmembp.estimator.step import estimate, estimate_by_depth

    if small:
        batch_sizes, seq_len, k = (2, 4), 24, 4
    rows = []
    slopes = {}
    for method, label in METHODS.items():
        opts = {}
        if "tokentune" in method:
            opts["k"] = k
        if "lora" in method:
            opts["rank"] = 8
        kw = dict(seq_len=seq_len, dtype="fp32", **opts)
        if small:
            kw.update(layers=2, overrides={"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128})
        row = {"method": label, "spec": method}
        peaks, saved = [], []
        for bs in batch_sizes:
            est = (estimate_by_depth if by_depth and not small else estimate)("bert-large", method, batch_size=bs,
                                                                              **kw)
            peaks.append(est["peak"]["bytes"] / MiB)
            saved.append(est["saved"]["total"] / MiB)
            row[f"peak_MiB_b{bs}"] = peaks[-1]
        span = batch_sizes[-1] - batch_sizes[0]
        row["MiB_per_sequence"] = (peaks[-1] - peaks[0]) / span
        slopes[method] = row["saved_MiB_per_sequence"] = (saved[-1] - saved[0]) / span
        rows.append(row)
    for row in rows:
        row["slope_vs_full_ft"] = slopes[row["spec"]] / slopes["baseline"]
        if "tokentune" in row["spec"]:
            row["paper"] = "grows far more slowly than full fine-tuning"
            row["check"] = "yes" if row["slope_vs_full_ft"] < 0.5 else "no"
        else:
            row["paper"] = "reference" if row["spec"] == "baseline" else "LoRA saves parameter state, not activations"
            row["check"] = ""
    df = pd.DataFrame(rows)
    df.attrs["caption"] = (f"BERT-large (24 layers, d 1024), sequence {seq_len}, k = {k}, fp32, AdamW, peak of one "
                           "steady training step on fake tensors. TokenTune keeps K/V and the attention input over "
                           "all L tokens per block (an O(L·d) floor), so its slope is not k/L of full fine-tuning.")
    return df

"""TokenTune against gradient checkpointing: peak memory and step time side by side at growing batch sizes.

The comparison TokenTune's readers found missing (Simoulin et al., arXiv 2501.18824 compares with LoRA and full
fine-tuning only). Peak: BERT-large, sequence 128, fp32, AdamW, one steady training step on fake tensors, built
whole (24 blocks: :func:`lowmembp.estimator.step.estimate_by_depth` does not hold here — with TokenTune + checkpointing
the 2- and 3-block builds peak in the backward, the 24-block one in the optimizer step) for full fine-tuning,
checkpointing every block, TokenTune k = 16 and TokenTune + checkpointing. Step time: measured on this CPU at small
scale (a 4-block BERT of width 128, sequence 128, one thread, the fastest of 5 interleaved steps after a warm-up),
as a ratio to full fine-tuning at the same batch: checkpointing pays one extra forward, TokenTune computes the
unselected rows without a graph.
"""
from __future__ import annotations

import pandas as pd

from experiments.repro._common import MiB

METHODS = {"baseline": "full fine-tuning", "checkpointing": "checkpointing (every block)",
           "tokentune": "TokenTune (k 16)", "tokentune+checkpointing": "TokenTune + checkpointing"}
SMALL = {"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512}


def _opts(method: str, k: int) -> dict:
    return {"k": k} if "tokentune" in method else {}


def step_ms(methods, batch_size: int, *, seq_len: int = 128, k: int = 16, layers: int = 4,
            overrides: dict | None = None, rounds: int = 5) -> dict:
    """{method: ms}: the fastest of ``rounds`` training steps (forward, backward, AdamW) of a small BERT on the CPU,
    one thread, after a warm-up step; the methods take turns each round (the minimum and the interleaving keep other
    processes on a shared machine from favouring one method)."""
    import torch

    import lowmembp
    from lowmembp.estimator.zoo import MODELS, build, compute_loss, make_batch
    from lowmembp.measurement.timing import time_interleaved

    spec = MODELS["bert-large"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {}
        for method in methods:
            torch.manual_seed(0)
            model = build(spec, layers=layers, overrides=overrides or SMALL, device="cpu")
            if method != "baseline":
                model = lowmembp.apply(model, method, **_opts(method, k))
            model.train()
            batch = make_batch(spec, model, batch_size, seq_len, (overrides or {}).get("vocab_size"))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
            runs[method] = (model, batch, opt)

        def step(model, batch, opt):
            def run(_round):
                compute_loss(spec, model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return run

        times = time_interleaved({m: step(*r) for m, r in runs.items()}, rounds=rounds)
        return {m: 1000 * min(t) for m, t in times.items()}
    finally:
        torch.set_num_threads(threads)


def tokentune_vs_ckpt(small: bool = False, batch_sizes: tuple[int, ...] = (8, 32, 64),
                      time_batches: tuple[int, ...] = (4, 16), seq_len: int = 128, k: int = 16) -> pd.DataFrame:
    """One row per method: peak MiB per batch size (paper scale), CPU step ms per batch size (small scale) and
    their ratios to full fine-tuning."""
    from lowmembp.estimator.step import estimate

    kw = dict(seq_len=seq_len, dtype="fp32")
    run = estimate
    t_kw = {}
    if small:
        batch_sizes, time_batches, k = (2, 4), (2,), 4
        kw.update(seq_len=24, layers=2, overrides={"hidden_size": 64, "num_attention_heads": 4,
                                                   "intermediate_size": 128, "vocab_size": 512})
        run = estimate
        t_kw = dict(seq_len=24, layers=2, overrides=kw["overrides"], rounds=1)
    rows = []
    for method, label in METHODS.items():
        row = {"method": label, "spec": method}
        for bs in batch_sizes:
            est = run("bert-large", method, batch_size=bs, **kw, **_opts(method, k))
            row[f"peak_MiB_b{bs}"] = est["peak"]["bytes"] / MiB
        rows.append(row)
    for bs in time_batches:
        times = step_ms(list(METHODS), bs, k=k, **t_kw)
        for row in rows:
            row[f"cpu_step_ms_small_b{bs}"] = times[row["spec"]]
    base = rows[0]
    for row in rows:
        for bs in batch_sizes:
            row[f"peak_vs_full_b{bs}"] = row[f"peak_MiB_b{bs}"] / base[f"peak_MiB_b{bs}"]
        for bs in time_batches:
            row[f"step_vs_full_b{bs}"] = row[f"cpu_step_ms_small_b{bs}"] / base[f"cpu_step_ms_small_b{bs}"]
    df = pd.DataFrame(rows)
    df.attrs["caption"] = (
        f"Peak: BERT-large, sequence {kw['seq_len']}, k = {k}, fp32, AdamW, fake tensors, batches "
        f"{', '.join(map(str, batch_sizes))}. Step time: measured on this CPU (one thread) with a small BERT "
        f"({'the reduced model' if small else '4 blocks, width 128'}), batches {', '.join(map(str, time_batches))}; "
        "ratios to full fine-tuning.")
    return df

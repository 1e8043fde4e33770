"""The full-fine-tuning levers: each optimizer of another package at LLaMA-7B, and the stacked table of full
fine-tuning (one lever added at a time across weights, optimizer, activations and loss) for LLaMA-7B at batch
4 × 2048 and ViT-B/16 at batch 64.

    df = stacked_full()            # one row per (part, model, lever)
    df = stacked_full(small=True)  # the same rows at a tiny width (seconds; tests)

Parts (``part`` column):

- ``optimizers``: LLaMA-7B full fine-tuning, batch 1 × 512 tokens, bf16 weights and autocast (the setting of
  ``lever-estimates``' optimizer rows), once per optimizer: AdamW, then every lever of
  :data:`lowmembp.methods.optim_levers.LEVERS` at its defaults (GaLore / APOLLO rank 128, transformers'), plus
  GaLore at a refresh step (``update_proj_gap=1``: the measured step makes the SVD of every projected gradient,
  one matrix at a time). :func:`lowmembp.estimator.step.estimate_by_depth` (3- and 4-block builds, :data:`SHALLOW`,
  here and below): GaLore's own step on fake tensors; APOLLO,
  Adafactor and torchao's by stand-ins holding their packages' states (:mod:`lowmembp.estimator.optim_standins`);
  the CPU offload's states are host memory, not counted; paged AdamW's states counted as device memory (all pages
  resident: the most they take on the device; the driver may page them out under pressure).
- ``compact``: per model at its stacked setting (AdamW; LLaMA-7B's weights bf16, ViT-B's fp32), CompAct (ratio
  0.25) and LowMemoryBP each alone and together beside the baseline: the bytes saved for backward by one forward
  (whole model, one block) and the peak, with the small width's measured peak beside.
- ``stacked``: per model, the rows of :data:`STACKS`, each adding one lever to the row before (or putting one in
  place of another: the row says so); the peak of one steady step by category, in GiB, from the estimator, and
  beside it the same row at a small width measured on real CPU tensors by the CPU allocator
  (:func:`lowmembp.measurement.peak.profiler_peak`; ``measured / estimated``), where the optimizer runs on the CPU
  (torchao's CPU offload does not: empty there).
"""
from __future__ import annotations

import pandas as pd

GiB = 2 ** 30
CATEGORIES = {"weights": ("parameters",), "gradients": ("gradients",), "optimizer": ("optimizer_state",),
              "activations": ("activations",), "temporaries": ("temporaries", "other")}
OPT_SETTING = dict(batch_size=1, seq_len=512, dtype="bf16", weights="bf16")
REFRESH = "galore-adamw@update_proj_gap=1"  # GaLore at a refresh step: the SVDs in the measured step
# model -> (setting of the estimate, its small width, rows: (lever, category, method spec, optimizer, weights))
STACKS = {
    "llama-7b": (dict(batch_size=4, seq_len=2048, dtype="bf16"),
                 {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "vocab_size": 2048},
                 (("full fine-tuning: fp32 weights, bf16 autocast, AdamW", "-", "baseline", "adamw", "fp32"),
                  ("+ bf16 weights", "weights", "baseline", "adamw", "bf16"),
                  ("+ 8-bit AdamW states (bitsandbytes)", "optimizer", "baseline", "adamw8bit", "bf16"),
                  ("GaLore layer-wise (rank 128) in place of 8-bit AdamW", "optimizer", "baseline",
                   "galore-adamw-layerwise", "bf16"),
                  ("+ LowMemoryBP", "activations", "lowmembp", "galore-adamw-layerwise", "bf16"),
                  ("+ CompAct (ratio 0.25)", "activations", "compact+lowmembp", "galore-adamw-layerwise", "bf16"),
                  ("+ chunked cross-entropy", "loss", "compact+lowmembp+chunked-ce", "galore-adamw-layerwise",
                   "bf16"),
                  ("+ activation checkpointing", "activations", "compact+lowmembp+chunked-ce+checkpointing",
                   "galore-adamw-layerwise", "bf16"))),
    "vit-b16": (dict(batch_size=64, dtype="fp16"),
                {"embed_dim": 96, "num_heads": 3},
                (("full fine-tuning: fp32 weights, fp16 autocast, AdamW", "-", "baseline", "adamw", "fp32"),
                 ("+ 8-bit AdamW states (bitsandbytes)", "optimizer", "baseline", "adamw8bit", "fp32"),
                 ("GaLore layer-wise (rank 128) in place of 8-bit AdamW", "optimizer", "baseline",
                  "galore-adamw-layerwise", "fp32"),
                 ("+ LowMemoryBP", "activations", "lowmembp", "galore-adamw-layerwise", "fp32"),
                 ("+ CompAct (ratio 0.25)", "activations", "compact+lowmembp", "galore-adamw-layerwise", "fp32"),
                 ("+ activation checkpointing", "activations", "compact+lowmembp+checkpointing",
                  "galore-adamw-layerwise", "fp32"))),
}
SMALL = {"llama-7b": dict(overrides={"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
                                     "num_key_value_heads": 4, "vocab_size": 512}, layers=2, seq_len=64),
         "vit-b16": dict(overrides={"img_size": 32, "embed_dim": 48, "num_heads": 3}, layers=2)}
RATIO = "measured / estimated"
# the shallow builds extended to full depth: from 3 and 4 blocks (LLaMA-7B with fp32 weights under bf16 autocast at
# 4 × 2048 peaks at the loss with 2 blocks and in the blocks' backward from 3 on, so (2, 3) would not extend)
SHALLOW = (3, 4)


def _cats(pk: dict) -> dict:
    return {f"{name}_GiB": sum(pk["by_category"].get(k, 0) for k in keys) / GiB for name, keys in CATEGORIES.items()}


def _estimate(model: str, method: str, small: bool, **kw) -> dict:
    from lowmembp.estimator.step import estimate, estimate_by_depth

    if small:
        s = SMALL[model]
        kw = {k: v for k, v in kw.items() if k != "seq_len" or "seq_len" not in s}
        return estimate(model, method, **s, **kw)
    return estimate_by_depth(model, method, shallow=SHALLOW, **kw)


def optimizer_rows(small: bool = False) -> list[dict]:
    """The ``optimizers`` part (module doc)."""
    from lowmembp.methods.optim_levers import LEVERS

    rows = []
    for opt in ("adamw", *LEVERS, REFRESH):
        est = _estimate("llama-7b", "baseline", small, optimizer=opt, **OPT_SETTING)
        pk = est["peak"]
        rows.append({"part": "optimizers", "model": "llama-7b", "lever": opt, "category": "optimizer",
                     "method": f"baseline, {opt}", **_cats(pk), "peak_GiB": pk["bytes"] / GiB,
                     "phase": pk.get("phase")})
    base = rows[0]["optimizer_GiB"]
    for r in rows:
        r["state_vs_adamw"] = r["optimizer_GiB"] / base
    return rows


def measure_small(model: str, spec: str, optimizer: str, weights: str, setting: dict) -> int | None:
    """Peak bytes of one steady step of the row at the small width on real CPU tensors (the CPU allocator's
    events), or None where the optimizer does not run on a CPU."""
    import torch

    import lowmembp
    from lowmembp.estimator.step import DTYPES, _batch, build, make_optimizer, model_spec, storage_dtype, train_step
    from lowmembp.measurement.peak import profiler_peak

    torch.manual_seed(0)
    spec_ = model_spec(model)
    small = STACKS[model][1]
    m = build(spec_, layers=2, overrides=small, device="cpu")
    dt = DTYPES[storage_dtype(weights)]
    if dt is not None:
        m = m.to(dt)
    m = lowmembp.apply(m, spec).train()
    try:
        opt = make_optimizer(m, optimizer)
    except RuntimeError:  # torchao's CPU offload: CUDA only
        return None
    batch = _batch(spec_, m, setting["batch_size"], setting.get("seq_len"), small.get("vocab_size"))
    return profiler_peak(m, opt, lambda: train_step(spec_, m, batch, opt, setting["dtype"]), warmup=1,
                         external=tuple(batch.values()))


def stacked_rows(small: bool = False) -> list[dict]:
    """The ``stacked`` part (module doc)."""
    from lowmembp.estimator.step import estimate

    rows = []
    for model, (setting, width, levers) in STACKS.items():
        prev = None
        for lever, category, spec, opt, weights in levers:
            est = _estimate(model, spec, small, optimizer=opt, weights=weights, **setting)
            pk = est["peak"]
            small_est = est if small else estimate(model, spec, layers=2, overrides=width, optimizer=opt,
                                                   weights=weights, **setting)
            measured = measure_small(model, spec, opt, weights, setting) if not small else None
            rows.append({"part": "stacked", "model": model, "lever": lever, "category": category,
                         "method": f"{spec}, {opt}, {weights} weights", **_cats(pk), "peak_GiB": pk["bytes"] / GiB,
                         "phase": pk.get("phase"),
                         "change_%": None if prev is None else 100 * (pk["bytes"] / prev - 1),
                         RATIO: None if measured is None else measured / small_est["peak"]["bytes"]})
            prev = pk["bytes"]
    return rows


COMPACT = ("baseline", "compact", "lowmembp", "compact+lowmembp")
# the weights of the compact part: LLaMA-7B in bf16 as its stacked rows from the second on (with fp32 weights under
# bf16 autocast the peak of LowMemoryBP's step falls at another point for 3 blocks than for 4 or more, so no two
# shallow builds extend it), ViT-B in fp32 as its stacked rows
COMPACT_WEIGHTS = {"llama-7b": "bf16", "vit-b16": "fp32"}


def compact_rows(small: bool = False) -> list[dict]:
    """The ``compact`` part (module doc): CompAct and LowMemoryBP, each alone and the two together, per model at its
    stacked setting with AdamW and fp32 weights: the bytes saved for backward (whole model and one block) and the
    peak; beside it the same at the small width measured on real CPU tensors."""
    from lowmembp.estimator.step import estimate

    rows = []
    for model, (setting, width, _) in STACKS.items():
        base = None
        w = COMPACT_WEIGHTS[model]
        for spec in COMPACT:
            est = _estimate(model, spec, small, weights=w, **setting)
            pk = est["peak"]
            small_est = est if small else estimate(model, spec, layers=2, overrides=width, weights=w, **setting)
            measured = None if small else measure_small(model, spec, "adamw", w, setting)
            block = sum(est["per_block"].values())
            base = base or (est["saved"]["total"], block)
            rows.append({"part": "compact", "model": model, "lever": spec, "category": "activations",
                         "method": f"{spec}, adamw, {w} weights", **_cats(pk), "peak_GiB": pk["bytes"] / GiB,
                         "saved_GiB": est["saved"]["total"] / GiB, "block_saved_GiB": block / GiB,
                         "saved_vs_baseline": est["saved"]["total"] / base[0],
                         RATIO: None if measured is None else measured / small_est["peak"]["bytes"]})
    return rows


def stacked_full(small: bool = False, parts: tuple[str, ...] = ("optimizers", "stacked", "compact")) -> pd.DataFrame:
    """One row per (part, model, lever); ``small``: every row at a tiny width (no measured column)."""
    rows = ((optimizer_rows(small) if "optimizers" in parts else [])
            + (stacked_rows(small) if "stacked" in parts else [])
            + (compact_rows(small) if "compact" in parts else []))
    df = pd.DataFrame(rows)
    df.attrs["caption"] = (
        "Full fine-tuning levers, estimated on fake tensors on the CPU (GiB at the peak of one steady step, by "
        "category; temporaries include the batch). `optimizers`: LLaMA-7B, batch 1 × 512, bf16 weights and "
        "autocast, each optimizer at its defaults (GaLore / APOLLO rank 128), `state_vs_adamw` its state over "
        f"AdamW's; `{REFRESH}`: GaLore at a step that refreshes its projections (the SVDs). `stacked`: LLaMA-7B at "
        "batch 4 × 2048 (bf16 autocast) and ViT-B/16 at batch 64 (fp16 autocast), one lever at a time, `change_%` "
        f"against the row above; `{RATIO}`: the same row at a small width, 2 blocks, measured by the CPU allocator. "
        "`compact`: CompAct and LowMemoryBP alone and together, saved-for-backward bytes beside the peak."
        + (" Tiny width (small=True)." if small else ""))
    return df

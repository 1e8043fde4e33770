"""The estimator's error: for every method on each model family the adapters know (ViT, BERT, LLaMA) at a tiny
width, the fake-tensor estimate of a training step's peak beside the CPU allocator's measured peak of the same step.

    df = estimator_error()          # one row per (family, method): estimate_KiB, cpu_allocator_KiB, error_%
    python -m experiments.repro estimator-error

The estimate is :func:`lowmembp.estimator.step.estimate` (fake tensors, the exact storage bytes of the step). The
measurement runs the same procedure on real CPU tensors — the model built and the methods applied by
:func:`lowmembp.estimator.step.prepare_model`, the same batch, the optimizer's state made first, one step of
:func:`lowmembp.estimator.step.train_step` — and reads the CPU allocator's own event log over it
(:func:`lowmembp.measurement.peak.profiler_peak`: ``torch.profiler`` memory events, independent of the estimator's
tracker). fp32: on a CPU with AMX, oneDNN's bf16 matmuls allocate reordered weight copies (kernel scratch that
depends on the CPU), which fp32 avoids. ``error_%`` = (estimate - allocator) / allocator. A method that cannot run
on a family (``chunked-ce``: causal LMs only) gets its reason in ``note``. What the estimate cannot see: memory a CPU
kernel allocates for itself inside one op (the convolution backward's im2col buffer of a ViT whose patch embedding
trains, :mod:`lowmembp.measurement.peak`). The CUDA allocator's figures come from the GPU run (benchmarks/), not from
here.
"""
from __future__ import annotations

import contextlib

import pandas as pd

FAMILIES = {  # family -> (paper model, tiny width: overrides, blocks, batch, tokens)
    "vit": ("vit-b16", dict(overrides={"img_size": 32, "embed_dim": 48, "num_heads": 3}, layers=2, batch_size=3)),
    "bert": ("bert-large", dict(overrides={"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4,
                                           "vocab_size": 101}, layers=2, batch_size=3, seq_len=13)),
    "llama": ("llama-7b", dict(overrides={"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
                                          "num_key_value_heads": 4, "vocab_size": 97}, layers=2, batch_size=2,
                               seq_len=11)),
}
# options that fit the tiny shapes (tokentune's default k exceeds 11-13 tokens, velora's 64 groups the 48-64 wide
# inputs; offload everything it may)
TINY_OPTIONS = {"tokentune": {"k": 4}, "velora": {"num_groups": 4}, "offload": {"min_bytes": 0}}
KiB = 1024


def allocator_peak(model_name: str, method: str, *, layers: int, batch_size: int, seq_len: int | None = None,
                   overrides: dict | None = None, dtype: str = "fp32", seed: int = 0, **options) -> int:
    """The CPU allocator's peak of the step :func:`lowmembp.estimator.step.estimate` estimates, on real tensors."""
    import torch

    from lowmembp.estimator.step import make_optimizer, prepare_model, train_step
    from lowmembp.estimator.zoo import make_batch, model_spec
    from lowmembp.measurement.peak import prime_optimizer, profiler_peak

    spec = model_spec(model_name)
    torch.manual_seed(seed)
    model = prepare_model(spec, method, contextlib.nullcontext(), layers=layers, overrides=overrides, device="cpu",
                          **options)
    opt = make_optimizer(model)
    batch = make_batch(spec, model, batch_size, seq_len or spec.seq_len, (overrides or {}).get("vocab_size"))
    prime_optimizer(opt)
    return profiler_peak(model, opt, lambda: train_step(spec, model, batch, opt, dtype), warmup=0,
                         external=tuple(batch.values()))


def machine() -> str:
    """The CPU and torch the allocator's figures come from (they depend on the CPU's kernels)."""
    import platform

    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, torch {torch.__version__.split('+')[0]}"


def methods() -> list[str]:
    """Every single method the planner plans (its combinations of one method)."""
    from lowmembp.plan.combos import combinations

    return [c for c in combinations(max_methods=1)[0]]


def estimator_error(small: bool = False, families: tuple[str, ...] = tuple(FAMILIES)) -> pd.DataFrame:
    """One row per (family, method): the estimate, the CPU allocator's peak (KiB) and the error in %;
    ``small``: baseline, lora and checkpointing only."""
    import warnings

    from lowmembp.estimator.step import estimate

    rows, where = [], machine()
    for family in families:
        model_name, kw = FAMILIES[family]
        for method in (["baseline", "lora", "checkpointing"] if small else methods()):
            opts = TINY_OPTIONS.get(method, {})
            row = {"family": family, "model": model_name, "method": method}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    est = estimate(model_name, method, dtype="fp32", **kw, **opts)["peak"]["bytes"]
                    real = allocator_peak(model_name, method, dtype="fp32", **kw, **opts)
            except Exception as e:  # noqa: BLE001  a method that does not apply to this family: say why
                row.update(machine=where, note=f"not run: {str(e).splitlines()[0].split(' (')[0] if str(e) else e!r}")
                rows.append(row)
                continue
            row.update(estimate_KiB=est / KiB, cpu_allocator_KiB=real / KiB, **{"error_%": 100 * (est - real) / real},
                       machine=where, note="")
            rows.append(row)
    cols = ["family", "model", "method", "estimate_KiB", "cpu_allocator_KiB", "error_%", "machine", "note"]
    return pd.DataFrame(rows).reindex(columns=cols)

"""The stacked table: one memory lever added in turn, for one LLaMA-family model at 4k tokens, batch 2 — in the style
of torchtune's table (Llama 3.2 3B, batch 2, 4096 tokens; docs/design.md#peers).

The model: LLaMA-7B's shapes with a 4096-token context (LLaMA-2-7B's), parameters stored in bf16 and computed under
bf16 autocast (torchtune's full fine-tuning recipes keep the model in bf16), batch 2 × 4096 tokens, AdamW. Each row
is one valid method spec (:func:`lowmembp.methods.registry.parse`) and one optimizer
(:data:`lowmembp.methods.optimizers.OPTIMIZERS`); it adds one lever to the row before, or puts one in place of
another where the two do not compose (the row says which).

The order: the exact levers first — each leaves the training unchanged to rounding — loss, then recomputation, then
where the rest lives: chunked cross-entropy (the logits of 2 × 4096 tokens × 32000 words, one chunk at a time),
activation checkpointing (per block), tiled MLP (inside the recomputed block, one tile's MLP intermediates at a
time), activation offloading (the checkpointed block inputs to host memory), the optimizer step inside the backward
(gradients freed as they are used); then the levers that change the numbers: 8-bit AdamW states (in place of the
fused step: lowmembp's fused step is torch's AdamW, so the two do not compose), LoRA (r 64, α 16 on all seven
projections, in place of full fine-tuning), QLoRA (its frozen base in NF4), LowMemoryBP (ReSiLU2 + MS-RMSNorm), and
TokenTune last (a quarter of the tokens carry gradients), in place of offloading, which it excludes.

Cut Cross-Entropy (``cce``) is not a row: on fake tensors its CPU path (``torch.compile`` of the loss) stops at a
data-dependent shape (``aten.nonzero``), and on a CPU it materialises the logits anyway; its Triton kernel needs
CUDA. ``chunked-ce`` stands in for it: exact, the logits of one chunk alive at a time (CCE keeps none).

Numbers, per row:

- by category (weights, gradients, optimizer state, activations, temporaries and the batch) and the peak of one steady
  training step at full size, in GiB, estimated on fake tensors (:func:`lowmembp.estimator.step.estimate_by_depth`:
  the real transformers code, two shallow builds extended to 32 blocks; nothing typed in). The categories are the
  split at the moment of the peak. QLoRA's NF4 base: bitsandbytes cannot run on fake tensors, so the row is estimated
  on the bf16 base and its block linears' bytes are replaced by NF4's (:func:`experiments.repro.headline.
  _qlora_delta`); bitsandbytes' dequantised bf16 weight, a temporary of each 4-bit matmul, is not counted;
- ``host_GiB``: what offloading holds in host memory at its peak;
- ``measured / estimated``: the same row at a small width (hidden 128, 2 blocks, vocabulary 2048, the same 2 × 4096
  tokens) measured on real tensors by the CPU allocator's own events (:func:`lowmembp.measurement.peak.profiler_peak`)
  over its estimate on fake tensors (device plus host bytes: on a CPU the offloaded copies stay in the same memory).
"""
from __future__ import annotations

import pandas as pd

GiB = 2 ** 30
MODEL = "llama-7b"
BATCH, SEQ_LEN = 2, 4096
CONTEXT = {"max_position_embeddings": SEQ_LEN}  # LLaMA-7B's shapes with LLaMA-2's 4096-token context
WEIGHTS = DTYPE = "bf16"
OPTIONS = {"rank": 64, "alpha": 16, "k": 0.25}  # LoRA r 64 α 16 (all seven projections: lora's default), TokenTune k
QLORA = "@quantize=nf4"  # the lora option that makes QLoRA (lowmembp.methods.qlora)
# the small width of the measured column: every dimension but depth, batch and tokens cut down
SMALL_WIDTH = {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 4,
               "vocab_size": 2048}
SMALL_LAYERS = 2

_EXACT = "chunked-ce+checkpointing+tiled-mlp"
# (lever, method spec, optimizer); each row one lever more than the row before, or one in place of another
ROWS = (
    ("full fine-tuning, AdamW", "baseline", "adamw"),
    ("+ chunked cross-entropy", "chunked-ce", "adamw"),
    ("+ activation checkpointing", "chunked-ce+checkpointing", "adamw"),
    ("+ tiled MLP", _EXACT, "adamw"),
    ("+ activation offloading", f"{_EXACT}+offload", "adamw"),
    ("+ optimizer step in the backward", f"{_EXACT}+offload", "adamw-fused-backward"),
    ("8-bit AdamW in place of the fused step", f"{_EXACT}+offload", "adamw8bit"),
    ("LoRA in place of full fine-tuning", f"lora+{_EXACT}+offload", "adamw8bit"),
    ("+ NF4 base (QLoRA)", f"lora{QLORA}+{_EXACT}+offload", "adamw8bit"),
    ("+ LowMemoryBP", f"lora{QLORA}+lowmembp+{_EXACT}+offload", "adamw8bit"),
    ("TokenTune in place of offloading", f"lora{QLORA}+lowmembp+tokentune+{_EXACT}", "adamw8bit"),
)
CATEGORIES = {"weights": ("parameters",), "gradients": ("gradients",), "optimizer": ("optimizer_state",),
              "activations": ("activations",), "temporaries": ("temporaries", "other")}
RATIO = "measured / estimated"


def options_of(spec: str) -> dict:
    """The options of :data:`OPTIONS` that the methods of ``spec`` take."""
    from lowmembp.methods.registry import method_options

    takes = method_options(spec)
    return {k: v for k, v in OPTIONS.items() if k in takes}


def estimate_row(spec: str, optimizer: str, *, full: bool = True, seq_len: int = SEQ_LEN) -> dict:
    """One row's estimate on fake tensors: full size (``full``) or the small width; QLoRA's NF4 base replacing the
    bf16 block linears' bytes in the peak and in ``by_category["parameters"]``."""
    from experiments.repro.headline import _qlora_delta
    from lowmembp.estimator.step import estimate, estimate_by_depth

    plain = spec.replace(QLORA, "")
    overrides = dict(CONTEXT, **({} if full else SMALL_WIDTH))
    kw = dict(batch_size=BATCH, seq_len=seq_len, weights=WEIGHTS, dtype=DTYPE, optimizer=optimizer,
              overrides=overrides, **options_of(plain))
    est = estimate_by_depth(MODEL, plain, **kw) if full else estimate(MODEL, plain, layers=SMALL_LAYERS, **kw)
    if plain != spec:
        delta = _qlora_delta(MODEL, None if full else SMALL_LAYERS, overrides, WEIGHTS)
        pk = est["peak"]
        pk["bytes"] -= delta
        pk["by_category"]["parameters"] -= delta
    return est


def measure_small(spec: str, optimizer: str, *, seq_len: int = SEQ_LEN) -> int:
    """Peak bytes of one steady training step of ``spec`` at the small width on real CPU tensors, from the CPU
    allocator's events (after one warm-up step that makes the optimizer state)."""
    import torch

    import lowmembp
    from lowmembp.estimator.step import DTYPES, build, make_optimizer, model_spec, train_step
    from lowmembp.measurement.peak import profiler_peak

    torch.manual_seed(0)
    spec_ = model_spec(MODEL)
    model = build(spec_, layers=SMALL_LAYERS, overrides=dict(CONTEXT, **SMALL_WIDTH), device="cpu")
    # every method in one apply: QLoRA quantises after LowMemoryBP's folds (lowmembp.methods.qlora)
    model = lowmembp.apply(model.to(DTYPES[WEIGHTS]), spec, **options_of(spec)).train()
    opt = make_optimizer(model, optimizer)
    ids = torch.randint(3, SMALL_WIDTH["vocab_size"], (BATCH, seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}
    return profiler_peak(model, opt, lambda: train_step(spec_, model, batch, opt, DTYPE), warmup=1,
                         external=tuple(batch.values()))


def device_and_host(est: dict) -> int:
    """The bytes a CPU holds at the estimate's device peak: device bytes plus the host copies then alive."""
    pk = est["peak"]
    return pk["bytes"] + ((pk.get("host") or {}).get("at_device_peak") or 0)


def stacked(small: bool = False, rows: tuple[str, ...] | None = None) -> pd.DataFrame:
    """One row per lever (see the module doc); ``small``: the full-size columns at the small width too and 256
    tokens (for tests); ``rows``: only the rows of these levers (``change_%`` then against the row above in the
    result)."""
    seq_len = 256 if small else SEQ_LEN
    if rows is not None:
        unknown = set(rows) - {r[0] for r in ROWS}
        if unknown:
            raise ValueError(f"stacked: unknown rows {sorted(unknown)}; the rows: {[r[0] for r in ROWS]}")
    out, prev = [], None
    for lever, spec, optimizer in ROWS:
        if rows is not None and lever not in rows:
            continue
        est = estimate_row(spec, optimizer, full=not small, seq_len=seq_len)
        pk = est["peak"]
        cats = {f"{name}_GiB": sum(pk["by_category"].get(k, 0) for k in keys) / GiB
                for name, keys in CATEGORIES.items()}
        small_est = est if small else estimate_row(spec, optimizer, full=False, seq_len=seq_len)
        measured = measure_small(spec, optimizer, seq_len=seq_len)
        out.append({"lever": lever, "method": f"{spec}, {optimizer}", **cats, "peak_GiB": pk["bytes"] / GiB,
                     "change_%": None if prev is None else 100 * (pk["bytes"] / prev - 1),
                     "host_GiB": (pk.get("host") or {}).get("bytes", 0) / GiB,
                     RATIO: measured / device_and_host(small_est)})
        prev = pk["bytes"]
    df = pd.DataFrame(out)
    size = (f"small width ({SMALL_LAYERS} blocks, hidden {SMALL_WIDTH['hidden_size']}), {seq_len} tokens" if small
            else f"LLaMA-7B shapes, 32 blocks, {seq_len}-token context")
    df.attrs["caption"] = (
        f"Each lever in turn: {size}, batch {BATCH} × {seq_len} tokens, {WEIGHTS} weights, {DTYPE} autocast, "
        "LoRA r 64 α 16 on all seven projections, TokenTune k = 25 % of the tokens. GiB at the peak of one steady "
        "training step, by category, estimated on fake tensors on the CPU (temporaries include the batch); "
        "`change_%` against the row above; `host_GiB` what offloading holds in host memory; "
        f"`{RATIO}`: the same row at hidden {SMALL_WIDTH['hidden_size']}, {SMALL_LAYERS} blocks, measured by the "
        "CPU allocator over its fake-tensor estimate.")
    return df

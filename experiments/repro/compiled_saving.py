"""Eager vs compiled: saved-for-backward bytes of every method on small ViT / BERT / LLaMA, and how much of each
method's saving survives ``torch.compile``.

    df = compiled_saving()                      # python -m experiments.repro compiled-saving   (~3 CPU-minutes)
    df = compiled_saving(small=True)            # 1 block, L = 16: every method × family, ~2 CPU-min
    compiled_saving(backend="inductor")         # the real code generator (slower; same partitioner)

Models (random weights, fp32, training mode, batch 2, ``depth`` blocks of width 64, 4 heads; the models of
``benchmarks/saved_bytes_methods.py``): timm ViT on a 64 × L image in 8-px patches (L patches + the class token), BERT
for sequence classification, LLaMA for causal LM (2 KV heads, intermediate 172), L tokens each. Eager: the forward
under :class:`lowmembp.measurement.saved.SavedTensorAccountant`. Compiled: the same model with ``compile`` applied last
(``<method>+compile``); one forward + backward first compiles both graphs outside the count, then the forward runs
under the same accountant (the compiled autograd function saves through ``save_for_backward``, which its hooks see;
parameters excluded as for eager). ``saving`` = 1 − bytes / the baseline's bytes in the same mode (eager against the
eager baseline, compiled against the compiled baseline); ``kept`` = compiled saving / eager saving.

Default backend ``aot_eager_decomp_partition``: inductor's decompositions and min-cut partitioner without code
generation, at a fraction of inductor's compile time (``inductor`` gave the same figures for baseline and lowmembp
except on ViT, README "Use it with torch.compile").
Why LLaMA keeps less (README "Use it with torch.compile"; per tensor: :mod:`experiments.repro.partitioner_saved`): the
compiled baseline already drops what lowmembp drops in eager — the partitioner recomputes silu(g) and the RMSNorm's
x·rstd in the backward — and a SwiGLU needs silu(g) itself for ∂/∂u, so ReSiLU2's codes cannot replace it; what is
left of the saving is MS-RMSNorm's (no norm input, no residual saved).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import pandas as pd

FAMILIES = ("vit", "bert", "llama")
METHODS = ("baseline", "lowmembp", "mesa", "lora", "lora+lowmembp", "checkpointing", "tokentune")
WIDTH, HEADS, VOCAB = 64, 4, 97
KiB = 1024


def build(family: str, seq_len: int = 64, batch: int = 2, depth: int = 2, seed: int = 0):
    """``(model in train mode, forward)`` for ``family`` at ``seq_len`` tokens; ``forward(model)`` returns the loss
    of one fixed batch."""
    import transformers

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if family == "vit":
        from timm.models.vision_transformer import VisionTransformer

        if seq_len % 8:
            raise ValueError(f"vit: seq_len must be a multiple of 8 (8-px patches, 64-px high image), got {seq_len}")
        model = VisionTransformer(img_size=(64, seq_len), patch_size=8, embed_dim=WIDTH, depth=depth,
                                  num_heads=HEADS, num_classes=5)
        x, labels = torch.randn(batch, 3, 64, seq_len, generator=g), torch.randint(0, 5, (batch,), generator=g)

        def forward(m):
            return nn.functional.cross_entropy(m(x), labels)
    elif family == "bert":
        cfg = transformers.BertConfig(hidden_size=WIDTH, num_hidden_layers=depth, num_attention_heads=HEADS,
                                      intermediate_size=4 * WIDTH, vocab_size=VOCAB, max_position_embeddings=seq_len,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
        model = transformers.BertForSequenceClassification(cfg)
        b = {"input_ids": torch.randint(1, VOCAB, (batch, seq_len), generator=g),
             "labels": torch.randint(0, 3, (batch,), generator=g)}

        def forward(m):
            return m(**b).loss
    elif family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=WIDTH, num_hidden_layers=depth, num_attention_heads=HEADS,
                                       num_key_value_heads=HEADS // 2, intermediate_size=172, vocab_size=VOCAB,
                                       max_position_embeddings=seq_len, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(1, VOCAB, (batch, seq_len), generator=g)

        def forward(m):
            return m(input_ids=ids, labels=ids).loss
    else:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    model.train()
    return model, forward


def read_choices(methods: str, families: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The comma-separated ``--methods`` / ``--families`` of the benchmarks built on these models, checked before any
    work: ValueError naming what is unknown and what is valid (an empty list included)."""
    ms = tuple(m.strip() for m in methods.split(",") if m.strip())
    fs = tuple(f.strip() for f in families.split(",") if f.strip())
    if not ms or not fs:
        raise ValueError(f"--methods and --families each need at least one name (families: {', '.join(FAMILIES)})")
    bad = [f for f in fs if f not in FAMILIES]
    if bad:
        raise ValueError(f"unknown famil{'ies' if len(bad) > 1 else 'y'} {', '.join(map(repr, bad))}; "
                         f"choose from {', '.join(FAMILIES)}")
    from lowmembp.methods.registry import parse

    for m in ms:
        parse(m)  # ValueError: an unknown method, a conflict, a bad option
    return ms, fs


def convert(model: nn.Module, method: str, k: int = 16, **options) -> nn.Module:
    """``lowmembp.apply(model, method)`` (``k`` for TokenTune); ``baseline`` leaves the model as it is."""
    import lowmembp

    if method == "baseline":
        return model
    if "tokentune" in method.split("+"):
        options = dict(options, k=k, seed=0)
    return lowmembp.apply(model, method, **options)


def measure(family: str, method: str, compiled: bool, seq_len: int = 64, batch: int = 2, depth: int = 2,
            k: int = 16, backend: str = "aot_eager_decomp_partition") -> int:
    """Saved-for-backward bytes of one training forward of ``method`` on ``family``, eager or compiled."""
    from lowmembp.measurement.saved import saved_bytes

    torch.compiler.reset()
    model, forward = build(family, seq_len, batch, depth)
    if compiled:
        model = convert(model, "compile" if method == "baseline" else f"{method}+compile", k,
                        compile_backend=backend)
        torch.manual_seed(0)
        forward(model).backward()  # compiles the forward and the backward graph, outside the count
        model.zero_grad(set_to_none=True)
    else:
        model = convert(model, method, k)
    torch.manual_seed(0)
    return saved_bytes(model, lambda: forward(model))["total"]


def compiled_saving(small: bool = False, methods: tuple[str, ...] = METHODS, families: tuple[str, ...] = FAMILIES,
                    seq_len: int | None = None, batch: int = 2, depth: int | None = None, k: int | None = None,
                    backend: str = "aot_eager_decomp_partition") -> pd.DataFrame:
    """One row per (family, method): eager and compiled KiB, the saving against the baseline in each mode, and the
    share of the eager saving kept when compiled. ``small``: 1 block at L = 16 (k = 4)."""
    seq_len = seq_len or (16 if small else 64)
    depth = depth or (1 if small else 2)
    k = k or (4 if small else 16)
    methods = ("baseline",) + tuple(m for m in methods if m != "baseline")
    rows = []
    for family in families:
        base = {c: measure(family, "baseline", c, seq_len, batch, depth, k, backend) for c in (False, True)}
        for method in methods:
            v = base if method == "baseline" else {c: measure(family, method, c, seq_len, batch, depth, k, backend)
                                                   for c in (False, True)}
            se, sc = 1 - v[False] / base[False], 1 - v[True] / base[True]
            rows.append({"family": family, "method": method, "eager_KiB": v[False] / KiB,
                         "compiled_KiB": v[True] / KiB, "eager_saving_%": 100 * se, "compiled_saving_%": 100 * sc,
                         "kept_%": 100 * sc / se if method != "baseline" and se > 0 else None,
                         "note": _note(family, method, se, sc)})
    df = pd.DataFrame(rows)
    df.attrs["caption"] = (f"saved for backward, KiB; fp32, batch {batch}, L = {seq_len}, {depth} block(s) of width "
                           f"{WIDTH}, k = {k} (tokentune); compiled with {backend} (inductor's partitioner). saving: "
                           "against the baseline in the same mode; kept: compiled saving / eager saving.")
    return df


def _note(family: str, method: str, eager_saving: float, compiled_saving: float) -> str:
    if method == "baseline" or eager_saving <= 0 or compiled_saving >= 0.9 * eager_saving:
        return ""
    if family == "llama":
        return ("the compiled baseline already recomputes silu(g) from g and each RMSNorm's x·rstd (min-cut "
                "partitioner): the tensors this method drops or shrinks in eager; the SwiGLU product needs silu(g) "
                "(or g) in full precision for ∂/∂u whatever the method (docs/methods/compile.md: the bound)")
    return "the partitioner recomputes part of what this method drops in eager"

"""Saved-for-backward bytes of one transformer block by op kind: baseline vs ``lowmembp``, beside the paper's theory.

    python benchmarks/block_breakdown.py                    # ViT-B/16, a LLaMA-7B and a LLaMA-13B layer, bf16 autocast
    python benchmarks/block_breakdown.py --models vit_b16 --batch-size 8 --dtype fp16

The real timm / transformers code runs on fake tensors (lowmembp.estimate: meta-device build, ``to_empty`` inside
``FakeTensorMode``, lowmembp.memory's storage-deduplicated accountant), so nothing large is allocated. One middle block
is reported, in units of ``b·s·d`` 16-bit values (``2·b·s·d`` bytes), like the paper (LowMemoryBP §3 / DESIGN §3):

- ViT block, 19 units: LayerNorm inputs 2+2 (fp32 under autocast), GELU input 4, attention 4 (FlashAttention: q, k, v,
  o), linear inputs qkv 1 + proj 1 + fc1 1 + fc2 4. LowMemoryBP frees 4 (MS-LN) + 3.5 (ReGELU2) → 39.47 %.
- LLaMA layer, 11 + 4r units (r = d_ff / d): RMSNorm 4, attention 4, SiLU input r, Hadamard product 2r, linear inputs
  3 + r. LowMemoryBP frees 4 + 0.875·r → 29.19 % at r = 2.7.

A storage saved by two ops (an MS-norm output that the next linear saves too, the attention output that is also the
projection's input) is counted once, under ``linear`` (the paper's convention); see lowmembp/memory_kinds.py.
"""
from __future__ import annotations

import argparse
import sys

KINDS = ("act", "norm", "attention", "linear", "product", "other")
LABEL = {"act": "activation fn", "norm": "norm", "attention": "attention", "linear": "linear input",
         "product": "elementwise prod", "other": "other"}


def theory(family: str, r: float) -> tuple[dict, dict]:
    """(baseline, lowmembp) units per kind from the paper's model."""
    if family == "vit":
        base = {"act": 4, "norm": 4, "attention": 4, "linear": 7, "product": 0, "other": 0}
        conv = dict(base, act=0.5, norm=0)
    else:
        base = {"act": r, "norm": 4, "attention": 4, "linear": 3 + r, "product": 2 * r, "other": 0}
        conv = dict(base, act=r / 8, norm=0)
    return base, conv


# Why real code differs from the paper's model, per (family, kind), used when the numbers differ by > 0.05 units.
WHY = {
    ("vit", "attention"): "timm's attention output is the proj input: one storage, counted under linear",
    ("vit", "norm"): "LayerNorm saves its fp32 input (2+2) plus mean/rstd per row",
    ("vit", "linear"): "",
    ("llama", "attention"): "o (the SDPA output) is the o_proj input, counted under linear; q, k, v + log-sum-exp "
                            "stay here",
    ("llama", "norm"): "transformers' LlamaRMSNorm upcasts: it saves the fp32 input and the fp32 normalised "
                       "tensor (x·rstd) for the γ-multiply: 2 fp32 tensors per norm, 8 units, not 4",
    ("llama", "linear"): "autocast casts the (fp32) RMSNorm output separately for q, k, v and for gate, up: 5 bf16 "
                         "copies instead of 2; MS-RMSNorm emits bf16 once, so converted it is 3 + r again",
}


def run(model: str, family: str, batch_size: int, seq_len: int | None, dtype: str, layers: int | None):
    from lowmembp.estimate import _HF_CONFIGS, MODELS, estimate
    spec = MODELS[model]
    kw = dict(batch_size=batch_size, dtype=dtype, peak=False, layers=layers)
    if seq_len:
        kw["seq_len"] = seq_len
    base = estimate(model, "baseline", **kw)
    conv = estimate(model, "lowmembp", **kw)
    if spec.family == "timm":
        d = {"vit_base_patch16_224": 768, "vit_large_patch16_224": 1024}.get(spec.arch, 768)
        r = 4.0
    else:
        cfg = _HF_CONFIGS[spec.arch]
        d, r = cfg["hidden_size"], cfg["intermediate_size"] / cfg["hidden_size"]
    unit = 2 * base["batch_size"] * base["seq_len"] * d
    return base, conv, unit, r


def table(name: str, family: str, base: dict, conv: dict, unit: int, r: float) -> list[str]:
    tb, tc = theory(family, r)
    rb = {k: base["per_block"][k] / unit for k in KINDS}
    rc = {k: conv["per_block"][k] / unit for k in KINDS}
    lines = [f"\n{name}: batch {base['batch_size']} × {base['seq_len']} tokens, {base['dtype']} autocast, "
             f"one middle block of {base['layers']}; unit = 2·b·s·d bytes = {unit / 2**20:.2f} MiB"
             + (f"; r = d_ff/d = {r:.4f}" if family == "llama" else ""),
             f"{'op kind':<17}{'paper base':>11}{'paper conv':>11}{'real base':>11}{'real conv':>11}"
             f"{'real MiB base→conv':>22}"]
    for k in KINDS:
        if max(tb[k], rb[k], rc[k]) == 0:
            continue
        mib = f"{base['per_block'][k] / 2**20:8.2f} → {conv['per_block'][k] / 2**20:.2f}"
        lines.append(f"{LABEL[k]:<17}{tb[k]:>11.2f}{tc[k]:>11.2f}{rb[k]:>11.2f}{rc[k]:>11.2f}{mib:>22}")
    stb, stc, srb, src = (sum(t.values()) for t in (tb, tc, rb, rc))
    lines.append(f"{'total':<17}{stb:>11.2f}{stc:>11.2f}{srb:>11.2f}{src:>11.2f}"
                 f"{base['per_block'] and sum(base['per_block'].values()) / 2**20:>11.2f} → "
                 f"{sum(conv['per_block'].values()) / 2**20:.2f}")
    lines.append(f"saving: paper {100 * (1 - stc / stb):.2f} %  |  real {100 * (1 - src / srb):.2f} % of the real "
                 f"baseline  |  real freed {srb - src:.2f} units vs paper {stb - stc:.2f}; against the paper's "
                 f"idealised baseline the real converted block is {100 * (1 - src / stb):.2f} % smaller")
    for k in KINDS:
        if abs(rb[k] - tb[k]) > 0.05 or abs(rc[k] - tc[k]) > 0.05:
            why = WHY.get((family, k)) or "see lowmembp/memory_kinds.py for what is counted here"
            lines.append(f"  {LABEL[k]}: paper {tb[k]:.2f}→{tc[k]:.2f}, real {rb[k]:.2f}→{rc[k]:.2f}: {why}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="vit_b16,llama_7b,llama_13b",
                    help="comma-separated keys of lowmembp.estimate.MODELS (vit_b16, vit_l16, llama_7b, llama_13b)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 8 (ViT), 1 (LLaMA); bytes scale linearly")
    ap.add_argument("--seq-len", type=int, default=512, help="LLaMA tokens per sequence (default 512)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--layers", type=int, default=3,
                    help="blocks to build (default 3; the middle one is reported, all blocks are alike)")
    args = ap.parse_args(argv)
    for model in args.models.split(","):
        model = model.strip()
        family = "vit" if model.startswith("vit") else "llama"
        bs = args.batch_size or (8 if family == "vit" else 1)
        base, conv, unit, r = run(model, family, bs, None if family == "vit" else args.seq_len, args.dtype,
                                  args.layers)
        print("\n".join(table(model, family, base, conv, unit, r)))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""LowMemoryBP's activation memory of one transformer block by op kind: baseline vs ``lowmembp``, paper vs real code.

Units: ``b·s·d`` 16-bit values (``2·b·s·d`` bytes) per block, like the paper (docs/design.md#papers). Columns:

- ``paper_base`` / ``paper_lowmembp``: the paper's idealised block (FlashAttention saving q, k, v, o; fp32 norm inputs
  under autocast; ViT 19 units → 39.47 % freed; LLaMA 11 + 4r units → 29.19 % freed at r = 2.7);
- ``real_base`` / ``real_lowmembp``: the real timm / transformers block, counted by :mod:`lowmembp.measurement.saved` on
fake
  tensors under 16-bit CPU autocast (one middle block; a storage shared by two ops counted once, under ``linear``).

The last rows per model give the total and the saving: against the real baseline, and against the paper's idealised
baseline (``note``).
"""
from __future__ import annotations

import pandas as pd

SLICES = ("act", "norm", "attention", "linear", "product", "other")
LABEL = {"act": "activation fn", "norm": "norm", "attention": "attention", "linear": "linear inputs",
         "product": "Hadamard product", "other": "other"}
PAPER_R = 2.7  # the paper's d_ff / d for LLaMA

WHY = {
    ("vit", "attention"): "timm's attention output o is the proj input: one storage, counted under linear inputs",
    ("vit", "linear"): "includes o (shared with attention, see there)",
    ("vit", "norm"): "LayerNorm also saves mean and rstd (fp32, one per row)",
    ("llama", "norm"): "transformers' LlamaRMSNorm saves its fp32 input and the fp32 normalised x·rstd (for the "
                       "γ multiply): 8 units, not 4",
    ("llama", "linear"): "autocast casts the fp32 RMSNorm output separately for q, k, v and again for gate, up "
                         "(5 bf16 copies, not 2), and o is the o_proj input (shared with attention); MS-RMSNorm "
                         "emits bf16 once",
    ("llama", "attention"): "o is counted under linear inputs (it is the o_proj input); q, k, v and the "
                            "log-sum-exp stay here",
    ("llama", "product"): "the product saves SiLU's output and up's output (2r), as in the paper",
    ("llama", "act"): "ReSiLU2 keeps 2-bit codes (r/8)",
    ("vit", "act"): "ReGELU2 keeps 2-bit codes (0.5 units)",
}


def _off(real: float, paper: float) -> bool:
    """More than 5 % apart (and more than 0.05 units: rstd-sized leftovers do not count)."""
    return abs(real - paper) > max(0.05 * paper, 0.05)


def theory(family: str, r: float = PAPER_R) -> tuple[dict, dict]:
    """(baseline, lowmembp) units per slice in the paper's model of a block."""
    if family == "vit":
        base = {"act": 4.0, "norm": 4.0, "attention": 4.0, "linear": 7.0, "product": 0.0, "other": 0.0}
        return base, dict(base, act=0.5, norm=0.0)
    base = {"act": r, "norm": 4.0, "attention": 4.0, "linear": 3.0 + r, "product": 2.0 * r, "other": 0.0}
    return base, dict(base, act=r / 8, norm=0.0)


MODELS = {  # name -> (estimate key, family, hidden size, r (real), batch, seq_len or None)
    "ViT-B/16": ("vit-b16", "vit", 768, 4.0, 64, None),
    "LLaMA-7B": ("llama-7b", "llama", 4096, 11008 / 4096, 4, 512),
    "LLaMA-13B": ("llama-13b", "llama", 5120, 13824 / 5120, 4, 512),
}


def block_breakdown(small: bool = False, models: tuple[str, ...] | None = None) -> pd.DataFrame:
    """One row per (model, slice) plus total and saving rows; ``small``: tiny batch/sequence (same per-token units)."""
    from lowmembp.estimator.step import estimate

    rows = []
    for name in models or tuple(MODELS):
        key, family, d, r_real, bs, L = MODELS[name]
        kw = dict(batch_size=2 if small else bs, peak=False, layers=3)
        if L is not None:
            kw["seq_len"] = 32 if small else L
        measured = {}
        for method in ("baseline", "lowmembp"):
            est = estimate(key, method, **kw)
            unit = 2 * est["batch_size"] * est["seq_len"] * d
            measured[method] = {k: est["per_block"][k] / unit for k in SLICES}
        rb, rc = measured["baseline"], measured["lowmembp"]
        tb, tc = theory(family)
        tot = {n: sum(v.values()) for n, v in (("tb", tb), ("tc", tc), ("rb", rb), ("rc", rc))}
        for k in SLICES:
            if max(tb[k], rb[k], rc[k]) == 0:
                continue
            off = _off(rb[k], tb[k]) or _off(rc[k], tc[k])
            rows.append({"model": name, "slice": LABEL[k], "paper_base": tb[k], "paper_lowmembp": tc[k],
                         "real_base": rb[k], "real_lowmembp": rc[k],
                         "paper_share_%": 100 * tb[k] / tot["tb"], "real_share_%": 100 * rb[k] / tot["rb"],
                         "note": WHY.get((family, k), "") if off else ""})
        rows.append({"model": name, "slice": "total", "paper_base": tot["tb"], "paper_lowmembp": tot["tc"],
                     "real_base": tot["rb"], "real_lowmembp": tot["rc"], "paper_share_%": 100.0,
                     "real_share_%": 100.0,
                     "note": (f"r = d_ff/d = {r_real:.4f} in the real model, {PAPER_R} in the paper"
                              if family == "llama" else "")})
        rows.append({"model": name, "slice": "saving %", "paper_base": None,
                     "paper_lowmembp": 100 * (1 - tot["tc"] / tot["tb"]), "real_base": None,
                     "real_lowmembp": 100 * (1 - tot["rc"] / tot["rb"]), "paper_share_%": None, "real_share_%": None,
                     "note": f"real converted block vs the paper's idealised baseline: "
                             f"{100 * (1 - tot['rc'] / tot['tb']):.2f} % smaller; freed {tot['rb'] - tot['rc']:.2f} "
                             f"units (paper {tot['tb'] - tot['tc']:.2f})"})
    df = pd.DataFrame(rows)
    df.attrs["caption"] = ("Units of b·s·d 16-bit values per block (one middle block, fake tensors, 16-bit CPU "
                           "autocast, CPU flash attention). paper_* from LowMemoryBP §3; real_* measured on the "
                           "timm / transformers code.")
    return df

"""LowMemoryBP Fig. 1, peak-memory column: ViT-B/16, 224 px, batch 64, LoRA rank 4, fp16 autocast.

Ours: the peak of one whole training step (forward, backward, AdamW step) of the real timm model with each method,
on fake tensors (:func:`lowmembp.estimate.estimate_by_depth`): exact tensor bytes, no CUDA allocator.

The setting, from the official code (github yyyyychen/LowMemoryBP, read at the mirror's HEAD; ``vit_exp`` =
``experiments/vit_exp``):

- LoRA targets. ``vit_exp/configs/cifar100/lora_qv_ViT_B_baseline.yaml:45-54``: ``fc_lora [false, false]``,
  ``proj_lora false``, ``qkv_lora [true, false, true]``, rank 4 (q and v only); ``lora_all_*.yaml:45-54``: all six
  linears. Batch 64 per GPU (``:2``), AMP (``:88``).
- Which setting Fig. 1 is: its LoRA peak (3827 MiB) is what q/v adapters give. Counting the official block's saved
  tensors (below) in 16-bit units of b·s·d: lora_qv 14 per block, lora_all 21; at 18.5 MiB a unit and 12 blocks
  that is ≈ 3.1 GiB vs ≈ 4.7 GiB of saved activations beside 330 MiB of weights, and only the first fits 3827 MiB.
  So ``lora_qv`` is the default row set here, ``lora_all`` the second.
- What their LoRA saves. ``vit_exp/model/lora.py:11-22`` (``LoraFunction``, ``custom_fwd`` without ``cast_inputs``)
  saves ``A, B, x`` with ``x`` as it comes: the LayerNorm output, fp32 under AMP (2 units), where peft's
  ``lora_A`` saves the fp16 copy autocast makes (1 unit). ``lora.py:140-143``: the frozen ``F.linear`` beside it
  saves nothing. q and v are separate rank-4 adapters (``lora.py:162-170``); ours is one rank-4 adapter on timm's
  fused ``qkv``: the same 12 288 LoRA parameters per block.
- Attention: ``F.scaled_dot_product_attention`` (``lora.py:182``, ``vit_exp/model/vit.py:35``): fused, saves q, k, v
  and the output, as ours (timm ``fused_attn``).
- MS-LN: ``lomem/normalization.py:10-15`` saves the normalised output ``out`` (and ``rstd``) as the kernel returns
  it: fp32 for the fp32 residual stream (2 units), and the q/v ``LoraFunction`` saves that same tensor. Ours saves
  the output in the compute dtype (fp16, 1 unit).
- Measurement: ``vit_exp/engine.py:23-24`` resets the peak at each accumulation step, ``:64`` takes
  ``torch.cuda.max_memory_allocated() / 1024**2``, the maximum over the epoch; the throughput it logs
  (``vit_exp/main.py:116,135``) is images over the epoch's wall time, data loading included (``engine.py:18,68-70``).

``official_MiB`` is ours plus the bytes of those two differences, counted from the official code (not run: their
kernels need CUDA); :data:`DIFFERENCES` lists them per method.
"""
from __future__ import annotations

import pandas as pd

from lowmembp.repro._common import MiB, ratio

PAPER = {  # method -> (label, peak MiB, throughput img/s)
    "lora": ("LoRA", 3827, 288),
    "lora+checkpointing": ("LoRA + checkpointing (every block)", 1252, 229),
    "lora+mesa-gelu-ln": ("LoRA + Mesa (GELU and LayerNorm)", 2853, 226),
    "lora+lowmembp": ("LoRA + ReGELU2 + MS-LN", 2717, 290),
}

# setting -> (peft targets, caption text, config file:line of the official code)
SETTINGS = {
    "lora_qv": ("qkv", "LoRA r4 on q and v (ours: one adapter on timm's fused qkv)",
                "vit_exp/configs/cifar100/lora_qv_ViT_B_baseline.yaml:45-54"),
    "lora_all": (None, "LoRA r4 on qkv, proj, fc1, fc2",
                 "vit_exp/configs/cifar100/lora_all_ViT_B_baseline.yaml:45-54"),
}
DEFAULT_SETTING = "lora_qv"

UNIT_MIB = 64 * 197 * 768 * 2 / 2 ** 20  # b·s·d 16-bit values at batch 64, in MiB

# Differences of the official code from ours, in 16-bit units of b·s·d per block, per (setting, method): each
# (units, why). Counted from the saved tensors of the official code (file:line), not run.
_LORA_FP32_X = "their LoraFunction saves the fp32 LayerNorm output x, peft the fp16 cast (vit_exp/model/lora.py:11-22)"
_MSLN_FP32 = "lomem MS-LN saves its fp32 output, ours fp16 (lomem/normalization.py:10-15)"
DIFFERENCES = {
    ("lora_qv", "lora"): [(1.0, _LORA_FP32_X + ": LN1 output for q/v")],
    ("lora_qv", "lora+checkpointing"): [(1.0 / 12, _LORA_FP32_X + ": in the one recomputed block")],
    ("lora_qv", "lora+mesa-gelu-ln"): [(1.0, _LORA_FP32_X + ": LN1 output for q/v")],
    ("lora_qv", "lora+lowmembp"): [(2.0, _MSLN_FP32 + " ×2 (MS-LN1 output shared with the q/v LoRA, MS-LN2)")],
    ("lora_all", "lora"): [(2.0, _LORA_FP32_X + ": LN1 output (qkv) and LN2 output (fc1)")],
    ("lora_all", "lora+checkpointing"): [(2.0 / 12, _LORA_FP32_X + ": in the one recomputed block")],
    ("lora_all", "lora+mesa-gelu-ln"): [(2.0, _LORA_FP32_X + ": LN1 and LN2 outputs")],
    ("lora_all", "lora+lowmembp"): [(2.0, _MSLN_FP32 + " ×2, each shared with its LoRA")],
}


def differences(setting: str, method: str, batch_size: int = 64, blocks: int = 12) -> list[tuple[str, float]]:
    """[(difference, MiB)] of the official code against ours for one Fig. 1 row (counted, see module doc)."""
    unit = UNIT_MIB * batch_size / 64
    return [(why, units * unit * blocks) for units, why in DIFFERENCES.get((setting, method), [])]


def fig1(small: bool = False, batch_size: int = 64, dtype: str = "fp16",
         settings: tuple[str, ...] = tuple(SETTINGS)) -> pd.DataFrame:
    """One row per (setting, method): paper MiB, ours MiB, ratio, ours + the counted differences of the official
    code, saving vs LoRA (paper, ours), saved-for-backward MiB. ``lora_qv`` (the default setting) first."""
    from lowmembp.estimate import estimate, estimate_by_depth

    kw = dict(batch_size=2 if small else batch_size, dtype=dtype, rank=4)
    run = estimate if small else estimate_by_depth
    if small:
        kw["layers"] = 2
    blocks = kw.get("layers", 12)
    rows = []
    for setting in settings:
        targets, _, cited = SETTINGS[setting]
        base_ours = base_official = None
        for method, (label, paper_mib, paper_tp) in PAPER.items():
            est = run("vit_b16", method, targets=targets, **kw)
            ours = est["peak"]["bytes"] / MiB
            diffs = differences(setting, method, kw["batch_size"], blocks)
            official = ours + sum(m for _, m in diffs)
            base_ours = ours if base_ours is None else base_ours
            base_official = official if base_official is None else base_official
            cats = est["peak"]["by_category"]
            rows.append({
                "setting": setting + (" (default)" if setting == DEFAULT_SETTING else ""),
                "method": label, "spec": method, "paper_MiB": paper_mib, "ours_MiB": ours,
                "ratio": ratio(ours, paper_mib), "official_code_MiB": official,
                "official_ratio": ratio(official, paper_mib),
                "paper_saving_%": 100 * (1 - paper_mib / PAPER["lora"][1]),
                "ours_saving_%": 100 * (1 - ours / base_ours),
                "official_saving_%": 100 * (1 - official / base_official),
                "saved_for_backward_MiB": est["saved"]["total"] / MiB,
                "params_MiB": cats["parameters"] / MiB, "activations_at_peak_MiB": cats["activations"] / MiB,
                "paper_img_per_s": paper_tp,
                "note": "; ".join([f"setting: {cited}"] + [f"+{m:.0f} MiB: {why}" for why, m in diffs]),
            })
    df = pd.DataFrame(rows)
    df.attrs["caption"] = (
        f"ViT-B/16 (timm vit_base_patch16_224, 100 classes), batch {kw['batch_size']}, LoRA rank 4, {dtype} CPU "
        "autocast, AdamW; peak of one steady training step on fake tensors. Settings: "
        + "; ".join(f"{s}: {SETTINGS[s][1]}" for s in settings)
        + ". official_code_MiB = ours + the bytes the official code keeps besides (counted from its code, "
          "lowmembp/repro/fig1.py). Paper: LowMemoryBP Fig. 1 (one GPU, torch.cuda.max_memory_allocated).")
    return df

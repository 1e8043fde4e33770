"""The weights' storage precision of an estimated step: the choices, the one people pick, and NF4 (QLoRA) bases.

    WEIGHTS                          # ("fp32", "bf16", "fp16", "nf4"): what ``estimate(weights=...)`` accepts
    auto_weights("lora+checkpointing", "bf16")   # "bf16": a LoRA-family base in the compute dtype
    auto_weights("mesa", "bf16")                 # "fp32": full fine-tuning keeps fp32 master weights under AMP
    nf4_peak(peak, model)            # a peak measured with a bf16 base, its frozen LoRA base linears stored in NF4

What the common recipes load (:func:`auto_weights`, cited in ``docs/planner.md``): a frozen base of LoRA-family
methods (``lora``, ``lora-fa``, ``velora``: :data:`FROZEN_BASE_METHODS`) in the compute dtype, as peft's examples,
torchtune's LoRA recipes and axolotl's ``bf16: auto`` do (peft keeps the adapters fp32); trained weights as fp32
masters under autocast (transformers' ``Trainer`` with ``bf16=True``, torch AMP).

NF4 (QLoRA, ``lora`` with ``quantize="nf4"``): bitsandbytes' 4-bit weights need real data to quantise, so a fake step
runs with the base in the compute dtype (bf16) and :func:`nf4_peak` then replaces, in the peak, each frozen base
linear's bf16 bytes by its NF4 bytes (:func:`nf4_weight_bytes`) — the weights are alive through the whole step, so
the peak falls at the same moment, lower by that constant — and adds one dequantised weight as a temporary
(bitsandbytes dequantises a 4-bit weight to the compute dtype for each matmul, one linear at a time).
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["WEIGHTS", "FROZEN_BASE_METHODS", "NF4_COMPUTE", "auto_weights", "frozen_base", "nf4_weight_bytes",
           "nf4_base_weights", "nf4_peak", "storage_dtype"]

WEIGHTS = ("fp32", "bf16", "fp16", "nf4")
FROZEN_BASE_METHODS = ("lora", "lora-fa", "velora")  # peft wraps these on the meta device (estimator.step)
NF4_COMPUTE = "bf16"  # the dtype an NF4 base is built in and dequantised to (QLoRA's bnb_4bit_compute_dtype)


def frozen_base(method: str) -> bool:
    """Whether the combination ``method`` ("a+b", options allowed: "lora@rank=8") freezes the base weights."""
    return any(n.partition("@")[0].strip() in FROZEN_BASE_METHODS for n in method.split("+"))


def auto_weights(method: str, dtype: str) -> str:
    """The precision people load the weights in for ``method`` trained under ``dtype`` autocast: a frozen base in
    the compute dtype; trained weights as fp32 masters (module doc)."""
    return dtype if frozen_base(method) and dtype != "fp32" else "fp32"


def storage_dtype(weights: str) -> str:
    """The dtype the model is built in for ``weights`` (NF4: its compute dtype, quantised by :func:`nf4_peak`)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)} (the parameters' storage), got {weights!r}")
    return NF4_COMPUTE if weights == "nf4" else weights


def nf4_weight_bytes(numel: int, *, blocksize: int = 64, double_quant: bool = True) -> int:
    """Bytes bitsandbytes' ``Linear4bit`` (NF4) keeps for a weight of ``numel`` values: the packed 4-bit weight
    (``numel / 2`` uint8) plus one absmax per ``blocksize`` values — fp32, or with ``double_quant`` 8-bit codes plus
    one fp32 scale (and offset) per 256 absmax values. The bf16 dequantised weight of forward/backward is a temporary,
    not counted here."""
    if numel < 0 or blocksize < 1:
        raise ValueError(f"nf4_weight_bytes: numel >= 0 and blocksize >= 1, got {numel}, {blocksize}")
    packed = (numel + 1) // 2
    blocks = -(-numel // blocksize)
    if not double_quant:
        return packed + 4 * blocks
    return packed + blocks + 4 * -(-blocks // 256) + 4


def nf4_base_weights(model: nn.Module) -> list[torch.Tensor]:
    """The frozen weights QLoRA stores in NF4: those of the ``nn.Linear`` base layers peft's LoRA layers wrap."""
    out = []
    for m in model.modules():
        base = getattr(m, "base_layer", None)
        if isinstance(base, nn.Linear) and not base.weight.requires_grad and hasattr(m, "lora_A"):
            out.append(base.weight)
    return out


def nf4_peak(peak: dict, model: nn.Module, *, double_quant: bool = True) -> dict:
    """``peak`` (measured with the base in :data:`NF4_COMPUTE`) with the frozen LoRA base linears in NF4 (module
    doc); ValueError when the model has none (NF4 weights are QLoRA's: a LoRA-family method)."""
    ws = nf4_base_weights(model)
    if not ws:
        raise ValueError("weights='nf4' stores the frozen base linears of LoRA-family methods in 4 bits (QLoRA); "
                         f"this model has none: combine it with one of {', '.join(FROZEN_BASE_METHODS)}")
    saved = sum(w.numel() * w.element_size() - nf4_weight_bytes(w.numel(), double_quant=double_quant) for w in ws)
    dequant = max(w.numel() * w.element_size() for w in ws)
    cats = dict(peak["by_category"])
    cats["parameters"] = cats.get("parameters", 0) - saved
    cats["temporaries"] = cats.get("temporaries", 0) + dequant
    return dict(peak, bytes=int(peak["bytes"] - saved + dequant), by_category=cats,
                how=peak["how"] + (f"; {len(ws)} frozen base linears as NF4 (lowmembp.estimator.weights.nf4_peak: "
                                   "their bf16 bytes replaced by NF4's, one dequantised weight added)"))

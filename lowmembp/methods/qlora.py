"""QLoRA's frozen base: the targeted ``nn.Linear`` weights stored as bitsandbytes NF4 (``lora`` option
``quantize="nf4"``; see :mod:`lowmembp.methods.lora`).

Each targeted linear becomes a ``bitsandbytes.nn.Linear4bit`` holding its weight quantised (4-bit NormalFloat, block
size 64, optionally double-quantised absmax) and its bias as a frozen parameter; forward and backward dequantise
the weight per matmul into the original dtype. peft then places its adapters on the quantised layers.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn


def _matches(name: str, targets) -> bool:
    """peft's rule: a string is a regular expression the whole module name matches; a list holds names the module
    name equals or ends with (``.<target>``)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def quantize_nf4(model: nn.Module, targets, *, double_quant: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose name matches ``targets`` by an NF4 ``Linear4bit`` in place;
    returns how many were replaced. Clear errors without bitsandbytes or on the meta device."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError("lora: quantize='nf4' needs bitsandbytes (pip install 'lowmembp[qlora]' or "
                          "pip install bitsandbytes)") from e
    found = [(name, m) for name, m in model.named_modules()
             if type(m) is nn.Linear and _matches(name, targets)]
    if not found:
        raise ValueError(f"lora: quantize='nf4' found no nn.Linear named {targets!r} to quantise")
    for name, lin in found:
        w = lin.weight
        if w.device.type == "meta":
            raise ValueError("lora: quantize='nf4' needs real weights (the model is on the meta device); the "
                             "fake-tensor estimate models NF4 storage with lowmembp.estimate.nf4_weight_bytes")
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"lora: quantize='nf4' needs fp32/fp16/bf16 weights, {name} is {w.dtype}")
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=w.dtype,
                              quant_type="nf4", compress_statistics=double_quant, device="cpu")
        q.weight = bnb.nn.Params4bit(w.detach().to("cpu"), requires_grad=False, quant_type="nf4",
                                     compress_statistics=double_quant)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        q = q.to(w.device)  # bitsandbytes quantises on the move to a device (the CPU too)
        if not getattr(q.weight, "bnb_quantized", False):
            raise RuntimeError(f"lora: bitsandbytes did not quantise {name} on {w.device}")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)
    return len(found)

"""QLoRA's frozen base: the targeted ``nn.Linear`` weights stored as bitsandbytes NF4 (``lora`` option
``quantize="nf4"``; see :mod:`lowmembp.methods.lora`).

QLoRA keeps the frozen base weights in 4 bits instead of 16. Each targeted linear (found by peft's name rule, also
under a LoRA layer's ``base_layer``) becomes a ``bitsandbytes.nn.Linear4bit`` (NF4, blocks of 64, the absmax
optionally double-quantised; the bias a frozen parameter) that dequantises its weight per matmul. The quantisation
is deferred in the registry to order :data:`QUANTIZE_ORDER`: after ``lowmembp`` has folded γ into the full-precision
weights, before the methods that wrap layers, so ``lora+lowmembp`` stores ``NF4(W·diag(γ))``, as the official
LowMemoryBP LLaMA run does (not the baseline QLoRA model with γ moved). Merging adapters into an NF4 base is refused:
peft would add the delta to the packed 4-bit bytes. In full: docs/methods/lora.md#qlora; the official sources and
where ours differs: docs/reproductions/paper-settings.md.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

QUANTIZE_ORDER = 25  # registry order of the deferred NF4 step: after lowmembp's folds (20), before mesa (30)
_BASE = "base_layer"


def _matches(name: str, targets) -> bool:
    """peft's rule: a string is a regular expression the whole module name matches; a list holds names the module
    name equals or ends with (``.<target>``)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _targeted_linears(model: nn.Module, targets) -> list[tuple[str, nn.Linear]]:
    """(module name, linear) for every plain ``nn.Linear`` peft's rule picks: ``name`` itself, or ``name.base_layer``
    when peft has wrapped it (matched by the LoRA layer's name)."""
    out = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        parent, _, child = name.rpartition(".")
        wrapped = child == _BASE and hasattr(model.get_submodule(parent) if parent else model, "lora_A")
        if _matches(parent if wrapped else name, targets):
            out.append((name, m))
    return out


class _RefuseMerge:
    """Stands in for ``merge`` on a LoRA layer whose base is NF4 (picklable, deepcopy-safe)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.path}: cannot merge LoRA into an NF4 (QLoRA) base layer — it would add the adapter delta to the "
            f"packed 4-bit weight. Save the adapters instead (model.save_pretrained), or merge into a full-precision "
            f"copy of the base model (PeftModel.from_pretrained(fp_model, adapter_dir).merge_and_unload())")


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError("lora: quantize='nf4' needs bitsandbytes (pip install 'lowmembp[qlora]' or "
                          "pip install bitsandbytes)") from e
    return bnb


def check_quantizable(model: nn.Module, targets) -> list[tuple[str, nn.Linear]]:
    """The linears :func:`quantize_nf4` would replace; clear errors without bitsandbytes, when none matches, on the
    meta device or for a dtype NF4 does not take. ``lora`` calls it before placing adapters."""
    _bnb()
    found = _targeted_linears(model, targets)
    if not found:
        raise ValueError(f"lora: quantize='nf4' found no nn.Linear named {targets!r} to quantise")
    for name, lin in found:
        w = lin.weight
        if w.device.type == "meta":
            raise ValueError("lora: quantize='nf4' needs real weights (the model is on the meta device); the "
                             "fake-tensor estimate models NF4 storage with lowmembp.estimator.step.nf4_weight_bytes")
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"lora: quantize='nf4' needs fp32/fp16/bf16 weights, {name} is {w.dtype}")
    return found


def quantize_nf4(model: nn.Module, targets, *, double_quant: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose name matches ``targets`` (peft's rule; a peft-wrapped linear is
    matched by its LoRA layer's name and replaced as that layer's ``base_layer``) by an NF4 ``Linear4bit`` in place;
    returns how many were replaced. ``model`` is the model the names are relative to (for a peft model: its
    ``base_model.model``). Checks as :func:`check_quantizable`."""
    bnb = _bnb()
    found = check_quantizable(model, targets)
    for name, lin in found:
        w = lin.weight
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=w.dtype,
                              quant_type="nf4", compress_statistics=double_quant, device="cpu")
        q.weight = bnb.nn.Params4bit(w.detach().to("cpu"), requires_grad=False, quant_type="nf4",
                                     compress_statistics=double_quant)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        # bitsandbytes 0.50's CPU inference path (eval + no grad on an avx512-bf16 CPU) repacks the weight in place:
        # it fails on linears with out % 32 or in % 64, computes other values (0.006 on a 64×64 layer) and breaks a
        # later training step. Off: CPU eval runs the training kernel (GPUs are not affected)
        q.support_avx512bf16_for_cpu = False
        q = q.to(w.device)  # bitsandbytes quantises on the move to a device (the CPU too)
        if not getattr(q.weight, "bnb_quantized", False):
            raise RuntimeError(f"lora: bitsandbytes did not quantise {name} on {w.device}")
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, q)
        if child == _BASE and hasattr(owner, "lora_A"):
            owner.merge = _RefuseMerge(parent)  # an instance attribute: shadows peft's merge for this layer only
    return len(found)

"""``lora-fa``: LoRA with A frozen at its initialisation (LoRA-FA, arXiv 2308.03303; docs/design.md#peers).

The adapters are peft's, placed exactly as ``lora`` places them (same options: ``rank``, ``alpha``, ``targets``; the
classification head stays trainable), then every ``lora_A`` weight is frozen. Only B (and the head) train.

Why it saves memory: B's gradient is ``(x·A)ᵀ·g`` and x's gradient needs only the weights, so nothing needs x itself.
Autograd keeps what a backward needs and no more: a linear with a frozen weight saves no input, so with the base
weight and A both frozen a LoRA layer saves only ``x·A`` — ``rank`` values per token instead of ``d_in`` — and no
custom autograd function is needed (checked in ``tests/methods/test_lora_fa.py``). Unless another op saves x anyway
(an MS-norm output under ``lowmembp``, a trainable layer reading the same input): then x is kept once for that op.

peft 0.21 has LoRA-FA only as an optimizer (``peft.optimizers.create_lorafa_optimizer``: it freezes A as here and
also rescales B's gradient with A's Gram matrix); this method is the memory side (frozen A) with the training job's
ordinary AdamW. Composes with ``lowmembp`` (its shared-input LoRA layers keep A frozen) and the other methods that
compose with ``lora``; excludes ``lora``.
"""
from __future__ import annotations

import torch.nn as nn

from lowmembp.methods.registry import register


def _check(rank=4, alpha=None, **_) -> None:
    from lowmembp.methods.lora import check_lora

    try:
        check_lora(rank=rank, alpha=alpha)
    except ValueError as e:
        raise ValueError(str(e).replace("lora:", "lora-fa:", 1)) from None


@register("lora-fa", "LoRA with frozen A (LoRA-FA): only x·A is saved (rank, alpha, targets; head trainable)",
          options={"rank": 4, "alpha": None, "targets": None}, order=10, excludes=("lora",), check=_check,
          changes_weights=True)
def apply_lora_fa(model: nn.Module, rank: int = 4, alpha: float | None = None, targets=None) -> nn.Module:
    from lowmembp.methods.lora import apply_lora

    try:
        peft_model = apply_lora(model, rank=rank, alpha=alpha, targets=targets)
    except (ValueError, TypeError) as e:
        raise type(e)(str(e).replace("lora:", "lora-fa:", 1)) from e
    frozen = freeze_lora_a(peft_model)
    if not frozen:
        raise ValueError("lora-fa: peft placed no LoRA A matrices to freeze (check the targets)")
    return peft_model


def freeze_lora_a(model: nn.Module) -> int:
    """Freeze every peft ``lora_A`` weight in ``model`` (and its LoRA embedding counterpart); returns how many."""
    n = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "lora_A" in parts or "lora_embedding_A" in parts:
            p.requires_grad_(False)
            n += 1
    return n

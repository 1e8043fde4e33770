"""``lora``: low-rank adapters through peft (DESIGN §2.6). Returns the ``PeftModel``; use the return value.

Options: ``rank`` (default 4), ``alpha`` (default None: α = rank, i.e. no α/r scaling — the LowMemoryBP ViT
setting), ``targets`` (default None: per family, below; or a list of module names / a comma-separated string / a
regular expression, passed to peft's ``target_modules``).

Default targets (only inside the transformer blocks):

- ViT / Swin (timm): ``qkv``, ``proj``, ``fc1``, ``fc2`` of each block's attention and MLP. timm fuses q, k and v
  into one ``qkv`` linear, so "q, k, v" is one adapter of rank ``rank`` on ``qkv`` (not three). The patch embedding's
  ``proj`` convolution and Swin's patch-merging linears are not targeted.
- BERT / RoBERTa: ``query``, ``key``, ``value`` and every ``dense`` of the encoder layers (attention output,
  intermediate, output); the pooler is not targeted.
- LLaMA: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``.

The classification head stays fully trainable (peft ``modules_to_save``): timm ``head``, transformers ``classifier``
(BERT/RoBERTa) or ``score`` (LLaMA sequence classification). A causal LM's ``lm_head`` stays frozen. LoRA dropout is 0.
"""
from __future__ import annotations

import torch.nn as nn

from lowmembp.methods.registry import register

DEFAULT_TARGETS = {
    "vit": r".*blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))",
    "swin": r".*blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))",
    "bert": r".*encoder\.layer\.\d+\..*(query|key|value|dense)",
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
_HEAD_NAMES = ("head", "classifier", "score")


@register("lora", "LoRA adapters through peft (rank, alpha, targets; classifier head trainable)",
          options={"rank": 4, "alpha": None, "targets": None}, order=10)
def apply_lora(model: nn.Module, rank: int = 4, alpha: float | None = None, targets=None) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    from lowmembp.models import get_layout

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora: rank must be a positive integer, got {rank!r}")
    if alpha is not None and not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"lora: alpha must be a positive number or None (None: alpha = rank), got {alpha!r}")
    if (type(model).__module__ or "").startswith("peft"):
        raise ValueError("lora: the model is already a peft model; apply 'lora' to the plain timm/transformers model")
    layout = get_layout(model)
    if targets is None:
        targets = DEFAULT_TARGETS[layout.family]
    elif isinstance(targets, str) and "," in targets:
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha, target_modules=targets,
                        lora_dropout=0.0, bias="none", modules_to_save=head_modules(layout.base) or None)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"lora: peft could not place adapters on {type(model).__name__} with targets "
                         f"{targets!r}: {e}") from e
    if _has_ms_norms(peft_model):
        # lowmembp ran first (a separate apply call): make the new LoRA layers save the MS-norm output itself
        # rather than peft's cast copy, as lowmembp does when LoRA is already there.
        from lowmembp.ops.shared_linear import share_lora_inputs
        share_lora_inputs(peft_model)
        from lowmembp.export import guard_save
        guard_save(peft_model)  # its save_pretrained saves lowmembp.export(model): adapters relative to the stock base
    return peft_model


def _has_ms_norms(model: nn.Module) -> bool:
    from lowmembp.ops.ms_norm import MSLayerNorm, MSRMSNorm
    return any(isinstance(m, (MSLayerNorm, MSRMSNorm)) for m in model.modules())


def head_modules(base: nn.Module) -> list[str]:
    """Names of the classification head(s) to keep trainable: a child named head/classifier/score that has weights."""
    out = []
    for name in _HEAD_NAMES:
        head = getattr(base, name, None)
        if isinstance(head, nn.Module) and any(True for _ in head.parameters()):
            out.append(name)
    return out

"""``lora``: low-rank adapters through peft (docs/design.md#lora). Returns the ``PeftModel``; use the return value.

Options: ``rank`` (default 4), ``alpha`` (default None: α = rank, no α/r scaling — the LowMemoryBP ViT setting),
``targets`` (default None: the layout's attention and MLP projections, ``ModelLayout.lora_targets()``; or module
names, a list or a comma-separated string), ``dropout`` (peft's ``lora_dropout``, default 0), ``quantize`` (None, or
``"nf4"`` for QLoRA, with ``double_quant``). The classification head stays fully trainable, a causal LM's
``lm_head`` frozen. QLoRA quantises the targeted frozen weights later in the same ``apply`` (order 25,
:mod:`lowmembp.methods.qlora`), after ``lowmembp`` has folded γ into the full-precision weights: the official
LowMemoryBP order. The targets per family, NF4 storage and what dropout does to MS-norm sharing:
docs/methods/lora.md.
"""
from __future__ import annotations

import torch.nn as nn

from lowmembp.methods.registry import register

_HEAD_NAMES = ("head", "classifier", "score")


def check_lora(rank=4, alpha=None, quantize=None, double_quant=True, dropout=0.0, **_) -> None:
    """ValueError for an option value ``lora`` (and ``lora-fa``, which takes its ``rank`` and ``alpha``) cannot use;
    the registry's ``check``, so the training job and the planner refuse it before any work."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora: rank must be a positive integer, got {rank!r}")
    if alpha is not None and not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
        raise ValueError(f"lora: alpha must be a positive number or None (None: alpha = rank), got {alpha!r}")
    if quantize not in (None, "nf4"):
        raise ValueError(f"lora: quantize must be None or 'nf4' (QLoRA), got {quantize!r}")
    if not isinstance(double_quant, bool):
        raise ValueError(f"lora: double_quant must be True or False, got {double_quant!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora: dropout must be a number in [0, 1), got {dropout!r}")


@register("lora", "LoRA adapters through peft (rank, alpha, targets; classifier head trainable)",
          options={"rank": 4, "alpha": None, "targets": None, "quantize": None, "double_quant": True, "dropout": 0.0},
          order=10, check=check_lora, changes_weights=True)
def apply_lora(model: nn.Module, rank: int = 4, alpha: float | None = None, targets=None,
               quantize: str | None = None, double_quant: bool = True, dropout: float = 0.0, *,
               velora_config=None) -> nn.Module:
    """``velora_config``: a peft ``VeloraConfig`` (the ``velora`` method, lowmembp.methods.velora), else None."""
    from peft import LoraConfig, get_peft_model

    from lowmembp.models import get_layout

    check_lora(rank=rank, alpha=alpha, quantize=quantize, double_quant=double_quant, dropout=dropout)
    if (type(model).__module__ or "").startswith("peft"):
        raise ValueError("lora: the model is already a peft model; apply 'lora' to the plain timm/transformers model")
    layout = get_layout(model)
    targets = resolve_targets(layout, targets)
    if quantize == "nf4":
        from lowmembp.methods.qlora import check_quantizable
        check_quantizable(model, targets)  # refuse now (meta weights, no bitsandbytes), not after the adapters
    config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha, target_modules=targets,
                        lora_dropout=float(dropout), bias="none", modules_to_save=head_modules(layout.base) or None,
                        **({"velora_config": velora_config} if velora_config is not None else {}))
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"lora: peft could not place adapters on {type(model).__name__} with targets "
                         f"{targets!r}: {e}") from e
    if quantize == "nf4":  # after the folds of lowmembp in the same apply (the official order), before mesa & co.
        from lowmembp.methods.qlora import QUANTIZE_ORDER, quantize_nf4
        from lowmembp.methods.registry import defer
        defer(peft_model.base_model.model, lambda m: quantize_nf4(m, targets, double_quant=double_quant),
              order=QUANTIZE_ORDER)
    if _has_ms_norms(peft_model):
        # lowmembp ran first (a separate apply call): make the new LoRA layers save the MS-norm output itself
        # rather than peft's cast copy, as lowmembp does when LoRA is already there.
        from lowmembp.ops.shared_linear import share_lora_inputs
        share_lora_inputs(peft_model)
        from lowmembp.methods.export import guard_save
        guard_save(peft_model)  # its save_pretrained saves lowmembp.export(model): adapters relative to the stock base
    return peft_model


def resolve_targets(layout, targets):
    """peft ``target_modules`` for ``targets``: None -> the layout's projections; ``"a, b"`` -> ``["a", "b"]``; one
    name (a string without commas) -> ``[name]`` (a name, not a regular expression, not characters); a list as
    given."""
    if targets is None:
        found = layout.lora_targets()
        if not found:
            raise ValueError(f"lora: no attention / MLP linears found in the blocks of {type(layout.base).__name__}; "
                             f"pass targets=[module names]")
        return found
    if isinstance(targets, str):
        names = [t.strip() for t in targets.split(",") if t.strip()]
        if not names:
            raise ValueError("lora: targets is an empty string; pass module names, e.g. targets='q_proj,v_proj'")
        return names
    if isinstance(targets, (list, tuple, set)) and all(isinstance(t, str) for t in targets):
        return list(targets)
    raise ValueError(f"lora: targets must be None, a string of comma-separated module names or a list of names, "
                     f"got {targets!r}")


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

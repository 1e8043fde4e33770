"""``velora``: LoRA whose A projections save a rank-1 compression of their input for the backward (VeLoRA,
arXiv 2405.17991), through peft's own implementation (``peft.tuners.lora.config.VeloraConfig``).

With the base weight frozen, a LoRA layer's largest saved tensor is its input ``x``, kept for A's gradient. The
adapters are placed exactly as ``lora`` places them; peft then splits ``x`` into ``num_groups`` groups of features,
projects each onto one unit vector (the batch's mean group, refreshed every training forward with
``init_type="batch_average"``) and saves only those coefficients, so a layer keeps ``num_groups + rank`` values per
token instead of ``d_in + rank``. A's gradient is computed from the rebuilt input, an approximation; the forward, the
input's gradient and B's are exact. Options (peft's names and defaults): ``num_groups`` (64; below every adapted
input width), ``scale`` (1.0), ``init_type``. Composes like ``lora``; excludes ``lora`` and ``lora-fa``; no QLoRA
(peft's 4-bit LoRA layers do not support VeLoRA). In full, with measured figures: docs/methods/velora.md.
"""
from __future__ import annotations

import torch.nn as nn

from lowmembp.methods.registry import register

_INIT_TYPES = ("batch_average", "batch_average_once", "random")


def check_velora(rank=4, alpha=None, targets=None, num_groups=64, scale=1.0, init_type="batch_average"):
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"velora: num_groups must be a positive integer (peft's default 64), got {num_groups!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"velora: scale must be a positive number (peft's default 1.0), got {scale!r}")
    if init_type not in _INIT_TYPES:
        raise ValueError(f"velora: init_type must be one of {', '.join(_INIT_TYPES)}, got {init_type!r}")


@register("velora", "VeLoRA through peft: LoRA whose A saves a rank-1 compression of its input per group "
                    "(rank, alpha, targets, num_groups, scale, init_type)",
          options={"rank": 4, "alpha": None, "targets": None, "num_groups": 64, "scale": 1.0,
                   "init_type": "batch_average"},
          order=10, excludes=("lora", "lora-fa"), kinds={"scale": (float,)}, check=check_velora, changes_weights=True)
def apply_velora(model: nn.Module, rank: int = 4, alpha: float | None = None, targets=None, num_groups: int = 64,
                 scale: float = 1.0, init_type: str = "batch_average") -> nn.Module:
    from peft.tuners.lora.config import VeloraConfig

    from lowmembp.methods.lora import apply_lora

    check_velora(num_groups=num_groups, scale=scale, init_type=init_type)
    unreal = any(p.is_meta or type(p).__name__ == "FakeTensor" for p in model.parameters())
    # on the meta device (the estimate) peft's random init would read a norm: the projection starts empty instead
    config = VeloraConfig(num_groups=num_groups, scale=float(scale),
                          init_type="batch_average" if unreal else init_type)
    try:
        peft_model = apply_lora(model, rank=rank, alpha=alpha, targets=targets, velora_config=config)
    except (ValueError, TypeError) as e:
        raise type(e)(str(e).replace("lora:", "velora:", 1)) from e
    narrow = sorted({(m.in_features, n) for n, m in peft_model.named_modules()
                     if hasattr(m, "lora_velora_embed") and m.in_features <= num_groups})
    if narrow:
        width, name = narrow[0]
        peft_model.unload()  # the model as it was given (peft placed its layers in place)
        raise ValueError(f"velora: num_groups={num_groups} is not below the input width {width} of {name}: each "
                         f"token would keep as many values as LoRA (or more); pass num_groups < {width}")
    if not any(hasattr(m, "lora_velora_embed") for m in peft_model.modules()):
        raise ValueError("velora: peft placed no VeLoRA adapters (check the targets)")
    if unreal:
        _skip_projection_updates(peft_model)
    return peft_model


def _skip_projection_updates(model: nn.Module) -> None:
    """Fake tensors (the estimate) have no values: peft's projection update (a no-grad mean and norm of the batch's
    groups, data-dependent) cannot run there. Mark every VeLoRA layer's projection as fixed (peft's ``"random"``
    kind, which is never updated), so the fake step runs what saves memory: the compressed input."""
    for m in model.modules():
        if hasattr(m, "lora_velora_embed"):
            for name in m.lora_velora_init_type:
                m.lora_velora_init_type[name] = "random"
                m.lora_velora_initialized[name] = True

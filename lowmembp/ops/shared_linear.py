"""Linear layers that save their input *as given*, so that an MS-norm's output is stored once (DESIGN §2.2).

Saves for backward: nothing of its own beyond what ``F.linear`` saves: the input tensor itself (same storage as the
norm output: 0 extra bytes per element) and the weight cast to the input dtype (a parameter-sized copy, none when
the dtypes already match).

When is this needed? An MS-norm followed by a linear saves one tensor for both only if the linear saves the very
storage the norm returned. Measured with torch 2.14 / peft 0.21 (tests/test_ms_norm.py checks each case):

* ``nn.Linear`` (2-D or 3-D input; fp32; bf16 or fp16 autocast): shares. Under autocast the norm emits the autocast
  dtype, so autocast's input cast is a no-op. Nothing to do.
* peft LoRA ``Linear`` in fp32: shares (the LoRA A layer saves the norm output; the frozen base layer saves none).
* peft LoRA ``Linear`` under bf16/fp16 autocast: does NOT share by default. peft casts the input to the adapter
  weight dtype (fp32), then autocast casts that copy back to bf16 for ``lora_A``, which saves a second full-size
  bf16 copy. ``peft.helpers.disable_input_dtype_casting(model)`` fixes this one case, but the same model run
  without autocast then fails on mismatched dtypes.
* peft LoRA ``Linear`` on a bf16/fp16 base model with fp32 adapters (peft's default ``autocast_adapter_dtype=True``),
  without autocast: does NOT share: peft saves an fp32 copy of the input (twice the norm output's bytes).

Use ``share_lora_inputs(model)`` after ``get_peft_model`` (and after replacing norms with MS-norms) for the two peft
cases: it turns off peft's input cast on every vanilla LoRA Linear layer and makes its ``lora_A``/``lora_B`` cast
their *weights* to the input dtype instead (``CastWeightLinear``). Effect: the LoRA path runs in the input dtype
(bf16/fp16 matmuls instead of fp32 for the rank-r path; gradients still reach the fp32 adapter weights in fp32);
outputs match peft's within the input dtype's rounding. DoRA and other LoRA variants are left unchanged.
``lora_dropout > 0`` defeats sharing whatever you do: the dropout output is a new tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear_sharing_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that casts the weight (and bias) to x's dtype instead of x to the weight's: saves x itself."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, weight, bias)


class CastWeightLinear(nn.Linear):
    """``nn.Linear`` whose forward runs in the input's dtype (weights cast, input untouched), so the saved input is
    the caller's tensor. Same parameters and state dict as ``nn.Linear``; an ``nn.Linear`` instance can be switched
    in place with ``module.__class__ = CastWeightLinear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_sharing_input(x, self.weight, self.bias)


def share_lora_inputs(model: nn.Module) -> int:
    """Make every vanilla peft LoRA ``Linear`` in ``model`` save its input as given; returns how many it changed.

    Idempotent. Raises ImportError with advice if peft is not installed."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError as exc:  # pragma: no cover
        raise ImportError("share_lora_inputs needs peft (pip install peft)") from exc
    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLinear) or getattr(module, "lora_variant", None):
            continue
        module.cast_input_dtype_enabled = False
        for container in (module.lora_A, module.lora_B):
            for sub in container.values():
                if type(sub) is nn.Linear:
                    sub.__class__ = CastWeightLinear
        changed += 1
    return changed


__all__ = ["linear_sharing_input", "CastWeightLinear", "share_lora_inputs"]

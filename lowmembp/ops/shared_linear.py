"""Linear layers that save their input *as given*, so that an MS-norm's output is stored once (docs/design.md#ms-norms).

Saves for backward: nothing of its own beyond what ``F.linear`` saves: the input tensor itself (same storage as the
norm output: 0 extra bytes per element) and the weight cast to the input dtype (a parameter-sized copy, none when
the dtypes already match).

When is this needed? An MS-norm followed by a linear saves one tensor for both only if the linear saves the very
storage the norm returned. Measured with torch 2.14 / peft 0.21 (tests/ops/test_ms_norm.py checks each case):

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

* An input wider than the autocast dtype (an MS-norm with ``out_dtype="fp32"`` / ``"input"`` emitting fp32 under
  fp16/bf16 autocast, as the official lomem kernel does): autocast would cast it for the matmul and save that 16-bit
  copy beside the norm's fp32 output. With ``save_wide_input=True`` (``linear_sharing_input``'s argument, a
  ``CastWeightLinear``'s attribute, ``share_lora_inputs(model, save_wide_inputs=True)``, which lowmembp's
  ``norm_dtype="fp32"`` / ``"input"`` uses) the matmul runs in the autocast dtype through an autograd function that
  saves the input as given (the norm's fp32 storage, 4 bytes per element, counted once) and casts it again in
  backward (a temporary). Only when the weight needs a gradient: a frozen weight's ``F.linear`` saves no input
  anyway, and then the plain path (autocast's) runs. Outputs and gradients equal autocast's ``F.linear`` (the same
  casts and matmuls; the bias gradient is summed in fp32). Off by default: for a wide input nothing else saves
  (e.g. a kept ``nn.LayerNorm``'s fp32 output) saving it as given costs 4 bytes per element instead of 2.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowmembp.ops.backend import autocast_dtype


class _LinearSavingInput(torch.autograd.Function):
    """``F.linear`` computed in ``dtype`` (autocast off inside) that saves ``x`` as given, not its ``dtype`` copy."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dt = ctx.dtype
        gx = gw = gb = None
        with torch.autocast(g.device.type, enabled=False):
            g = g.to(dt)
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                gx = (g @ weight.to(dt)).to(x.dtype)
            if ctx.needs_input_grad[1]:
                gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(dt)).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g2.sum(0, dtype=torch.float32)
        return gx, gw, gb, None


def linear_sharing_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         save_wide_input: bool = False) -> torch.Tensor:
    """``F.linear`` that casts the weight (and bias) to x's dtype instead of x to the weight's: saves x itself.

    ``save_wide_input``: under autocast with an input wider than the autocast dtype (an fp32 norm output) and a
    weight that needs a gradient, the matmul in the autocast dtype saving x as given (module doc)."""
    if save_wide_input:
        low = autocast_dtype(x)
        if (low is not None and x.is_floating_point() and x.dtype != low and torch.is_grad_enabled()
                and weight.requires_grad):
            return _LinearSavingInput.apply(x, weight, bias, low)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, weight, bias)


class CastWeightLinear(nn.Linear):
    """``nn.Linear`` whose forward runs in the input's dtype (weights cast, input untouched), so the saved input is
    the caller's tensor. Same parameters and state dict as ``nn.Linear``; an ``nn.Linear`` instance can be switched
    in place with ``module.__class__ = CastWeightLinear``. ``save_wide_input`` (attribute, default False): see
    :func:`linear_sharing_input`."""

    save_wide_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.save_wide_input:
            return linear_sharing_input(x, self.weight, self.bias, save_wide_input=True)
        weight, bias = self.weight, self.bias
        if weight.dtype is not x.dtype and autocast_dtype(x) is not x.dtype:
            # (under autocast with x in its dtype, autocast's own weight cast, cached per region for a parameter,
            # gives the same bits and leaves x untouched: one cast a step instead of one a call)
            weight = weight.to(x.dtype)
            if bias is not None:
                bias = bias.to(x.dtype)
        return F.linear(x, weight, bias)


def share_lora_inputs(model: nn.Module, save_wide_inputs: bool = False) -> int:
    """Make every vanilla peft LoRA ``Linear`` in ``model`` save its input as given; returns how many it changed.

    ``save_wide_inputs``: also an input wider than the autocast dtype (fp32 MS-norm outputs; module doc).
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
                if type(sub) is CastWeightLinear and save_wide_inputs:
                    sub.save_wide_input = True
        changed += 1
    return changed


__all__ = ["linear_sharing_input", "CastWeightLinear", "share_lora_inputs"]

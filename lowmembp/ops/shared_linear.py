"""Linear layers that save their input *as given*, so that an MS-norm's output is stored once (docs/design.md#ms-norms).

An MS norm and the linear after it save one tensor between them only if the linear saves the very storage the norm
returned. ``nn.Linear`` does; peft's LoRA layers under autocast, or with fp32 adapters on a 16-bit base, save a cast
copy instead. :func:`share_lora_inputs` makes every vanilla LoRA layer cast its *weights* to the input's dtype
(:class:`CastWeightLinear`), so it saves the norm's output itself (0 extra bytes an element) and the weight's cast
(a parameter-sized copy). ``save_wide_input`` also keeps an fp32 norm output under 16-bit autocast from being saved
a second time as its 16-bit copy. Which layers share, which do not and why, and what ``save_wide_input`` costs:
docs/methods/lowmembp.md, "When a norm's output is shared".
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
    weight that needs a gradient, the matmul in the autocast dtype saving x as given (docs/methods/lowmembp.md)."""
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

    ``save_wide_inputs``: also an input wider than the autocast dtype (fp32 MS-norm outputs; docs/methods/lowmembp.md).
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

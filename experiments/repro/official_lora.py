"""An emulation of the official LowMemoryBP ViT code's LoRA, for the Fig. 1 reproduction (experiments.repro.fig1).

The official code (github yyyyychen/LowMemoryBP, ``experiments/vit_exp/model/lora.py``) does not use peft. Its
``Linear.forward`` (``lora.py:140-143``) is ``F.linear(x, W, b) + LoraFunction.apply(x, A, B)``, and
``LoraFunction`` (``lora.py:11-43``, ``torch.cuda.amp.custom_fwd`` without ``cast_inputs``, ``custom_bwd``):

- forward ``x @ A.t() @ B.t()`` under the caller's autocast (the matmuls run in fp16 under AMP), saving ``A``,
  ``B`` and ``x`` *as it comes* (``lora.py:20``): under AMP the fp32 LayerNorm output (4 bytes per element), the
  very tensor the norm returned;
- backward under the forward's autocast state: ``dx = g @ B @ A``; ``z = gᵀ x``; ``dA = Bᵀ z``; ``dB = z Aᵀ``.

The frozen ``F.linear`` beside it saves no input (its weight needs no gradient). peft's ``lora_A`` instead saves the
fp16 copy autocast makes of x (2 bytes per element, a new tensor; lowmembp.ops.shared_linear), and its ``lora_B``
saves ``x Aᵀ`` (b·s·r), which the official function does not keep; its backward instead forms ``z = gᵀ x``, an
out × in (weight-sized) temporary per layer.

:class:`OfficialLoraFunction` is that function (plus the bias peft's ``lora_A`` has after lowmembp folds β into it:
``(x Aᵀ + a) Bᵀ``, with its terms ``Σ g B`` and ``(Σ g) aᵀ`` in the gradients; the official code has none).
:func:`official_lora_forward` is the official ``Linear.forward`` on a peft LoRA ``Linear`` (its ``base_layer``,
``lora_A``, ``lora_B``, ``scaling``); :func:`emulated` makes every peft LoRA ``Linear`` run it while the context is
open, so the fake-tensor step of :func:`lowmembp.estimator.step.estimate` measures the official code's saved bytes. Not
a
method of the library: the library's ``lora`` is peft's.
"""
from __future__ import annotations

import contextlib

import torch


def _autocast_state(t: torch.Tensor):
    """(device type, enabled, dtype) of autocast for t's device: what ``custom_fwd`` records for the backward."""
    dev = t.device.type
    try:
        return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
    except (RuntimeError, ValueError, TypeError):  # pragma: no cover - a device autocast does not know
        return dev, False, None


class OfficialLoraFunction(torch.autograd.Function):
    """``(x Aᵀ [+ a]) Bᵀ`` saving ``A``, ``B`` and ``x`` as given (the official ``LoraFunction``, module doc)."""

    @staticmethod
    def forward(ctx, x, A, B, a_bias=None):
        xAt = x @ A.t()
        if a_bias is not None:
            xAt = xAt + a_bias
        out = xAt @ B.t()
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ctx.save_for_backward(A, B, a_bias, x)
        else:
            ctx.save_for_backward(A, B, a_bias)
        ctx.autocast = _autocast_state(x)
        ctx.has_bias = a_bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        dev, enabled, dtype = ctx.autocast
        saved = ctx.saved_tensors
        A, B, a = saved[0], saved[1], saved[2]
        dx = dA = dB = da = None
        with torch.autocast(dev, dtype=dtype, enabled=enabled) if dtype is not None else contextlib.nullcontext():
            if ctx.needs_input_grad[0]:
                dx = g @ B @ A
            g2 = g.reshape(-1, g.shape[-1])
            gsum = g2.sum(0) if ctx.has_bias else None
            if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                x = saved[3]
                z = g2.t() @ x.reshape(-1, x.shape[-1])
                if ctx.needs_input_grad[1]:
                    dA = B.t() @ z
                if ctx.needs_input_grad[2]:
                    dB = z @ A.t()
                    if ctx.has_bias:  # the bias term of x Aᵀ + a (no counterpart in the official code)
                        dB = dB + torch.outer(gsum, a)
            if ctx.has_bias and ctx.needs_input_grad[3]:
                da = gsum @ B
        return dx, dA, dB, da  # autograd casts each to its input's dtype, as for the official function


def official_lora_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The official ``Linear.forward`` (``lora.py:140-143``) on a peft LoRA ``Linear``: the base layer, plus
    :class:`OfficialLoraFunction` per active adapter (times peft's ``scaling``: 1 at alpha = rank, as the official
    code). ValueError for what the official code has no counterpart of (dropout, DoRA and other variants)."""
    if layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None:
        raise ValueError("official_lora_forward: adapters disabled, merged or mixed batches are not emulated")
    result = layer.base_layer(x, *args, **kwargs)
    for name in layer.active_adapters:
        if name not in layer.lora_A.keys():
            continue
        if name in getattr(layer, "lora_variant", {}):
            raise ValueError(f"official_lora_forward: adapter {name!r} is a LoRA variant (DoRA, ...): not emulated")
        if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
            raise ValueError("official_lora_forward: lora_dropout > 0 has no counterpart in the official code")
        A, B = layer.lora_A[name], layer.lora_B[name]
        if B.bias is not None:
            raise ValueError("official_lora_forward: a LoRA B with a bias (lora_bias=True) is not emulated")
        result = result + OfficialLoraFunction.apply(x, A.weight, B.weight, A.bias) * layer.scaling[name]
    return result


@contextlib.contextmanager
def emulated():
    """While open, every peft LoRA ``Linear`` runs :func:`official_lora_forward` (the class's ``forward`` is swapped
    and put back on exit)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    original = LoraLinear.forward
    LoraLinear.forward = official_lora_forward
    try:
        yield
    finally:
        LoraLinear.forward = original


__all__ = ["OfficialLoraFunction", "official_lora_forward", "emulated"]

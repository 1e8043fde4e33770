"""An emulation of how the official LowMemoryBP LLaMA QLoRA run holds memory, for the headline reproduction.

The official run (github yyyyychen/LowMemoryBP@bb2980f, ``experiments/llama_exp/qlora.py`` with
``scripts/finetune_llama_*.sh``) differs from our QLoRA step (``lora`` with ``quantize="nf4"``, estimated on a bf16
build with NF4 storage subtracted, :mod:`experiments.repro.headline`) in what it keeps on the device:

- dtypes (``qlora.py:437-442``): every LoRA layer cast to bf16 (ours: peft's fp32 adapters on a bf16 base), every
  module named ``*norm*`` cast to fp32 (after ``prepare_model_for_kbit_training``, ``qlora.py:415``, made every
  non-quantised parameter fp32; ``:443-446`` cast the embeddings and ``lm_head`` back to bf16). transformers' RMSNorm
  multiplies its fp32 weight by the bf16-cast normalised input, so a norm's output is fp32;
- each 4-bit linear's input: bitsandbytes' ``Linear4bit`` casts its input to the compute dtype (bf16) and
  ``MatMul4Bit`` keeps it (``ctx.tensors = (A, B)``; the vendored ``src/utils/matmul_4bit.py:42-43`` of the mergeln
  runs does the same) although the frozen weight needs no gradient. After an fp32 norm each of q, k, v (and gate,
  up) makes and keeps its own bf16 copy; the MLP's product is kept by ``down_proj``;
- LoRA dropout 0.1 (``finetune_llama_*.sh:32``, :data:`DROPOUT`) on CUDA, whose fused dropout keeps a 1-byte mask
  (``torch.native_dropout``); PyTorch's CPU dropout, where the fake step runs, keeps a mask of the input's dtype, so
  :func:`emulated` routes ``F.dropout`` through ``torch.native_dropout`` while it is open;
- the optimizer: ``paged_adamw_32bit`` (``qlora.py:217``) keeps its states in CUDA unified memory, which
  ``torch.cuda.max_memory_allocated`` does not count (the official run reports that, ``qlora.py:763-773``).

:func:`emulated` makes :func:`lowmembp.estimator.step.estimate` build the official run's model while the context is
open:
the dtypes above (cast on the meta model, before it moves to fake storage), and every LoRA layer's frozen base linear
running :class:`KeptInputMatmul` (the 4-bit matmul's forward and input-gradient, keeping its bf16 input as
bitsandbytes does; the weight stays the bf16 stand-in of the fake build, its NF4 storage subtracted by the caller).
:func:`paged_optimizer_bytes` is the optimizer state at the peak, to subtract. Not a method of the library.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn


DROPOUT = 0.1  # finetune_llama_*.sh:32


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: the fused kernel (``torch.native_dropout``), saving a 1-byte mask."""
    if not training or p == 0:
        return input
    out, _ = torch.native_dropout(input, p, True)
    if inplace:
        return input.copy_(out)
    return out


class KeptInputMatmul(torch.autograd.Function):
    """``A Wᵀ`` keeping ``A`` for backward although ``W`` needs no gradient (bitsandbytes' ``MatMul4Bit``)."""

    @staticmethod
    def forward(ctx, A, W):
        ctx.save_for_backward(A, W)  # bitsandbytes keeps it as ctx.tensors: the same bytes, held until backward
        return A @ W.t()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        _, W = ctx.saved_tensors
        return (g @ W.to(g.dtype)) if ctx.needs_input_grad[0] else None, None


def four_bit_forward(layer: nn.Linear, x: torch.Tensor, compute_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """bitsandbytes ``Linear4bit.forward``: the input cast to the compute dtype, :class:`KeptInputMatmul`, the bias."""
    out = KeptInputMatmul.apply(x.to(compute_dtype), layer.weight)
    return out if layer.bias is None else out + layer.bias.to(out.dtype)


def official_dtypes(model: nn.Module) -> nn.Module:
    """``qlora.py:437-446`` on a peft model: LoRA layers to bf16, ``*norm*`` modules to fp32, embeddings and head bf16;
    every LoRA layer's frozen base linear runs :func:`four_bit_forward`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            module.to(torch.bfloat16)
            base = module.get_base_layer()
            if isinstance(base, nn.Linear):
                base.forward = functools.partial(four_bit_forward, base)
        if "norm" in name:
            module.to(torch.float32)
        if ("lm_head" in name or "embed_tokens" in name) and getattr(module, "weight", None) is not None:
            if module.weight.dtype == torch.float32:
                module.to(torch.bfloat16)
    return model


@contextlib.contextmanager
def emulated():
    """While open, :func:`lowmembp.estimator.step.estimate` (and ``estimate_by_depth``) build the official run's model:
    :func:`official_dtypes` applied right after peft wraps the meta model (``module.to`` cannot swap parameters inside
    the fake mode), before the other methods (lowmembp folds the norms into the now-fp32 γ, as the official merge)."""
    from lowmembp.estimator import step

    original = step.apply  # lowmembp.estimator.step.prepare_model applies the methods through this name

    def apply(model, method, **opts):
        out = original(model, method, **opts)
        if any(p.partition("@")[0].strip() == "lora" for p in method.split("+")) and \
                next(iter(out.parameters())).device.type == "meta":
            official_dtypes(out)
        return out

    import torch.nn.functional as F

    dropout = F.dropout
    step.apply, F.dropout = apply, cuda_dropout
    try:
        yield
    finally:
        step.apply, F.dropout = original, dropout


def paged_optimizer_bytes(result: dict) -> int:
    """The optimizer state at the peak of an :func:`lowmembp.estimator.step.estimate` result: what a paged optimizer
    holds outside ``torch.cuda.max_memory_allocated``."""
    return int(result["peak"]["by_category"].get("optimizer_state", 0))


__all__ = ["DROPOUT", "cuda_dropout", "KeptInputMatmul", "four_bit_forward",
           "official_dtypes", "emulated", "paged_optimizer_bytes"]

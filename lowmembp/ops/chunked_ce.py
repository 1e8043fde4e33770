"""Chunked lm_head + cross-entropy that never holds the full ``N × V`` logits (docs/design.md#peers, ``chunked-ce``).

    loss = chunked_linear_cross_entropy(hidden, weight, bias, targets, chunk=1024)   # hidden [N, d], targets [N]

Forward: the tokens are taken ``chunk`` at a time; each chunk's logits ``hidden[i:j] @ weight.T (+ bias)`` are
computed (under whatever autocast is active, as the plain ``lm_head`` would be), upcast to fp32 and reduced to the
summed cross-entropy of that chunk, then dropped. Saved for backward: ``hidden`` itself (the storage the caller
already has), a reference to ``weight`` (a parameter: no copy), the targets, and the autocast state. Nothing of size
``V`` per token is kept.

Backward: each chunk's logits are recomputed under the recorded autocast state and differentiated by autograd
(``torch.autograd.grad``), so the gradients are the plain lm_head + ``F.cross_entropy`` ones computed chunk by chunk:
``dhidden`` exact per chunk, ``dweight`` (and ``dbias``) accumulated over chunks in fp32. Cost: one more lm_head
matmul per step (the recomputation). Targets equal to ``ignore_index`` (default −100) contribute nothing; the loss
is the sum over the other tokens divided by ``denominator`` (default: their number — the mean, as
``F.cross_entropy``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_linear_cross_entropy", "ChunkedLinearCrossEntropy"]


def _autocast_state(device_type: str):
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _chunk_loss(h, weight, bias, t, ignore_index):
    logits = F.linear(h, weight, bias)
    return F.cross_entropy(logits.float(), t, ignore_index=ignore_index, reduction="sum")


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, ignore_index, denominator):
        n = hidden.shape[0]
        total = hidden.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for i in range(0, n, chunk):
                total = total + _chunk_loss(hidden[i:i + chunk], weight, bias, targets[i:i + chunk], ignore_index)
        if denominator is None:
            denominator = (targets != ignore_index).sum()
        denominator = torch.as_tensor(denominator, dtype=torch.float32, device=total.device)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else hidden.new_empty(0), targets, denominator)
        ctx.has_bias = bias is not None
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        ctx.autocast = _autocast_state(hidden.device.type)
        return total / denominator

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, denominator = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and \
            ctx.needs_input_grad[2]
        scale = (grad_out.float() / denominator).reshape(())
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        db = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        dev = hidden.device.type
        cast = torch.autocast(dev, dtype=ctx.autocast) if ctx.autocast is not None else \
            torch.autocast(dev, enabled=False)
        for i in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[i:i + ctx.chunk].detach().requires_grad_(need_h)
            w = weight.detach().requires_grad_(need_w)
            b = bias.detach().requires_grad_(need_b) if bias is not None else None
            with torch.enable_grad(), cast:
                loss = _chunk_loss(h, w, b, targets[i:i + ctx.chunk], ctx.ignore_index)
            wrt = [x for x, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
            grads = list(torch.autograd.grad(loss, wrt, grad_outputs=scale)) if wrt else []
            if need_h:
                dh[i:i + ctx.chunk] = grads.pop(0)
            if need_w:
                dw += grads.pop(0)
            if need_b:
                db += grads.pop(0)
        return (dh, dw.to(weight.dtype) if dw is not None else None, db.to(bias.dtype) if db is not None else None,
                None, None, None, None)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 targets: torch.Tensor, *, chunk: int = 1024, ignore_index: int = -100,
                                 denominator=None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` (sum over non-ignored tokens divided by
    ``denominator``, default their count) without materialising more than ``chunk`` tokens' logits at a time."""
    if hidden.dim() != 2 or targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"chunked_linear_cross_entropy: hidden must be [N, d] and targets [N], got "
                         f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk, ignore_index, denominator)

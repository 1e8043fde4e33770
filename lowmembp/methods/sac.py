"""``sac``: selective activation checkpointing per transformer block (docs/design.md#peers).

Plain checkpointing recomputes a whole block; a policy can instead keep the outputs that are expensive to recompute
(matmuls, attention) and drop the cheap ones. Each block's forward runs under non-reentrant
``torch.utils.checkpoint.checkpoint`` with ``create_selective_checkpoint_contexts(policy)``: every op is marked
``MUST_SAVE`` or ``PREFER_RECOMPUTE``. Exact: the recomputation reruns the same ops (RNG state preserved). Option
``policy``: ``"save-matmuls"`` (default: keep matmul, convolution and fused-attention outputs), ``"save-attention"``
(keep fused attention only: the policy to stack on frozen weights, LoRA and LoRA-FA) or ``"save-nothing"`` (plain
checkpointing's memory). The wrapper sits on the block instance and checkpoints only in training with grad
enabled; what it keeps passes through the saved-tensor hooks around it (the accountant, ``offload``). Excludes
``checkpointing`` and ``tokentune``. In full: docs/methods/sac.md.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lowmembp.methods.registry import register

_aten = torch.ops.aten


def _ops(*names):
    out = set()
    for n in names:
        packet = getattr(_aten, n, None)
        if packet is not None:
            out.add(packet.default)
    return frozenset(out)


MATMUL_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "linear", "matmul")
ATTENTION_OPS = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                     "_flash_attention_forward", "_efficient_attention_forward")

POLICIES = {
    "save-matmuls": MATMUL_OPS | ATTENTION_OPS,
    "save-attention": ATTENTION_OPS,
    "save-nothing": frozenset(),
}


def policy_fn(saved_ops: frozenset):
    """The per-op policy for ``create_selective_checkpoint_contexts``: MUST_SAVE for ``saved_ops``, else recompute."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@register("sac", "selective activation checkpointing per block (option policy: save-matmuls, save-attention, "
                 "save-nothing)", options={"policy": "save-matmuls"}, order=50, excludes=("checkpointing", "tokentune"))
def apply_sac(model: nn.Module, policy: str = "save-matmuls") -> nn.Module:
    from lowmembp.models import get_layout

    if policy not in POLICIES:
        raise ValueError(f"sac: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    layout = get_layout(model)
    if not layout.blocks:
        raise ValueError(f"sac: no transformer blocks found in {type(layout.base).__name__}")
    for s in layout.blocks:
        block = s.get()
        if getattr(block, "_lowmembp_sac", None) is not None:
            raise RuntimeError("sac: a block is already selectively checkpointed")
        inner = block.__dict__.get("forward")
        object.__setattr__(block, "_lowmembp_sac", policy)
        block.forward = _SACForward(block, policy, inner)
    object.__setattr__(model, "_sac", {"policy": policy, "blocks": len(layout.blocks)})
    return model


class _SACForward:
    """The instance-level forward of a block under SAC (picklable, like checkpointing's wrapper)."""

    def __init__(self, block: nn.Module, policy: str, inner):
        self.block, self.policy, self.inner = block, policy, inner

    @property
    def __signature__(self):  # what inspect.signature reads: the wrapped forward's parameters
        from lowmembp.methods._signature import original_signature
        return original_signature(self.block, "forward", self.inner)

    def __call__(self, *args, **kwargs):
        fn = self.inner or functools.partial(type(self.block).forward, self.block)
        if not (self.block.training and torch.is_grad_enabled()):
            return fn(*args, **kwargs)
        context = functools.partial(create_selective_checkpoint_contexts, policy_fn(POLICIES[self.policy]))
        # A key/value cache would grow again when the block is recomputed (transformers turns it off under
        # gradient checkpointing for the same reason): training needs none, so the block gets none.
        kwargs = {k: (None if _is_cache(v) else v) for k, v in kwargs.items()}
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context, **_RESPECT_HOOKS, **kwargs)


def _is_cache(v) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(v).__mro__)


# What SAC keeps must pass through the active saved-tensor hooks (torch >= 2.14 asks to choose; older ones did not):
# the saved-tensor accountant then counts it, and ``offload`` moves it to the host like any other saved tensor.
_RESPECT_HOOKS = ({"respect_saved_tensors_hooks": True}
                  if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})

"""``sac``: selective activation checkpointing per transformer block (docs/design.md#peers).

Each block's forward runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
context_fn=partial(create_selective_checkpoint_contexts, policy))``: the policy marks every op the block runs as
``MUST_SAVE`` (its output is kept for backward, as without checkpointing) or ``PREFER_RECOMPUTE`` (dropped and
recomputed in the backward). Exact: the recomputation reruns the same ops (RNG state preserved).

Option ``policy``:

- ``"save-matmuls"`` (default; the common policy, e.g. torchtitan's): keep the outputs of matrix products
  (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions) and of fused attention (every SDPA kernel's output and
  log-sum-exp); recompute everything else — norms, activations, casts, residual adds, products. The backward then
  costs the cheap pointwise ops again, not the matmuls.
- ``"save-attention"``: keep only the fused attention outputs (the most expensive op to recompute per byte);
  recompute the matmuls too.
- ``"save-nothing"``: recompute everything (the memory of plain ``checkpointing`` through the SAC machinery).

Like ``checkpointing``, a block keeps its inputs; what it saves inside follows the policy. The wrapper sits on the
block instance (its class, name and parameters unchanged) and only checkpoints in training mode with grad enabled.
What SAC keeps goes through the saved-tensor hooks around it (``respect_saved_tensors_hooks=True`` where torch
has the switch, 2.14): the accountant counts it and ``offload`` moves it. A transformers key/value cache argument is
dropped in training (recomputing a block would append to it twice). Excludes ``checkpointing`` (both checkpoint the
same blocks) and ``tokentune`` (it runs its own block loop).
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

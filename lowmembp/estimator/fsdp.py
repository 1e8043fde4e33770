"""One rank's peak under FSDP2 (``fully_shard`` per block, then the root) from the one-process peak of the same
per-rank batch (:func:`fsdp_peak`)."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["fsdp_peak"]


def _shard_bytes(t: torch.Tensor, n: int = 1) -> int:
    """Bytes of one rank's FSDP2 shard of ``t``: dim 0 split in n, padded to equal chunks (0-d tensors whole)."""
    if n == 1 or t.dim() == 0:
        return t.numel() * t.element_size()
    rest = t.numel() // t.shape[0] if t.shape[0] else 0
    return -(-t.shape[0] // n) * rest * t.element_size()


def fsdp_peak(pk: dict, model: nn.Module, optimizer, blocks: list[str], n: int) -> dict:
    """One rank's peak under FSDP2 (``fully_shard`` on each of ``blocks``, then the root) from the one-process
    peak ``pk`` of the same per-rank batch, by category:

    - parameters: every parameter sharded (dim 0 in n padded chunks), plus the root's own parameters (outside the
      blocks: embeddings, final norm, head) whole — FSDP2 keeps the root's group gathered from its forward to the end
      of its backward — plus the largest block's parameters whole (the block being computed), twice when the peak
      falls in the backward (FSDP2 prefetches the next block's all-gather there); buffers stay whole;
    - gradients: those alive at the peak, sharded, plus — when the peak falls inside the blocks' backward (more
      gradients alive than the root's own) — the largest block's trainable gradients twice: unsharded, and their
      reduce-scatter copy;
    - optimizer state: sharded like its parameters (0-d ``step`` counters whole);
    - activations: unchanged (per rank);
    - temporaries: unchanged, plus the collectives' staging buffers at their worst: a block's flat all-gather output
      before it is copied out into the parameters and, in the backward, a block's flat reduce-scatter input — one
      block's parameters each (``staging_bytes`` in the result). Whether they are alive at the peak depends on when
      the collective finishes: a two-process CPU run measured each rank's peak anywhere between the modelled peak
      without them and with both, run to run (``tests/estimator/test_estimate_fsdp.py``), so the planner counts them.

    Not modelled: padding beyond dim 0, CUDA streams' overlap."""
    prefixes = tuple(b + "." for b in blocks)
    named = list(model.named_parameters())
    whole = sum(_shard_bytes(p) for _, p in named)
    shard = sum(_shard_bytes(p, n) for _, p in named)
    root = [p for name, p in named if not name.startswith(prefixes)]
    root_gathered = sum(_shard_bytes(p) - _shard_bytes(p, n) for p in root)
    per_block = [[p for name, p in named if name.startswith(b + ".")] for b in blocks]
    block_params = max((sum(_shard_bytes(p) for p in ps) for ps in per_block), default=0)
    block_grads = max((sum(_shard_bytes(p) for p in ps if p.requires_grad) for ps in per_block), default=0)
    trainable = [p for _, p in named if p.requires_grad]
    g_whole = sum(_shard_bytes(p) for p in trainable)
    g_shard = sum(_shard_bytes(p, n) for p in trainable)
    state = [v for s in (optimizer.state.values() if optimizer is not None else ()) for v in s.values()
             if isinstance(v, torch.Tensor)]
    cats = dict(pk["by_category"])
    old = {k: cats.get(k, 0) for k in ("parameters", "gradients", "optimizer_state")}
    grads = old["gradients"]
    root_grads = sum(_shard_bytes(p) for p in root if p.requires_grad)
    backward = grads > 0
    in_blocks = grads > root_grads
    staging = block_params * (2 if backward else 1)
    new = {"parameters": old["parameters"] - whole + shard + root_gathered + block_params * (2 if backward else 1),
           "gradients": (grads * g_shard // g_whole if g_whole else 0) + (2 * block_grads if in_blocks else 0),
           "optimizer_state": (sum(_shard_bytes(v, n) for v in state) if old["optimizer_state"] else 0),
           "temporaries": cats.get("temporaries", 0) + staging}
    old["temporaries"] = cats.get("temporaries", 0)
    cats.update(new)
    out = dict(pk, by_category=cats)
    out["bytes"] = int(pk["bytes"] - sum(old.values()) + sum(new.values()))
    out["how"] = (f"{pk['how']}; one rank of {n} under FSDP2 (parameters, gradients and optimizer state sharded, "
                  f"the root's parameters and the gathered blocks' whole; lowmembp.estimator.step.fsdp_peak)")
    out["world_size"] = n
    out["staging_bytes"] = staging
    return out

"""TokenTune's training forward: the block driver, the same for every family.

Every block runs twice over disjoint query rows, sharing one computation of the keys and values (the family hooks of
:mod:`lowmembp.models.tokentune_families`): ``prepare`` computes, with the graph, what every query needs from all L
tokens (attention input, keys, values); ``h`` carries a graph only on the selected rows, so gradients reach them
through their keys and values too, and the K/V weights see every token — the reference "full model with a
stop-gradient on every unselected hidden state". ``rows`` then computes the block output for one set of query rows:
once under ``torch.no_grad()`` for the unselected rows (nothing saved), once with the graph for the selected ones.

Backward keeps per block the row-wise activations of the k selected rows (∝ k/L) plus the O(L·d) floor of the
attention over all L tokens (its input, K and V). Under checkpointing (a block marked by timm's / transformers' own
flags or wrapped in place) the unselected rows are computed outside the checkpoint and only the selected part is
recomputed in backward.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lowmembp.models.rows import Context, Family, Rows, call_as, merge


def attention_mask_for(idx: torch.Tensor, length: int, key_valid: torch.Tensor | None, causal: bool):
    """Boolean SDPA mask for queries at positions ``idx``: padding keys masked, causal (key j ≤ query position).

    A query that could see no key at all (a padding query left of every real token, any query of an all-padding
    sequence) is let to see itself / every key, so that its (unused) output stays finite; real queries always see
    at least themselves, so nothing changes for them. No data-dependent Python: works on fake tensors.
    """
    if key_valid is None and not causal:
        return None
    pos = torch.arange(length, device=idx.device)
    mask = torch.ones(idx.shape[0], 1, 1, length, dtype=torch.bool, device=idx.device)
    if key_valid is not None:
        key_valid = key_valid.bool()
        key_valid = key_valid | ~key_valid.any(-1, keepdim=True)  # an all-padding sequence: let it see itself
        mask = mask & key_valid[:, None, None, :]
    if causal:
        mask = mask & (pos[None, None, None, :] <= idx[:, None, :, None])
        self_pos = pos[None, None, None, :] == idx[:, None, :, None]
        mask = mask | (self_pos & ~mask.any(-1, keepdim=True))
    return mask


def make_context(family: Family, selection, length: int, key_valid: torch.Tensor | None,
                 extra: dict | None = None) -> Context:
    """The :class:`Context` of one forward from a selection (``positions``/``others`` B×k / B×(L−k))."""
    ctx = Context(length=length, selected=Rows(selection.positions), others=Rows(selection.others),
                  key_valid=key_valid, causal=family.decoder, extra=dict(extra or {}))
    for rows in (ctx.selected, ctx.others):
        rows.mask = attention_mask_for(rows.idx, length, key_valid, family.decoder)
        family.add_row_extras(rows, ctx)
    return ctx


def run_blocks(family: Family, blocks: list[nn.Module], h: torch.Tensor, ctx: Context,
               use_checkpoint: list[bool]) -> torch.Tensor:
    """All blocks; ``h`` carries a graph only on the selected rows, and so does the result. A block sharded by
    FSDP2 (``fully_shard``) runs through its ``__call__``, so that its hooks gather its parameters before and
    release them after (and again around its backward), as they would around the block's own forward."""
    for block, ckpt in zip(blocks, use_checkpoint):
        if _is_sharded(block):
            h = call_as(block, lambda h_, block=block, ckpt=ckpt: block_step(family, block, h_, ctx, ckpt), h)
        else:
            h = block_step(family, block, h, ctx, ckpt)
    return h


def _is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 ``fully_shard`` wrapped ``module`` (without importing torch.distributed when nothing did)."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def block_step(family: Family, block: nn.Module, h: torch.Tensor, ctx: Context, ckpt: bool) -> torch.Tensor:
    sel, oth = ctx.selected, ctx.others
    noise = ctx.noise = family.draw(block, h)  # per-sample randomness shared by both row sets
    if ckpt and torch.is_grad_enabled():
        out_o = None
        if oth.idx.shape[1] > 0:
            with torch.no_grad():
                out_o = family.rows(block, family.prepare(block, h, ctx), h, oth, ctx)

        def selected_part(h_):
            ctx.noise = noise  # (the recompute runs later, after other blocks set theirs)
            return family.rows(block, family.prepare(block, h_, ctx), h_, sel, ctx)

        out_s = checkpoint(selected_part, h, use_reentrant=False)
    else:
        prep = family.prepare(block, h, ctx)
        out_o = None
        if oth.idx.shape[1] > 0:
            with torch.no_grad():
                out_o = family.rows(block, prep, h, oth, ctx)
        out_s = family.rows(block, prep, h, sel, ctx)
    return merge(out_o, oth.idx, out_s, sel.idx, ctx.length)

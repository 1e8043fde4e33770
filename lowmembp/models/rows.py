"""Running a block on a subset of its rows: the ground TokenTune's per-family training forwards stand on.

A block's query rows are computed in two parts (the selected rows with the graph, the others without) over keys and
values computed once from all L rows. This module holds what the family hooks
(:mod:`lowmembp.models.tokentune_families`) and the method's block driver (:mod:`lowmembp.methods.tokentune_forward`)
share: the hook contract (:class:`Family`, :class:`EntryPoint`), the per-forward state the hooks read
(:class:`Context`, :class:`Rows`), and row operations on B×L tensors that save no more than the gradient needs.
Plain torch: nothing here knows a family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------------- row helpers
def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, idx[b]]``: the rows ``idx`` (B×r) of ``t`` (B×L×...). Indexing keeps only the indices for backward
    (``gather`` would keep all of ``t``)."""
    return t[torch.arange(t.shape[0], device=idx.device)[:, None], idx]


def merge(const_rows: torch.Tensor | None, const_idx: torch.Tensor | None, grad_rows: torch.Tensor,
          grad_idx: torch.Tensor, length: int) -> torch.Tensor:
    """A B×L×d tensor: ``const_rows`` (no graph) at ``const_idx``, ``grad_rows`` (with graph) at ``grad_idx``."""
    B, _, *rest = grad_rows.shape
    with torch.no_grad():
        base = grad_rows.new_zeros(B, length, *rest)
        if const_rows is not None and const_idx.shape[1] > 0:
            base.scatter_(1, _expand_idx(const_idx, base), const_rows.to(base.dtype))
    return base.scatter(1, _expand_idx(grad_idx, base), grad_rows)


def _expand_idx(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return idx.view(*idx.shape, *([1] * (like.dim() - 2))).expand(idx.shape[0], idx.shape[1], *like.shape[2:])


def embed_rows(emb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Hidden state 0 from embeddings computed on all rows: the graph kept only on the rows ``idx`` (B×k)."""
    if not emb.requires_grad:
        return emb
    full = idx[..., None].expand(-1, -1, emb.shape[-1])
    return emb.detach().scatter(1, full, take(emb, idx))


def norm_all_rows(norm: nn.Module, h: torch.Tensor, ctx: "Context") -> torch.Tensor:
    """``norm(h)`` over all L rows, saving as little as the gradient allows.

    A norm with frozen parameters (e.g. under LoRA) is run under ``no_grad`` on the unselected rows and with the
    graph on the selected rows only, so backward keeps k rows of its input, not L. A trainable norm gets gradient
    from every row through the keys/values, so it runs on all rows; so does a parameter-free one (an MS norm saves
    its output, which is the K/V projections' input anyway).
    """
    params = list(norm.parameters())
    if not params or any(p.requires_grad for p in params) or ctx.others.idx.shape[1] == 0 \
            or not torch.is_grad_enabled():
        return norm(h)
    with torch.no_grad():
        x_o = norm(take(h, ctx.others.idx))
    return merge(x_o, ctx.others.idx, norm(take(h, ctx.selected.idx)), ctx.selected.idx, ctx.length)


def sdpa(module: nn.Module, q, k, v, mask, dropout_p: float, scale: float | None):
    """``F.scaled_dot_product_attention`` (grouped K/V heads when q has more heads than k), run as the forward of
    the block's attention ``module`` so that module hooks (the saved-bytes accountant's attribution to the
    ``attention`` kind and to the block) see it."""
    gqa = q.shape[1] != k.shape[1]
    return call_as(module, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                                  scale=scale, enable_gqa=gqa))


def call_as(module: nn.Module, fn, *args):
    """``fn(*args)`` called through ``module.__call__`` (its hooks run around it), ``module.forward`` restored
    after."""
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    object.__setattr__(module, "forward", fn)
    try:
        return module(*args)
    finally:
        if had:
            object.__setattr__(module, "forward", old)
        else:
            del module.__dict__["forward"]


# ------------------------------------------------------------------------------------------------ per-forward state
@dataclass
class Rows:
    """One set of query rows: positions ``idx`` (B×r) and the attention mask of those queries (None: all keys)."""
    idx: torch.Tensor
    mask: torch.Tensor | None = None  # bool, B×1×r×L (or B×1×1×L), True = may attend
    extra: dict[str, Any] = field(default_factory=dict)  # family data per row set (e.g. RoPE cos/sin of the rows)


@dataclass
class Context:
    """What one training forward needs in every block."""
    length: int
    selected: Rows
    others: Rows
    key_valid: torch.Tensor | None = None  # B×L bool, True = a real (non-padding) token
    causal: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # family data over all L positions (RoPE cos/sin)
    noise: Any = None  # the current block's per-sample random decisions (ViT DropPath masks)


# --------------------------------------------------------------------------------------------------- the contract
@dataclass
class EntryPoint:
    """Where a family's training forward goes: ``module.<attr>`` is replaced by ``forward(module, state, *args,
    **kwargs)`` in training; ``owner`` is the module whose flags say "gradient checkpointing"; ``task``:
    ``"classification"`` or ``"causal_lm"``."""
    module: nn.Module
    attr: str
    forward: Callable
    owner: nn.Module
    task: str = "classification"


class Family:
    """Per-family hooks. ``prepare`` runs on all L rows (graph on the selected ones), ``rows`` on a row subset."""
    name = "?"
    label = "?"  # what the family covers, for messages
    decoder = False

    def check_block(self, block: nn.Module) -> None:  # raise a clear error for a block this code cannot run
        pass

    def entry_point(self, base: nn.Module, pool: str) -> EntryPoint:  # pragma: no cover - abstract
        """Where the training forward of the model ``base`` goes (or a clear error for a model it cannot run)."""
        raise NotImplementedError

    def prepare(self, block, h, ctx):  # pragma: no cover - abstract
        raise NotImplementedError

    def rows(self, block, prep, h, rows: Rows, ctx: Context):  # pragma: no cover - abstract
        raise NotImplementedError

    def add_row_extras(self, rows: Rows, ctx: Context) -> None:
        pass

    def draw(self, block, h):  # per-sample random decisions of the block, drawn once for both row sets
        return None

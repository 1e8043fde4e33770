"""TokenTune's training forward: a generic block driver plus small per-family hooks (ViT, BERT/RoBERTa, LLaMA).

Every block is run twice over disjoint query rows, sharing one computation of the keys and values:

- ``prepare(block, h, ctx)`` computes, with the graph, what every query needs from *all* L tokens: the attention
  input (pre-norm: ``norm1(h)``; BERT: ``h``) and the keys/values (RoPE applied for LLaMA). ``h`` carries a graph
  only on the selected rows (the other rows are constants), so gradients reach the selected rows through their keys
  and values too, and the K/V weights (and the norm before them) see every token — exactly as in the reference
  "full model with a stop-gradient on every unselected hidden state".
- ``rows(block, prep, h, rows, ctx)`` computes the block output for the query rows ``rows.idx`` only: queries, the
  attention of those queries over all keys/values (padding and causal masks applied), output projection, residual,
  MLP. It is called once under ``torch.no_grad()`` for the unselected rows (no graph, nothing saved) and once with
  the graph for the selected rows.

What backward keeps per block: the row-wise activations of the k selected rows (queries, attention output, MLP,
norms: scale with k/L) plus the O(L·d) floor of the attention over all L tokens: the attention input (saved by the
K/V projections), K and V, and — when the norm before the attention is trainable (full fine-tuning) — that norm's
input too (a norm with frozen parameters, as under LoRA, runs on the selected rows with the graph and on the others
without; a parameter-free MS norm saves only its output, which is the K/V projections' input anyway).
Per token·d per block: BERT 3 values (h, K, V); ViT/LLaMA 3 (x, K, V), 4 with a trainable pre-norm (HF's
LlamaRMSNorm also keeps its normalised fp32 value: 5). The unselected rows' activations are never saved.

Under checkpointing (a block marked by timm's / transformers' own flags or wrapped in place), the unselected rows
are computed outside the checkpoint and only the selected part is recomputed in backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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


# ------------------------------------------------------------------------------------------------------ the driver
def run_blocks(family: "Family", blocks: list[nn.Module], h: torch.Tensor, ctx: Context,
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


def block_step(family: "Family", block: nn.Module, h: torch.Tensor, ctx: Context, ckpt: bool) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------------- the families
class Family:
    """Per-family hooks. ``prepare`` runs on all L rows (graph on the selected ones), ``rows`` on a row subset."""
    name = "?"
    decoder = False

    def check_block(self, block: nn.Module) -> None:  # raise a clear error for a block this code cannot run
        pass

    def prepare(self, block, h, ctx):  # pragma: no cover - abstract
        raise NotImplementedError

    def rows(self, block, prep, h, rows: Rows, ctx: Context):  # pragma: no cover - abstract
        raise NotImplementedError

    def add_row_extras(self, rows: Rows, ctx: Context) -> None:
        pass

    def draw(self, block, h):  # per-sample random decisions of the block, drawn once for both row sets
        return None


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """B×N×(H·D) -> B×H×N×D."""
    B, N, _ = t.shape
    return t.view(B, N, -1, head_dim).transpose(1, 2)


def _merge_heads(o: torch.Tensor) -> torch.Tensor:
    """B×H×N×D -> B×N×(H·D)."""
    B, H, N, D = o.shape
    return o.transpose(1, 2).reshape(B, N, H * D)


class ViTFamily(Family):
    """timm ``Block`` (pre-norm) with timm ``Attention`` (fused qkv, optional q/k norm, scale norm, gate)."""
    name = "vit"

    def check_block(self, block):
        attn = getattr(block, "attn", None)
        needed = ("norm1", "norm2", "mlp", "ls1", "ls2", "drop_path1", "drop_path2")
        if attn is None or not all(hasattr(block, a) for a in needed) or not hasattr(attn, "qkv") \
                or not all(hasattr(attn, a) for a in ("q_norm", "k_norm", "proj", "num_heads", "head_dim")):
            raise TypeError(f"tokentune: timm block {type(block).__name__} with attention "
                            f"{type(attn).__name__} is not supported; it needs timm's pre-norm Block with the fused-"
                            f"qkv Attention (vit_*, deit_* models)")

    def prepare(self, block, h, ctx):
        a = block.attn
        x = norm_all_rows(block.norm1, h, ctx)
        B, L, _ = x.shape
        qkv = a.qkv(x).reshape(B, L, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        _, k, v = qkv.unbind(0)
        # copies, so that backward keeps K and V (2·L·d) rather than the whole 3·L·d qkv output
        return x, qkv, a.k_norm(k).contiguous(), v.contiguous()

    def rows(self, block, prep, h, rows, ctx):
        a = block.attn
        x, qkv, k, v = prep  # qkv: 3×B×H×L×D, a view of the B×L×3·H·D projection output
        q = take(qkv.permute(1, 3, 0, 2, 4), rows.idx)[:, :, 0].transpose(1, 2)  # B×H×r×D
        q = a.q_norm(q)
        o = sdpa(a, q, k, v, rows.mask, a.attn_drop.p if a.training else 0.0, a.head_dim ** -0.5)
        o = a.norm(_merge_heads(o))
        if getattr(a, "gate", None) is not None:
            o = o * a.gate(take(x, rows.idx)).sigmoid()
        o = a.proj_drop(a.proj(o))
        m1, m2 = ctx.noise or (None, None)
        hr = take(h, rows.idx) + _drop_path(block.drop_path1, block.ls1(o), m1)
        return hr + _drop_path(block.drop_path2, block.ls2(block.mlp(block.norm2(hr))), m2)

    def draw(self, block, h):
        """timm DropPath decides per sample: draw each block's two keep-masks once (B×1×1, in the order and shape
        timm draws them), so the selected and unselected rows of a sample are dropped together."""
        masks = []
        for dp in (block.drop_path1, block.drop_path2):
            p = float(getattr(dp, "drop_prob", 0.0) or 0.0)
            if not (dp.training and p > 0.0):
                masks.append(None)
                continue
            keep = 1.0 - p
            m = h.new_empty((h.shape[0],) + (1,) * (h.dim() - 1)).bernoulli_(keep)
            if keep > 0.0 and getattr(dp, "scale_by_keep", True):
                m.div_(keep)
            masks.append(m)
        return masks


def _drop_path(dp: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return dp(x) if mask is None else x * mask


class BertFamily(Family):
    """transformers ``BertLayer`` / ``RobertaLayer`` (post-norm encoder layer, self-attention only)."""
    name = "bert"

    def check_block(self, block):
        att = getattr(getattr(block, "attention", None), "self", None)
        if att is None or not all(hasattr(att, a) for a in ("query", "key", "value", "attention_head_size")) \
                or not hasattr(block, "feed_forward_chunk"):
            raise TypeError(f"tokentune: {type(block).__name__} is not a BERT/RoBERTa encoder layer this code knows")
        if getattr(block, "is_decoder", False) or getattr(block, "add_cross_attention", False):
            raise TypeError("tokentune supports BERT/RoBERTa as bidirectional encoders only (config.is_decoder and "
                            "cross-attention are not supported)")

    def prepare(self, block, h, ctx):
        a = block.attention.self
        return h, _heads(a.key(h), a.attention_head_size), _heads(a.value(h), a.attention_head_size)

    def rows(self, block, prep, h, rows, ctx):
        a = block.attention.self
        _, k, v = prep
        hr = take(h, rows.idx)
        q = _heads(a.query(hr), a.attention_head_size)
        # transformers < 5 keeps no ``scaling`` on BERT's attention: the same 1/sqrt(head size) its forward uses
        scaling = getattr(a, "scaling", a.attention_head_size ** -0.5)
        o = sdpa(a, q, k, v, rows.mask, a.dropout.p if a.training else 0.0, scaling)
        att = block.attention.output(_merge_heads(o), hr)
        return block.feed_forward_chunk(att)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """LLaMA rotary embedding, as in transformers: ``x·cos + rotate_half(x)·sin`` (cos/sin: B×N×D)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class LlamaFamily(Family):
    """transformers LLaMA-like decoder layer: pre-RMSNorm, q/k/v/o projections with RoPE (optional q/k norm), GQA."""
    name = "llama"
    decoder = True

    def check_block(self, block):
        a = getattr(block, "self_attn", None)
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        if a is None or not all(hasattr(a, n) for n in needed) or not hasattr(block, "input_layernorm") \
                or not hasattr(block, "post_attention_layernorm") or not hasattr(block, "mlp"):
            raise TypeError(f"tokentune: {type(block).__name__} is not a LLaMA-like decoder layer this code knows")

    def _qk(self, a, t, norm_name):
        B, N, _ = t.shape
        t = t.view(B, N, -1, a.head_dim)
        norm = getattr(a, norm_name, None)
        if norm is not None:  # Qwen3-style per-head norm, applied before RoPE
            t = norm(t)
        return t.transpose(1, 2)

    def prepare(self, block, h, ctx):
        a = block.self_attn
        x = norm_all_rows(block.input_layernorm, h, ctx)
        k = apply_rope(self._qk(a, a.k_proj(x), "k_norm"), ctx.extra["cos"], ctx.extra["sin"])
        v = _heads(a.v_proj(x), a.head_dim)
        return x, k, v

    def rows(self, block, prep, h, rows, ctx):
        a = block.self_attn
        x, k, v = prep
        q = apply_rope(self._qk(a, a.q_proj(take(x, rows.idx)), "q_norm"), rows.extra["cos"], rows.extra["sin"])
        drop = getattr(a, "attention_dropout", 0.0) if a.training else 0.0
        o = a.o_proj(_merge_heads(sdpa(a, q, k, v, rows.mask, drop, a.scaling)))
        hr = take(h, rows.idx) + o
        return hr + block.mlp(block.post_attention_layernorm(hr))

    def add_row_extras(self, rows, ctx):
        rows.extra["cos"] = take(ctx.extra["cos"], rows.idx)
        rows.extra["sin"] = take(ctx.extra["sin"], rows.idx)


FAMILIES: dict[str, Family] = {"vit": ViTFamily(), "bert": BertFamily(), "llama": LlamaFamily()}


def make_context(family: Family, selection, length: int, key_valid: torch.Tensor | None,
                 extra: dict | None = None) -> Context:
    """The :class:`Context` of one forward from a selection (``positions``/``others`` B×k / B×(L−k))."""
    ctx = Context(length=length, selected=Rows(selection.positions), others=Rows(selection.others),
                  key_valid=key_valid, causal=family.decoder, extra=dict(extra or {}))
    for rows in (ctx.selected, ctx.others):
        rows.mask = attention_mask_for(rows.idx, length, key_valid, family.decoder)
        family.add_row_extras(rows, ctx)
    return ctx

"""TokenTune's per-family training forwards: timm ViT, transformers BERT / RoBERTa, LLaMA-like decoders.

Each family gives the block hooks the method's driver runs (:class:`lowmembp.models.rows.Family`: ``prepare`` on all
L rows, ``rows`` on a row subset) and the entry forward that replaces the model's own in training
(``entry_point``). An entry forward does what only the family knows (parse the call, embed, find the rows the head
reads, run the head) and leaves the rest to the method's per-model state ``tt``, duck-typed:
``tt.select(valid, decoder, forced)`` chooses the rows, ``tt.run_blocks(h, sel, key_valid, extra)`` runs every block,
``tt.head_feature(hs, sel, read)`` is what a one-row head reads under ``tt.pool``; ``tt.lead`` / ``tt.reads`` /
``tt.task`` come from the layout and :meth:`Family.entry_point`.

Backward keeps per token·d per block: BERT 3 values (h, K, V); ViT/LLaMA 3 (x, K, V), 4 with a trainable pre-norm
(HF's LlamaRMSNorm also keeps its normalised fp32 value: 5). ``DRIVERS``: the families by the name an adapter gives
in ``ModelLayout.tokentune``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowmembp.models.hf_models import last_token_positions
from lowmembp.models.rows import EntryPoint, Family, embed_rows, merge, norm_all_rows, sdpa, take


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """B×N×(H·D) -> B×H×N×D."""
    B, N, _ = t.shape
    return t.view(B, N, -1, head_dim).transpose(1, 2)


def _merge_heads(o: torch.Tensor) -> torch.Tensor:
    """B×H×N×D -> B×N×(H·D)."""
    B, H, N, D = o.shape
    return o.transpose(1, 2).reshape(B, N, H * D)


# ------------------------------------------------------------------------------------------------------- timm ViT
class ViTFamily(Family):
    """timm ``Block`` (pre-norm) with timm ``Attention`` (fused qkv, optional q/k norm, scale norm, gate)."""
    name = "vit"
    label = "timm ViT"

    def check_block(self, block):
        attn = getattr(block, "attn", None)
        needed = ("norm1", "norm2", "mlp", "ls1", "ls2", "drop_path1", "drop_path2")
        if attn is None or not all(hasattr(block, a) for a in needed) or not hasattr(attn, "qkv") \
                or not all(hasattr(attn, a) for a in ("q_norm", "k_norm", "proj", "num_heads", "head_dim")):
            raise TypeError(f"tokentune: timm block {type(block).__name__} with attention "
                            f"{type(attn).__name__} is not supported; it needs timm's pre-norm Block with the fused-"
                            f"qkv Attention (vit_*, deit_* models)")

    def entry_point(self, base, pool):
        if not all(hasattr(base, a) for a in ("patch_embed", "_pos_embed", "norm_pre", "norm", "forward_features")):
            raise TypeError(f"tokentune: {type(base).__name__} is not a timm VisionTransformer")
        return EntryPoint(base, "forward_features", vit_forward_features, owner=base)

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


def vit_forward_features(self, tt, x, attn_mask=None, is_causal=False):
    """Training ``forward_features``: the selected rows (B×k×d, ascending, the ``tt.lead`` class / register rows
    first) for ``forward_head`` to pool as it pools all; ``pool='mean'``: their mean on every row."""
    if attn_mask is not None or is_causal:
        raise TypeError("tokentune training forward does not take attn_mask / is_causal for timm ViT")
    emb = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
    B, L, d = emb.shape
    lead = min(tt.lead, L) if tt.pool == "model" else 0
    forced = torch.arange(lead, device=emb.device).expand(B, lead) if lead else None
    sel = tt.select(torch.ones(B, L, dtype=torch.bool, device=emb.device), decoder=False, forced=forced)
    h = tt.run_blocks(embed_rows(emb, sel.positions), sel, None)
    hs = self.norm(take(h, sel.positions))
    if tt.pool == "mean":
        pooled = tt.head_feature(hs, sel, None)
        return pooled[:, None, :].expand(B, L, d)
    return hs


# ------------------------------------------------------------------------------------------ transformers: shared
def _reject(kwargs: dict, allowed=()) -> None:
    """Options the training forward cannot honour (caches, returned attentions/hidden states) -> a clear error."""
    for key, val in kwargs.items():
        if key in allowed or val is None or val is False:
            continue
        if key in ("return_dict", "use_cache", "num_items_in_batch"):  # the last: a loss kwarg the HF Trainer passes
            continue
        raise TypeError(f"tokentune training forward does not support {key}={val!r}; call model.eval() for that, "
                        f"or pass only input_ids / attention_mask / token_type_ids / position_ids / inputs_embeds / "
                        f"labels")


def _valid_tokens(attention_mask, B: int, L: int, device) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, L):
        raise ValueError(f"tokentune training forward takes a 2-D attention_mask of shape {(B, L)} (1 = real token, "
                         f"0 = padding), got shape {tuple(attention_mask.shape)}")
    return attention_mask.to(device).bool()


def _read_positions(tt, model: nn.Module, input_ids, B: int, L: int, device) -> torch.Tensor:
    """B: the position the model's own head reads in each sequence (the layout's ``head_reads``)."""
    if tt.reads == "first":
        return torch.zeros(B, dtype=torch.long, device=device)
    if tt.reads == "last":
        return last_token_positions(model.config, input_ids, B, L, device)
    raise TypeError(f"tokentune: the adapter of {type(model).__name__} says its head reads {tt.reads!r}, not one "
                    f"token ('first' / 'last'); convert with pool='mean' or add the rule to its adapter")


def _forced(read: torch.Tensor | None) -> torch.Tensor | None:
    """The positions the selection must take for the head: the one it reads (none under ``pool='mean'``)."""
    return None if read is None else read[:, None]


# -------------------------------------------------------------------------------------------------- BERT, RoBERTa
class BertFamily(Family):
    """transformers ``BertLayer`` / ``RobertaLayer`` (post-norm encoder layer, self-attention only)."""
    name = "bert"
    label = "BERT/RoBERTa sequence classification"

    def check_block(self, block):
        att = getattr(getattr(block, "attention", None), "self", None)
        if att is None or not all(hasattr(att, a) for a in ("query", "key", "value", "attention_head_size")) \
                or not hasattr(block, "feed_forward_chunk"):
            raise TypeError(f"tokentune: {type(block).__name__} is not a BERT/RoBERTa encoder layer this code knows")
        if getattr(block, "is_decoder", False) or getattr(block, "add_cross_attention", False):
            raise TypeError("tokentune supports BERT/RoBERTa as bidirectional encoders only (config.is_decoder and "
                            "cross-attention are not supported)")

    def entry_point(self, base, pool):
        backbone = getattr(base, "base_model", None)
        name = type(base).__name__
        if not name.endswith("ForSequenceClassification") or backbone is None or backbone is base:
            raise TypeError(f"tokentune supports BERT/RoBERTa sequence classification models "
                            f"(BertForSequenceClassification, RobertaForSequenceClassification); got {name}")
        return EntryPoint(backbone, "forward", bert_forward, owner=backbone)

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


def bert_forward(self, tt, input_ids=None, attention_mask=None, token_type_ids=None,
                 position_ids=None, inputs_embeds=None, **kwargs):
    """Training forward of the backbone: the head's feature of the selected rows on every row of the last hidden
    state (the pooler / classification head reads token 0)."""
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
    _reject(kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    ref = input_ids if input_ids is not None else inputs_embeds
    B, L = ref.shape[:2]
    device = ref.device
    valid = _valid_tokens(attention_mask, B, L, device)
    read = _read_positions(tt, self, input_ids, B, L, device) if tt.pool == "model" else None
    sel = tt.select(valid, decoder=False, forced=_forced(read))
    emb_mod = self.embeddings
    if position_ids is None:
        if hasattr(emb_mod, "create_position_ids_from_input_ids"):  # RoBERTa: positions count real tokens
            position_ids = (emb_mod.create_position_ids_from_input_ids(input_ids, emb_mod.padding_idx)
                            if input_ids is not None else
                            emb_mod.create_position_ids_from_inputs_embeds(inputs_embeds, emb_mod.padding_idx))
        else:
            position_ids = emb_mod.position_ids[:, :L]
    position_ids = position_ids.to(device).expand(B, L)
    if token_type_ids is None:
        token_type_ids = torch.zeros(B, L, dtype=torch.long, device=device)
    token_type_ids = token_type_ids.expand(B, L)

    def embed(idx):
        return emb_mod(input_ids=None if input_ids is None else take(input_ids, idx),
                       token_type_ids=take(token_type_ids, idx), position_ids=take(position_ids, idx),
                       inputs_embeds=None if inputs_embeds is None else take(inputs_embeds, idx))

    with torch.no_grad():
        const = embed(sel.others) if sel.others.shape[1] else None
    h = merge(const, sel.others, embed(sel.positions), sel.positions, L)
    h = tt.run_blocks(h, sel, valid if attention_mask is not None else None)
    feature = tt.head_feature(take(h, sel.positions), sel, read)
    last = feature[:, None, :].expand(B, L, feature.shape[-1])  # the pooler / head reads token 0: this row
    pooler = getattr(self, "pooler", None)
    return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=last,
                                                        pooler_output=pooler(last) if pooler is not None else None)


# ----------------------------------------------------------------------------------------------------- LLaMA-like
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """LLaMA rotary embedding, as in transformers: ``x·cos + rotate_half(x)·sin`` (cos/sin: B×N×D)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class LlamaFamily(Family):
    """transformers LLaMA-like decoder layer: pre-RMSNorm, q/k/v/o projections with RoPE (optional q/k norm), GQA."""
    name = "llama"
    label = "LLaMA-like"
    decoder = True

    def check_block(self, block):
        a = getattr(block, "self_attn", None)
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        if a is None or not all(hasattr(a, n) for n in needed) or not hasattr(block, "input_layernorm") \
                or not hasattr(block, "post_attention_layernorm") or not hasattr(block, "mlp"):
            raise TypeError(f"tokentune: {type(block).__name__} is not a LLaMA-like decoder layer this code knows")

    def entry_point(self, base, pool):
        name = type(base).__name__
        task = "classification"
        if name.endswith("ForCausalLM"):
            task = "causal_lm"
            if pool != "model":
                raise ValueError(f"tokentune: pool={pool!r} is for classification heads; {name}'s logits are per "
                                 f"position (leave pool at 'model')")
        elif not name.endswith("ForSequenceClassification"):
            raise TypeError(f"tokentune supports LLaMA-like *ForCausalLM and *ForSequenceClassification; got {name}")
        return EntryPoint(base, "forward", llama_forward, owner=base.model, task=task)

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


def llama_forward(self, tt, input_ids=None, attention_mask=None, position_ids=None,
                  inputs_embeds=None, labels=None, **kwargs):
    """Training forward of the task model: a causal LM's B×k×V logits at the selected positions (and their
    next-token loss), a classifier's B×C logits from the head's feature of the selected rows."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, SequenceClassifierOutputWithPast
    return_dict = kwargs.pop("return_dict", None)
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            raise TypeError(f"tokentune training forward does not use a KV cache ({key}); call model.eval() to "
                            f"generate")
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("num_items_in_batch", None)  # the loss is the mean over the selected targets of this batch
    _reject(kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    backbone = self.model
    emb = backbone.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    B, L, _ = emb.shape
    valid = _valid_tokens(attention_mask, B, L, emb.device)
    window = getattr(self.config, "sliding_window", None)
    if window and L > window:
        raise TypeError(f"tokentune: sequence length {L} exceeds the sliding window {window}; sliding-window "
                        f"attention is not supported (use sequences of at most {window} tokens)")
    read = None
    if tt.task != "causal_lm" and tt.pool == "model":
        read = _read_positions(tt, self, input_ids, B, L, emb.device)
    sel = tt.select(valid, decoder=True, forced=_forced(read))
    if position_ids is None:
        position_ids = torch.arange(L, device=emb.device)[None]
    cos, sin = backbone.rotary_emb(emb, position_ids=position_ids.to(emb.device))
    h = tt.run_blocks(embed_rows(emb, sel.positions), sel, valid if attention_mask is not None else None,
                      extra={"cos": cos.expand(B, L, -1), "sin": sin.expand(B, L, -1)})
    hs = backbone.norm(take(h, sel.positions))
    loss = None
    if tt.task == "causal_lm":
        logits = self.lm_head(hs)
        if labels is not None:
            nxt = F.pad(labels.to(logits.device)[:, 1:], (0, 1), value=-100)  # target of position p: labels[p+1]
            targets = take(nxt, sel.positions).masked_fill(~sel.valid, -100)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
    else:
        logits = self.score(tt.head_feature(hs, sel, read))
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        out = SequenceClassifierOutputWithPast(loss=loss, logits=logits)
    return out.to_tuple() if return_dict is False else out


DRIVERS: dict[str, Family] = {f.name: f for f in (ViTFamily(), BertFamily(), LlamaFamily())}

"""``tokentune``: selective-token fine-tuning (Simoulin et al., ES-FoMo @ ICML 2023; EMNLP 2024, arXiv 2501.18824).

    model = lowmembp.apply(model, "tokentune", k=16)            # or "lora+tokentune", "lowmembp+tokentune", ...
    model.train(); out = model(**batch)                          # HF: out.logits / out.loss as usual
    tokentune_state(model).last.positions                        # the positions chosen for that batch (B×k)

Supported: BERT / RoBERTa ``*ForSequenceClassification``, LLaMA-like ``*ForCausalLM`` and
``*ForSequenceClassification`` (transformers), timm ``VisionTransformer`` (vit_*, deit_*) — plain or wrapped by peft,
with or without ``lowmembp`` norms / activations, with checkpointing applied after. Converted in place and returned.

Selection (:class:`TokenTuneState`): per sequence k distinct real positions, the same in every block — the rows the
model's head reads (``pool="model"``), the first real token, for decoders the last, the rest at random (the global
RNG, or a private generator with ``seed=``); ``k`` a count or a fraction ``0 < k < 1`` of the real tokens (the
official ``--prefix_length``); k ≥ L is full fine-tuning. ``tokentune_state(model).selector`` replaces the choice.

Training forward (``model.training``): exact. Every block computes the unselected rows under ``torch.no_grad()``
and the selected rows with the graph, the selected queries attending over all keys / values
(:mod:`lowmembp.methods.tokentune_forward`); the gradient is the true one with a stop-gradient on every unselected
hidden state. A classification head reads what the model's own head reads, of the selected tokens
(``pool="model"``; ``pool="mean"``: their mean, as the paper); a causal LM returns B×k×V logits at the selected
positions and, with ``labels=``, their next-token loss. KV caches, ``output_attentions`` / ``output_hidden_states``
and 4-D masks are refused in training. Evaluation (``model.eval()``) is the ordinary forward, untouched.

Memory: per block the selected rows' activations (∝ k/L) plus K/V and the attention input over all L tokens (an
O(L·d) floor). Composes with ``lora`` (order 10), ``lowmembp*`` (20) and ``checkpointing`` (50, applied after: only
the selected part of each marked block is recomputed). The full rules: docs/methods/tokentune.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowmembp.methods.checkpointing import is_checkpointed
from lowmembp.methods.registry import register
from lowmembp.methods.tokentune_forward import FAMILIES, make_context, merge, run_blocks, take


@dataclass
class Selection:
    """The positions of one training forward: ``positions`` B×k (ascending), ``valid`` B×k (False: a padding
    position used only to fill up a short sequence), ``others`` B×(L−k) (the unselected positions, ascending)."""
    positions: torch.Tensor
    valid: torch.Tensor
    others: torch.Tensor


@dataclass
class TokenTuneState:
    """Per-model TokenTune settings; find it with :func:`tokentune_state`."""
    k: int | float  # a count, or a fraction 0 < k < 1 of the real tokens (see count)
    family: str
    task: str  # "classification" | "causal_lm"
    seed: int | None = None
    pool: str = "model"  # "model": the head reads what the model's own head reads, of the selected rows; "mean"
    reads: str | None = None  # the layout's head_reads: "first" | "last" | "pool" | "each"
    lead: int = 0  # the layout's head_lead: leading rows the (timm) head reads or sets apart by position
    selector: Callable | None = None
    last: Selection | None = None
    blocks: list = field(default_factory=list)  # the original block modules
    sites: list = field(default_factory=list)  # their layout Sites (to see wrappers added later, e.g. checkpointing)
    owner: nn.Module | None = None  # the timm model / HF backbone whose flags say "gradient checkpointing"
    _generators: dict = field(default_factory=dict)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(int(self.seed))
        return self._generators[key]

    def count(self, valid: torch.Tensor, decoder: bool, forced: torch.Tensor | None = None) -> int:
        """Tokens per sequence of this batch: ``k`` itself, or for a fraction ``k`` the forced tokens plus
        ``int(k · (n − forced))`` of the rest (``n``: real tokens of the longest row)."""
        if isinstance(self.k, int):
            return self.k
        n = int(valid.sum(1).max()) if valid.numel() else 0
        n_forced = int(_forced_mask(valid, decoder, forced).sum(1).max()) if valid.numel() else 0
        forced = min(n, n_forced)
        return max(self.min_count(), forced + int(self.k * (n - forced)))

    def min_count(self) -> int:
        """The fewest tokens the head can work with: its leading rows (timm: class / register tokens), and a pool
        that sets them apart one more row to pool (``pool='mean'``: 1)."""
        if self.pool != "model":
            return 1
        return max(1, self.lead + (1 if self.reads == "pool" and self.lead else 0))

    def select(self, valid: torch.Tensor, decoder: bool, forced: torch.Tensor | None = None) -> Selection:
        """Choose this batch's positions; ``forced`` (B×m): positions that must be selected, before any other (the
        rows the model's head reads)."""
        gen = self.generator(valid.device)
        k = self.count(valid, decoder, forced)
        if self.selector is not None:
            positions = _check_positions(self.selector(valid, k, decoder, gen), valid, k, forced)
        else:
            positions = select_positions(valid, k, decoder=decoder, generator=gen, forced=forced)
        L = valid.shape[1]
        chosen = torch.zeros_like(valid).scatter_(1, positions, True)
        order = torch.sort(chosen.to(torch.uint8), dim=1, stable=True).indices  # unselected first, both ascending
        kk = positions.shape[1]
        sel = Selection(positions=order[:, L - kk:], valid=valid.gather(1, order[:, L - kk:]),
                        others=order[:, :L - kk])
        self.last = sel
        return sel

    def checkpoint_flags(self) -> list[bool]:
        """Per block: checkpoint its selected part? (the ``checkpointing`` method's per-block mark, timm's
        ``grad_checkpointing``, transformers' per-layer ``gradient_checkpointing``, or a wrapper put in its place)."""
        flag = bool(getattr(self.owner, "grad_checkpointing", False))
        return [flag or site.get() is not blk or is_checkpointed(blk)
                or bool(getattr(blk, "gradient_checkpointing", False))
                for site, blk in zip(self.sites, self.blocks)]


def select_positions(valid: torch.Tensor, k: int, *, decoder: bool = False,
                     generator: torch.Generator | None = None, forced: torch.Tensor | None = None) -> torch.Tensor:
    """k distinct positions per row of ``valid`` (B×L bool, True = real token): the ``forced`` ones (B×m, in that
    order of priority: the rows the model's head reads), the first real token, for decoders the last real one too,
    the rest uniformly at random among real tokens; padding only when a row has < k real tokens. Returns
    B×min(k, L) positions (not sorted)."""
    B, L = valid.shape
    kk = min(int(k), L)
    scores = torch.rand(B, L, generator=generator, device=valid.device)
    scores = scores.masked_fill(~valid, -1.0)
    rows = torch.arange(B, device=valid.device)
    scores[rows, _first_real(valid)] = 3.0  # the first real token (position 0 if none is real)
    if decoder and kk >= 2:
        scores[rows, _last_real(valid)] = 2.0  # the last real token
    if forced is not None and forced.shape[1]:
        m = forced.shape[1]
        prio = 4.0 + torch.arange(m, 0, -1, device=valid.device, dtype=scores.dtype)  # column 0 first
        scores.scatter_(1, forced.to(valid.device), prio.expand(B, m))
    return scores.topk(kk, dim=1).indices


def _first_real(valid: torch.Tensor) -> torch.Tensor:
    return valid.to(torch.uint8).argmax(1)


def _last_real(valid: torch.Tensor) -> torch.Tensor:
    return valid.shape[1] - 1 - valid.flip(1).to(torch.uint8).argmax(1)


def _forced_mask(valid: torch.Tensor, decoder: bool, forced: torch.Tensor | None) -> torch.Tensor:
    """B×L: the positions every selection takes first (``forced``, the first real token, decoders: the last)."""
    rows = torch.arange(valid.shape[0], device=valid.device)
    must = torch.zeros_like(valid, dtype=torch.bool)
    must[rows, _first_real(valid)] = True
    if decoder:
        must[rows, _last_real(valid)] = True
    if forced is not None and forced.shape[1]:
        must.scatter_(1, forced.to(valid.device), True)
    return must


def _check_positions(pos, valid, k, forced=None) -> torch.Tensor:
    B, L = valid.shape
    kk = min(k, L)
    if not isinstance(pos, torch.Tensor) or pos.shape != (B, kk) or pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokentune selector must return an integer tensor of shape {(B, kk)}, got "
                         f"{getattr(pos, 'shape', type(pos))}")
    pos = pos.to(device=valid.device, dtype=torch.long)
    if bool(((pos < 0) | (pos >= L)).any()) or bool((pos.sort(1).values.diff(dim=1) == 0).any()):
        raise ValueError("tokentune selector must return distinct positions in [0, L) per row")
    if forced is not None and forced.shape[1]:
        chosen = torch.zeros_like(valid, dtype=torch.bool).scatter_(1, pos, True)
        if not bool(chosen.gather(1, forced.to(valid.device)).all()):
            raise ValueError(f"tokentune selector must include the positions the model's head reads "
                             f"({forced.tolist()} per row); or convert with pool='mean'")
    return pos


def tokentune_state(model: nn.Module) -> TokenTuneState:
    """The :class:`TokenTuneState` of a converted model (peft wrappers looked through)."""
    from lowmembp.models.layout import unwrap_peft
    base = unwrap_peft(model)
    for m in (base, getattr(base, "base_model", None)):
        st = getattr(m, "_tokentune", None) if m is not None else None
        if st is not None:
            return st
    raise ValueError("this model was not converted with tokentune (use lowmembp.apply(model, 'tokentune', k=...))")


# ------------------------------------------------------------------------------------------------------ conversion
POOLS = ("model", "mean")


def checked_options(k: int | float = 16, seed: int | None = None,
                    pool: str = "model") -> tuple[int | float, int | None, str]:
    """``k`` (an integer-valued float such as 16.0 becomes the count 16), ``seed`` and ``pool``, or ValueError."""
    if isinstance(k, float) and k.is_integer() and k >= 1:
        k = int(k)
    if isinstance(k, bool) or not (isinstance(k, int) and k >= 1 or isinstance(k, float) and 0 < k < 1):
        raise ValueError(f"tokentune: k must be an integer >= 1 (tokens per sequence that get gradients) or a "
                         f"fraction 0 < k < 1 of the real tokens (e.g. 0.3), got {k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"tokentune: seed must be None (global RNG) or an int, got {seed!r}")
    if pool not in POOLS:
        raise ValueError(f"tokentune: pool must be 'model' (the head reads what the model's own head reads, of the "
                         f"selected tokens) or 'mean' (the mean of the selected tokens), got {pool!r}")
    return k, seed, pool


@register("tokentune", "selective-token fine-tuning: gradients through k tokens per sequence (TokenTune)",
          options={"k": 16, "seed": None, "pool": "model"}, order=40, kinds={"k": (int, float)},
          check=checked_options)
def apply_tokentune(model: nn.Module, k: int | float = 16, seed: int | None = None, pool: str = "model") -> nn.Module:
    k, seed, pool = checked_options(k, seed, pool)
    from lowmembp.models import get_layout
    layout = get_layout(model)
    driver = layout.tokentune
    if driver not in FAMILIES:
        raise TypeError(f"tokentune supports the families {', '.join(FAMILIES)} (timm ViT, BERT/RoBERTa sequence "
                        f"classification, LLaMA-like); it cannot run {type(layout.base).__name__}: "
                        f"{layout.tokentune_why or 'its adapter names no TokenTune driver'}")
    base, fam = layout.base, FAMILIES[driver]
    blocks = [s.get() for s in layout.blocks]
    for b in blocks:
        fam.check_block(b)
    if getattr(base, "_tokentune", None) is not None:
        raise RuntimeError("tokentune was already applied to this model")
    state = TokenTuneState(k=k, family=driver, task="classification", seed=seed, pool=pool,
                           reads=layout.head_reads, lead=layout.head_lead, blocks=blocks, sites=list(layout.blocks))
    if isinstance(k, int) and k < state.min_count():
        raise ValueError(f"tokentune: k={k} is less than the {state.min_count()} tokens the head of "
                         f"{type(base).__name__} needs: its {state.lead} leading class / register tokens (read or "
                         f"set apart by position){' and one token to pool' if state.reads == 'pool' else ''}; use "
                         f"k >= {state.min_count()}, or pool='mean'")
    name = type(base).__name__
    if driver == "vit":
        if not all(hasattr(base, a) for a in ("patch_embed", "_pos_embed", "norm_pre", "norm", "forward_features")):
            raise TypeError(f"tokentune: {name} is not a timm VisionTransformer")
        state.owner = base
        _patch(base, "forward_features", _vit_forward_features, state)
    elif driver == "bert":
        backbone = getattr(base, "base_model", None)
        if not name.endswith("ForSequenceClassification") or backbone is None or backbone is base:
            raise TypeError(f"tokentune supports BERT/RoBERTa sequence classification models "
                            f"(BertForSequenceClassification, RobertaForSequenceClassification); got {name}")
        state.owner = backbone
        _patch(backbone, "forward", _bert_forward, state)
    else:  # llama
        if name.endswith("ForCausalLM"):
            state.task = "causal_lm"
            if pool != "model":
                raise ValueError(f"tokentune: pool={pool!r} is for classification heads; {name}'s logits are per "
                                 f"position (leave pool at 'model')")
        elif not name.endswith("ForSequenceClassification"):
            raise TypeError(f"tokentune supports LLaMA-like *ForCausalLM and *ForSequenceClassification; got {name}")
        state.owner = base.model
        _patch(base, "forward", _llama_forward, state)
    object.__setattr__(base, "_tokentune", state)
    return model


def _patch(module: nn.Module, attr: str, fn, state: TokenTuneState) -> None:
    """Install the training forward as an instance-level ``module.<attr>``; eval mode calls the original.

    Nothing is captured in closures: the state, the training function and any earlier instance-level override live
    in the module's ``__dict__``, so ``copy.deepcopy`` of a converted model yields a model that runs on its own
    blocks and parameters.
    """
    d = module.__dict__
    d["_tokentune"] = state
    d["_tokentune_attr"] = attr
    d["_tokentune_fn"] = fn
    d["_tokentune_original"] = d.get(attr)  # an instance-level override another method installed, if any
    d[attr] = _Entry(module)


class _Entry:
    """The instance-level forward: a picklable callable (``torch.save(model)`` works; a bound method would not)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return _entry(self.module, *args, **kwargs)

    @property
    def __signature__(self):  # what inspect.signature (the HF Trainer) reads: the replaced forward's parameters
        from lowmembp.methods._signature import original_signature
        d = self.module.__dict__
        return original_signature(self.module, d["_tokentune_attr"], d["_tokentune_original"])


def _entry(self, *args, **kwargs):
    d = self.__dict__
    if not self.training:
        original = d["_tokentune_original"]
        if original is not None:
            return original(*args, **kwargs)
        return getattr(type(self), d["_tokentune_attr"])(self, *args, **kwargs)
    return d["_tokentune_fn"](self, d["_tokentune"], *args, **kwargs)


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


def _masked_mean(hs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over the valid selected rows (branch-free: runs on fake tensors too)."""
    w = valid.to(hs.dtype).unsqueeze(-1)
    return (hs * w).sum(1) / w.sum(1).clamp_min(1)


def _read_positions(state: TokenTuneState, model: nn.Module, input_ids, B: int, L: int, device) -> torch.Tensor:
    """B: the position the model's own head reads in each sequence (the layout's ``head_reads``)."""
    if state.reads == "first":
        return torch.zeros(B, dtype=torch.long, device=device)
    if state.reads == "last":
        from lowmembp.models.hf_models import last_token_positions
        return last_token_positions(model.config, input_ids, B, L, device)
    raise TypeError(f"tokentune: the adapter of {type(model).__name__} says its head reads {state.reads!r}, not one "
                    f"token ('first' / 'last'); convert with pool='mean' or add the rule to its adapter")


def _forced(state: TokenTuneState, read: torch.Tensor | None) -> torch.Tensor | None:
    """The positions the selection must take for the head (none under ``pool='mean'``)."""
    return read[:, None] if state.pool == "model" and read is not None else None


def _head_feature(state: TokenTuneState, hs: torch.Tensor, sel: Selection, read: torch.Tensor) -> torch.Tensor:
    """B×d, what the head reads from the selected rows ``hs`` (B×k×d, positions ``sel.positions``): the row at the
    model's own read position ``read`` (selected: forced), or under ``pool='mean'`` the mean of the valid rows."""
    if state.pool == "mean":
        return _masked_mean(hs, sel.valid)
    j = (sel.positions == read[:, None]).to(torch.uint8).argmax(1)
    return take(hs, j[:, None])[:, 0]


def _embed_rows(emb: torch.Tensor, sel: Selection) -> torch.Tensor:
    """Hidden state 0 from embeddings computed on all rows: the graph kept only on the selected rows."""
    if not emb.requires_grad:
        return emb
    idx = sel.positions[..., None].expand(-1, -1, emb.shape[-1])
    return emb.detach().scatter(1, idx, take(emb, sel.positions))


# --------------------------------------------------------------------------------------------------- family forwards
def _vit_forward_features(self, state, x, attn_mask=None, is_causal=False):
    if attn_mask is not None or is_causal:
        raise TypeError("tokentune training forward does not take attn_mask / is_causal for timm ViT")
    emb = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
    B, L, d = emb.shape
    lead = min(state.lead, L) if state.pool == "model" else 0
    forced = torch.arange(lead, device=emb.device).expand(B, lead) if lead else None
    sel = state.select(torch.ones(B, L, dtype=torch.bool, device=emb.device), decoder=False, forced=forced)
    fam = FAMILIES["vit"]
    ctx = make_context(fam, sel, L, None)
    h = run_blocks(fam, state.blocks, _embed_rows(emb, sel), ctx, state.checkpoint_flags())
    hs = self.norm(take(h, sel.positions))
    if state.pool == "mean":
        pooled = _masked_mean(hs, sel.valid)
        return pooled[:, None, :].expand(B, L, d)
    return hs  # B×k×d, ascending, the `lead` class/register rows first: forward_head pools them as it pools all


def _bert_forward(self, state, input_ids=None, attention_mask=None, token_type_ids=None,
                  position_ids=None, inputs_embeds=None, **kwargs):
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
    _reject(kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    ref = input_ids if input_ids is not None else inputs_embeds
    B, L = ref.shape[:2]
    device = ref.device
    valid = _valid_tokens(attention_mask, B, L, device)
    read = _read_positions(state, self, input_ids, B, L, device) if state.pool == "model" else None
    sel = state.select(valid, decoder=False, forced=_forced(state, read))
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
    fam = FAMILIES["bert"]
    ctx = make_context(fam, sel, L, valid if attention_mask is not None else None)
    h = run_blocks(fam, state.blocks, h, ctx, state.checkpoint_flags())
    feature = _head_feature(state, take(h, sel.positions), sel, read)
    last = feature[:, None, :].expand(B, L, feature.shape[-1])  # the pooler / head reads token 0: this row
    pooler = getattr(self, "pooler", None)
    return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=last,
                                                        pooler_output=pooler(last) if pooler is not None else None)


def _llama_forward(self, state, input_ids=None, attention_mask=None, position_ids=None,
                   inputs_embeds=None, labels=None, **kwargs):
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
    if state.task != "causal_lm" and state.pool == "model":
        read = _read_positions(state, self, input_ids, B, L, emb.device)
    sel = state.select(valid, decoder=True, forced=_forced(state, read))
    if position_ids is None:
        position_ids = torch.arange(L, device=emb.device)[None]
    cos, sin = backbone.rotary_emb(emb, position_ids=position_ids.to(emb.device))
    fam = FAMILIES["llama"]
    ctx = make_context(fam, sel, L, valid if attention_mask is not None else None,
                       extra={"cos": cos.expand(B, L, -1), "sin": sin.expand(B, L, -1)})
    h = run_blocks(fam, state.blocks, _embed_rows(emb, sel), ctx, state.checkpoint_flags())
    hs = backbone.norm(take(h, sel.positions))
    loss = None
    if state.task == "causal_lm":
        logits = self.lm_head(hs)
        if labels is not None:
            nxt = F.pad(labels.to(logits.device)[:, 1:], (0, 1), value=-100)  # target of position p: labels[p+1]
            targets = take(nxt, sel.positions).masked_fill(~sel.valid, -100)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
    else:
        logits = self.score(_head_feature(state, hs, sel, read))
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        out = SequenceClassifierOutputWithPast(loss=loss, logits=logits)
    return out.to_tuple() if return_dict is False else out

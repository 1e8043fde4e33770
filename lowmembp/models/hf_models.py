"""Adapters for transformers models: BERT / RoBERTa (post-norm encoders) and LLaMA-like decoders (pre-RMSNorm).

Recognised by structure, on the backbone (``model.base_model``), so task models (``*ForSequenceClassification``,
``*ForCausalLM``, ``*ForMaskedLM``, ...) and bare backbones are handled alike:

- BERT-like: ``embeddings.LayerNorm`` and ``encoder.layer[i]`` with ``attention.self.{query,key,value}``,
  ``attention.output.{dense,LayerNorm}``, ``intermediate.{dense,intermediate_act_fn}``, ``output.{dense,LayerNorm}``
  (BERT, RoBERTa and their copies). Cross-attention layers are refused.
- LLaMA-like: ``embed_tokens``, ``layers[i]`` with exactly two RMSNorms ``input_layernorm`` /
  ``post_attention_layernorm``, ``self_attn.{q,k,v}_proj`` (or fused ``qkv_proj``), ``mlp.{gate,up}_proj`` (or fused
  ``gate_up_proj``) + ``down_proj`` + ``act_fn``, and a final ``norm`` (LLaMA, Mistral, Qwen2, Qwen3, ...). Layers with
  extra norms (Gemma 2/3) or a different RMSNorm form (Gemma's ``1 + γ``) are refused.

BERT's last output LayerNorm produces the last hidden state, which is both the model's output and the input of
whatever head follows, so it is reported as ``final_norm`` with ``foldable=False``: a conversion keeps it exact.
"""
from __future__ import annotations

import torch.nn as nn

from lowmembp.models.detect import act_kind, is_linear_like, norm_kind
from lowmembp.models.layout import (BUILTIN_PRIORITY, ActSite, ModelLayout, NormSite, UnsupportedModelError,
                                    register_adapter, site)


def _backbone(base: nn.Module) -> tuple[nn.Module, str]:
    inner = getattr(base, "base_model", base)
    if not isinstance(inner, nn.Module):
        inner = base
    if inner is base:
        return base, ""
    for name, child in base.named_children():
        if child is inner:
            return inner, name
    return inner, getattr(base, "base_model_prefix", "")


def _p(*parts) -> str:
    return ".".join(str(x) for x in parts if x != "")


def _linears(owner, names, prefix):
    if all(is_linear_like(getattr(owner, n, None) or nn.Identity()) for n in names):
        return [site(owner, n, prefix) for n in names]
    return None


def _heads(base: nn.Module, inner_prefix: str, inner: nn.Module) -> list:
    """Linear-like task-head layers on the task model (and BERT's pooler)."""
    out = []
    pooler = getattr(inner, "pooler", None)
    if pooler is not None and is_linear_like(getattr(pooler, "dense", None) or nn.Identity()):
        out.append(site(pooler, "dense", _p(inner_prefix, "pooler")))
    if base is inner:
        return out
    for name in ("lm_head", "score", "classifier", "qa_outputs"):
        m = getattr(base, name, None)
        if not isinstance(m, nn.Module):
            continue
        if is_linear_like(m):
            out.append(site(base, name, ""))
        elif is_linear_like(getattr(m, "dense", None) or nn.Identity()):  # RobertaClassificationHead, lm_head.dense
            out.append(site(m, "dense", name))
    pred = getattr(getattr(getattr(base, "cls", None), "predictions", None), "transform", None)
    if pred is not None and is_linear_like(getattr(pred, "dense", None) or nn.Identity()):
        out.append(site(pred, "dense", "cls.predictions.transform"))
    return out


@register_adapter("bert", BUILTIN_PRIORITY)
def detect_bert(model: nn.Module, base: nn.Module) -> ModelLayout | None:
    inner, ip = _backbone(base)
    layers = getattr(getattr(inner, "encoder", None), "layer", None)
    emb = getattr(inner, "embeddings", None)
    if not isinstance(layers, nn.ModuleList) or emb is None or not hasattr(emb, "LayerNorm"):
        return None
    if not all(hasattr(l, "attention") and hasattr(l, "intermediate") and hasattr(l, "output") for l in layers):
        return None
    if any(getattr(l, "crossattention", None) is not None for l in layers):
        raise UnsupportedModelError("BERT-like decoder with cross-attention is not supported")
    if not norm_kind(emb.LayerNorm):
        raise UnsupportedModelError(f"embeddings.LayerNorm is {type(emb.LayerNorm).__name__}")
    bl, at, norms, acts = [], [], [], []
    prev = site(emb, "LayerNorm", _p(ip, "embeddings"), NormSite, kind=norm_kind(emb.LayerNorm), post_norm=True)
    proj = getattr(inner, "embeddings_project", None)
    if proj is not None:  # ELECTRA: embedding LayerNorm (embedding width) -> dropout -> embeddings_project
        if not is_linear_like(proj):
            raise UnsupportedModelError(f"embeddings_project is {type(proj).__name__}, not a linear")
        prev.post_norm, prev.consumers = False, [site(inner, "embeddings_project", ip)]
        norms.append(prev)
        prev = None
    for i, layer in enumerate(layers):
        p = _p(ip, "encoder.layer", i)
        sa, so, it, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
        qkv = _linears(sa, ("query", "key", "value"), f"{p}.attention.self")
        if qkv is None or not _linears(so, ("dense",), "") or not _linears(it, ("dense",), "") \
                or not _linears(out, ("dense",), "") or not norm_kind(getattr(so, "LayerNorm", nn.Identity())) \
                or not norm_kind(getattr(out, "LayerNorm", nn.Identity())):
            raise UnsupportedModelError(f"{p}: not the BERT layer layout (query/key/value, attention.output."
                                        f"{{dense,LayerNorm}}, intermediate.dense, output.{{dense,LayerNorm}})")
        bl.append(site(layers, str(i), _p(ip, "encoder.layer")))
        at.append(site(layer.attention, "self", f"{p}.attention"))
        if prev is not None:
            prev.consumers = qkv
            prev.residual_consumers = [site(layer.attention, "output", f"{p}.attention")]
            norms.append(prev)
        norms.append(site(so, "LayerNorm", f"{p}.attention.output", NormSite, kind=norm_kind(so.LayerNorm),
                          post_norm=True, consumers=[site(it, "dense", f"{p}.intermediate")],
                          residual_consumers=[site(layer, "output", p)]))
        kind = act_kind(getattr(it, "intermediate_act_fn", nn.Identity()))
        if kind:
            acts.append(site(it, "intermediate_act_fn", f"{p}.intermediate", ActSite, kind=kind))
        prev = site(out, "LayerNorm", f"{p}.output", NormSite, kind=norm_kind(out.LayerNorm), post_norm=True)
    head = _heads(base, ip, inner)
    prev.consumers = head
    prev.foldable = False
    prev.why = "post-norm: the last hidden state is the model's output and the head's input; kept exact"
    tt = type(base).__name__.endswith("ForSequenceClassification") and base is not inner and proj is None
    why = "" if tt else (
        "ELECTRA's embedding projection (embeddings_project) is not part of TokenTune's BERT driver" if proj is not None
        else f"tokentune supports BERT/RoBERTa sequence classification models (BertForSequenceClassification, "
             f"RobertaForSequenceClassification); got {type(base).__name__}")
    reads = "first" if type(base).__name__.endswith("ForSequenceClassification") and base is not inner else None
    return ModelLayout("bert", model, base, bl, at, norms, acts, prev, head, attention_style="hf",
                       checkpoint_switch=_hf_switch(base), tokentune="bert" if tt else None, tokentune_why=why,
                       head_reads=reads, head_lead=1 if reads else 0)  # pooler / classification head: token 0


def _hf_switch(base: nn.Module) -> str | None:
    return "transformers" if getattr(base, "supports_gradient_checkpointing", False) else None


# model types whose decoder forward is exactly LLaMA's (embedding, full RoPE, blocks, norm): TokenTune's llama driver
_TOKENTUNE_LLAMA = ("llama", "mistral", "qwen2", "qwen3")


@register_adapter("llama", BUILTIN_PRIORITY)
def detect_llama(model: nn.Module, base: nn.Module) -> ModelLayout | None:
    inner, ip = _backbone(base)
    layers = getattr(inner, "layers", None)
    if not (isinstance(layers, nn.ModuleList) and hasattr(inner, "embed_tokens") and len(layers)
            and all(hasattr(l, "self_attn") and hasattr(l, "mlp") and hasattr(l, "input_layernorm") for l in layers)):
        return None
    bl, at, norms, acts = [], [], [], []
    for i, layer in enumerate(layers):
        p = _p(ip, "layers", i)
        n_norms = [n for n, c in layer.named_children() if norm_kind(c)]
        if sorted(n_norms) != ["input_layernorm", "post_attention_layernorm"]:
            raise UnsupportedModelError(
                f"{p} ({type(layer).__name__}) has norms {n_norms}; a LLaMA-like layer has exactly the norms "
                f"input_layernorm and post_attention_layernorm (pre-norm; other layouts go through data flow)")
        attn, mlp = layer.self_attn, layer.mlp
        act_attr = "act_fn" if hasattr(mlp, "act_fn") else "activation_fn"  # Phi-3: activation_fn
        qkv = _linears(attn, ("q_proj", "k_proj", "v_proj"), f"{p}.self_attn") \
            or _linears(attn, ("qkv_proj",), f"{p}.self_attn")
        gu = _linears(mlp, ("gate_proj", "up_proj"), f"{p}.mlp") or _linears(mlp, ("gate_up_proj",), f"{p}.mlp")
        if qkv is None or gu is None or not hasattr(mlp, act_attr) or not _linears(mlp, ("down_proj",), ""):
            raise UnsupportedModelError(f"{p}: expected self_attn.{{q,k,v}}_proj (or qkv_proj) and "
                                        f"mlp.{{gate,up}}_proj (or gate_up_proj) + down_proj linears and mlp.act_fn")
        bl.append(site(layers, str(i), _p(ip, "layers")))
        at.append(site(layer, "self_attn", p))
        norms.append(site(layer, "input_layernorm", p, NormSite, consumers=qkv))
        norms.append(site(layer, "post_attention_layernorm", p, NormSite, consumers=gu))
        kind = act_kind(getattr(mlp, act_attr))
        if kind:
            acts.append(site(mlp, act_attr, f"{p}.mlp", ActSite, kind=kind))
    head = _heads(base, ip, inner)
    final = None
    if norm_kind(getattr(inner, "norm", nn.Identity())):
        final = site(inner, "norm", ip, NormSite, kind=norm_kind(inner.norm), consumers=head)
        if not head:
            final.foldable, final.why = False, "bare backbone: the last hidden state is the output"
    cfg = getattr(base, "config", None)
    mtype = getattr(cfg, "model_type", "")
    task_ok = type(base).__name__.endswith(("ForCausalLM", "ForSequenceClassification")) and base is not inner
    tt = mtype in _TOKENTUNE_LLAMA and task_ok
    why = "" if tt else (f"tokentune's decoder forward is LLaMA's (embedding, full RoPE, q/k/v/o); model type "
                         f"{mtype!r} is not one of {', '.join(_TOKENTUNE_LLAMA)}" if task_ok else
                         f"tokentune supports LLaMA-like *ForCausalLM and *ForSequenceClassification; got "
                         f"{type(base).__name__}")
    reads = None if base is inner else "each" if type(base).__name__.endswith("ForCausalLM") else \
        "last" if type(base).__name__.endswith("ForSequenceClassification") else None
    return ModelLayout("llama", model, base, bl, at, norms, acts, final, head, attention_style="hf",
                       checkpoint_switch=_hf_switch(base), tokentune="llama" if tt else None, tokentune_why=why,
                       head_reads=reads)


def last_token_positions(config, input_ids, batch: int, length: int, device):
    """The position transformers' decoder ``*ForSequenceClassification`` head reads, per sequence (its rule, in
    ``GenericForSequenceClassification.forward``): the rightmost token of ``input_ids`` that is not
    ``config.pad_token_id`` (left or right padding alike); the last position when only ``inputs_embeds`` are given
    or the config has no pad token (then only one sequence: transformers refuses a batch, and so does this)."""
    import torch
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    if pad is None and batch != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined (set config.pad_token_id, "
                         "as transformers' *ForSequenceClassification needs it to find each sequence's last token)")
    if pad is None or input_ids is None:
        return torch.full((batch,), length - 1, dtype=torch.long, device=device)
    non_pad = (input_ids.to(device) != pad).to(torch.int32)
    return (torch.arange(length, device=device, dtype=torch.int32) * non_pad).argmax(-1).long()

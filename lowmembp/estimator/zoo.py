"""The paper-model zoo: the models the estimator, the planner and the synthetic task build (:data:`MODELS`), how
to build one on any device (:func:`build`), where its blocks are (:func:`block_names`), and a random batch and the
loss of one training step (:func:`make_batch`, :func:`compute_loss`).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "ModelSpec", "model_spec", "paper_model_name", "build", "block_names", "make_batch",
           "compute_loss", "image_tokens"]


@dataclass(frozen=True)
class ModelSpec:
    """A paper model: how to build it and its paper setting (batch size, sequence length, dtype)."""
    family: str                 # "timm" | "bert" | "roberta" | "llama"
    arch: str                   # timm name, or a key of _HF_CONFIGS
    batch_size: int
    seq_len: int | None = None  # tokens (HF); timm: from the image size
    dtype: str = "bf16"
    num_classes: int = 100
    kwargs: dict = field(default_factory=dict)


MODELS: dict[str, ModelSpec] = {
    "vit-b16": ModelSpec("timm", "vit_base_patch16_224", 64, dtype="fp16"),
    "vit-l16": ModelSpec("timm", "vit_large_patch16_224", 64, dtype="fp16"),
    "swin-t": ModelSpec("timm", "swin_tiny_patch4_window7_224", 128, dtype="fp16", num_classes=1000),
    "deit-ti": ModelSpec("timm", "deit_tiny_patch16_224", 128, dtype="fp16", num_classes=1000),
    "deit-s": ModelSpec("timm", "deit_small_patch16_224", 128, dtype="fp16", num_classes=1000),
    "deit-b": ModelSpec("timm", "deit_base_patch16_224", 128, dtype="fp16", num_classes=1000),
    "bert-large": ModelSpec("bert", "bert-large", 32, seq_len=128, dtype="fp32", num_classes=2),
    "roberta-base": ModelSpec("roberta", "roberta-base", 32, seq_len=256, dtype="fp32", num_classes=2),
    "llama-7b": ModelSpec("llama", "llama-7b", 4, seq_len=512, dtype="bf16"),
    "llama-13b": ModelSpec("llama", "llama-13b", 4, seq_len=512, dtype="bf16"),
}

# The paper models' names of the 0.1 releases, with underscores; accepted for one more release with a
# DeprecationWarning (:func:`model_spec`). The names are those of the tasks and the training job: ``vit-b16``.
_OLD_NAMES = {name.replace("-", "_"): name for name in MODELS if "-" in name}


def paper_model_name(name: str) -> str | None:
    """``name`` as a key of :data:`MODELS` (an old underscore spelling warns and maps), or None if it names none."""
    if name in MODELS:
        return name
    if name in _OLD_NAMES:
        warnings.warn(f"the paper model {name!r} is now spelled {_OLD_NAMES[name]!r} (as in the tasks and the "
                      "training job); the old spelling goes in the next release", DeprecationWarning, stacklevel=3)
        return _OLD_NAMES[name]
    return None


def model_spec(model: str | ModelSpec) -> ModelSpec:
    """The :class:`ModelSpec` of a paper model's name (a key of :data:`MODELS`), or ``model`` itself if it is one."""
    if not isinstance(model, str):
        return model
    name = paper_model_name(model)
    if name is None:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


_HF_CONFIGS = {
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                       vocab_size=30522, max_position_embeddings=512),
    "roberta-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         vocab_size=50265, max_position_embeddings=514, pad_token_id=1),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                     num_hidden_layers=32, vocab_size=32000, max_position_embeddings=2048),
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40,
                      num_hidden_layers=40, vocab_size=32000, max_position_embeddings=2048),
}


def build(spec: ModelSpec, *, layers: int | None = None, overrides: dict | None = None,
          device: str = "meta", attention: str = "sdpa") -> nn.Module:
    """The model of ``spec`` on ``device`` (meta: no memory; ``layers``: keep only that many blocks; ``overrides``:
    config changes, e.g. a smaller width for tests; ``attention``: ``"sdpa"`` (fused: flash on CPU) or ``"eager"``
    (softmax and matmuls, as timm / transformers did before fused attention))."""
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    model = _build(spec, layers, dict(overrides or {}), device, attention)
    if spec.family == "timm":
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = attention == "sdpa"
    return model


def _build(spec, layers, overrides, device, attention):
    with torch.device(device):
        if spec.family == "timm":
            import timm
            kw = dict(spec.kwargs, **overrides)
            if layers is not None:
                if "swin" in spec.arch:
                    raise ValueError("layers=: Swin's depth is per stage; pass overrides={'depths': (...)} instead")
                kw["depth"] = layers
            try:
                return timm.create_model(spec.arch, pretrained=False, num_classes=spec.num_classes, **kw)
            except RuntimeError as e:  # timm releases whose __init__ reads a value (drop-path rates by .item())
                if device != "meta" or "meta" not in str(e):
                    raise
            with torch.device("cpu"):  # built for real, then moved: the same shapes, more time and memory
                return timm.create_model(spec.arch, pretrained=False, num_classes=spec.num_classes, **kw).to("meta")
        if spec.family == "hf":
            from lowmembp.estimator.hf_config import build_from_config
            return build_from_config(spec.arch, layers=layers, overrides=overrides, attention=attention,
                                     num_labels=spec.num_classes)
        cfg = dict(_HF_CONFIGS[spec.arch], **overrides)
        if layers is not None:
            cfg["num_hidden_layers"] = layers
        if spec.family == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM
            return LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=attention))
        if spec.family == "bert":
            from transformers import BertConfig, BertForSequenceClassification
            return BertForSequenceClassification(BertConfig(**cfg, num_labels=spec.num_classes,
                                                            attn_implementation=attention))
        if spec.family == "roberta":
            from transformers import RobertaConfig, RobertaForSequenceClassification
            return RobertaForSequenceClassification(RobertaConfig(**cfg, num_labels=spec.num_classes,
                                                                  attn_implementation=attention))
    raise ValueError(f"unknown model family {spec.family!r}")


def block_names(model: nn.Module) -> list[str]:
    """Qualified names of the transformer blocks, in order (timm Block / SwinTransformerBlock, HF *Layer)."""
    out = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if re.search(r"(^|\.)(blocks|layers|layer)\.\d+$", name) and re.search(r"(Block|Layer)$", cls) \
                and "Stage" not in cls:
            out.append(name)
    return out


def image_tokens(model: nn.Module) -> int | None:
    """The tokens a timm ViT's blocks see (patches and prefix tokens; None where the model has no patch embedding)."""
    base = getattr(model, "base_model", None)
    base = getattr(base, "model", model)
    pe = getattr(base, "patch_embed", None)
    n = getattr(pe, "num_patches", None)
    if n is None:
        return None
    return n + getattr(base, "num_prefix_tokens", 0)


def make_batch(spec: ModelSpec, model: nn.Module, bs: int, L: int | None, vocab: int | None = None) -> dict:
    """A random batch of ``bs`` samples for ``model`` (``L`` tokens each for text models; ``vocab``: the token range
    when the config was overridden): images and labels, or token ids with labels (causal LMs: the ids)."""
    if spec.family == "timm":
        base = getattr(getattr(model, "base_model", None), "model", model)
        size = getattr(base, "default_cfg", {}).get("input_size", (3, 224, 224))
        img = getattr(getattr(base, "patch_embed", None), "img_size", None)
        hw = tuple(img) if img is not None else tuple(size[1:])
        return {"x": torch.randn(bs, 3, *hw), "y": torch.randint(0, spec.num_classes, (bs,))}
    if spec.family == "hf":
        from lowmembp.estimator.hf_config import CAUSAL_LM, vocab_size
        vocab, causal = vocab or vocab_size(model), spec.kwargs.get("head") == CAUSAL_LM
    else:
        vocab, causal = vocab or _HF_CONFIGS[spec.arch]["vocab_size"], spec.family == "llama"
    ids = torch.randint(3, vocab, (bs, L))
    if causal:
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids, "attention_mask": torch.ones(bs, L, dtype=torch.long),
            "labels": torch.randint(0, spec.num_classes, (bs,))}


def compute_loss(spec: ModelSpec, model: nn.Module, batch: dict) -> torch.Tensor:
    """The training loss of ``model`` on ``batch`` (made by :func:`make_batch`): cross-entropy of the logits for timm
    models, the transformers model's own loss otherwise."""
    if spec.family == "timm":
        return F.cross_entropy(model(batch["x"]), batch["y"])
    return model(**batch).loss

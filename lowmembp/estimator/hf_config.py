"""A transformers model from a ``config.json`` on disk (no hub): the config, the head it trains, the model.

    spec = hf_spec("path/to/config.json", seq_len=2048)     # a lowmembp.estimator.zoo.ModelSpec (family "hf")
    estimate(spec, "lora", batch_size=4)                    # built on the meta device like the paper models

The head: the config's ``architectures`` decide (``...ForCausalLM`` / ``...LMHeadModel``: causal language modelling
on the input tokens; ``...ForSequenceClassification``: a sequence classifier); without ``architectures``, a model
type transformers can build as a causal LM but not as a masked LM is a causal LM, anything else a classifier.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn

__all__ = ["load_config", "head_of", "build_from_config", "hf_spec", "CAUSAL_LM", "CLASSIFIER"]

CAUSAL_LM = "causal-lm"
CLASSIFIER = "classification"
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def _config_file(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no transformers config.json there; pass the file or the folder holding it")
    return p


def _read(path: str | Path) -> dict:
    p = _config_file(path)
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ValueError(f"{p}: a transformers config.json names its 'model_type' (e.g. \"llama\"); this one does not")
    return d


def load_config(path: str | Path, overrides: dict | None = None, **extra):
    """The transformers config of ``path`` (a config.json or its folder) with ``overrides`` applied; no download."""
    from transformers import AutoConfig

    d = _read(path)
    d.update(overrides or {})
    d.update(extra)
    model_type = d.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as e:
        raise ValueError(f"{path}: transformers does not know model_type {model_type!r} ({e})") from None


def head_of(path: str | Path) -> str:
    """``"causal-lm"`` or ``"classification"``: what a training step of this config trains (see the module doc)."""
    d = _read(path)
    archs = d.get("architectures") or []
    if any(a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        return CAUSAL_LM
    if archs:
        return CLASSIFIER
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    mt = d["model_type"]
    causal = mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return CAUSAL_LM if causal else CLASSIFIER


def build_from_config(path: str | Path, *, layers: int | None = None, overrides: dict | None = None,
                      attention: str = "sdpa", num_labels: int = 2) -> nn.Module:
    """The model of ``path`` on the current default device (``with torch.device("meta")``: no memory)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    extra = {"attn_implementation": attention}
    if layers is not None:
        extra["num_hidden_layers"] = layers
    if head_of(path) == CAUSAL_LM:
        return AutoModelForCausalLM.from_config(load_config(path, overrides, **extra))
    return AutoModelForSequenceClassification.from_config(load_config(path, overrides, num_labels=num_labels,
                                                                      **extra))


def hf_spec(path: str | Path, *, seq_len: int | None = None, batch_size: int = 1, dtype: str = "bf16",
            num_classes: int = 2):
    """A :class:`lowmembp.estimator.zoo.ModelSpec` for the config at ``path`` (``seq_len``: default the config's
    ``max_position_embeddings``, capped at 2048)."""
    from lowmembp.estimator.zoo import ModelSpec

    p = _config_file(path).resolve()
    if seq_len is None:
        seq_len = min(int(_read(p).get("max_position_embeddings") or 512), 2048)
    return ModelSpec("hf", str(p), batch_size, seq_len=seq_len, dtype=dtype, num_classes=num_classes,
                     kwargs={"head": head_of(p)})


def vocab_size(model: nn.Module) -> int:
    """The vocabulary size of a (possibly peft-wrapped) transformers model."""
    return int(model.config.vocab_size)

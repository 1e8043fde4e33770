"""What ``--model`` names: a paper model (:data:`lowmembp.estimator.step.MODELS`), a timm model name, or a transformers
``config.json`` on disk (file or folder; no hub). Every one is built on the meta device by
:mod:`lowmembp.estimator.step`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lowmembp.estimator.step import MODELS, ModelSpec, paper_model_name

__all__ = ["resolve_model"]


def resolve_model(model: str | ModelSpec, *, seq_len: int | None = None, num_classes: int | None = None,
                  image_size: int | None = None) -> tuple[ModelSpec, str]:
    """``(spec, where)``: the :class:`ModelSpec` that ``model`` names and a few words on where it came from.
    ``seq_len``, ``num_classes``, ``image_size``: None (the model's own) or a positive integer; anything else is a
    ValueError, never a silent fallback to the default."""
    for what, flag, value in (("seq_len", "--seq-len", seq_len), ("num_classes", None, num_classes),
                              ("image_size", "--image-size", image_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{what} must be a positive integer{f' ({flag})' if flag else ''}, got {value!r}; "
                             "leave it out for the model's own")
    if isinstance(model, ModelSpec):
        spec, where = model, f"the given ModelSpec ({model.family} {model.arch})"
    elif (name := paper_model_name(model)) is not None:
        spec, where = MODELS[name], f"paper model {name} ({MODELS[name].arch})"
    elif Path(model).exists():
        from lowmembp.estimator.hf_config import hf_spec
        spec = hf_spec(model, seq_len=seq_len)
        where = f"transformers config {spec.arch} ({spec.kwargs['head']})"
    elif _is_timm(model):
        spec, where = ModelSpec("timm", model, 1, dtype="bf16", num_classes=1000), f"timm model {model}"
    else:
        raise ValueError(f"unknown model {model!r}: pass a paper model ({', '.join(MODELS)}), a timm model name "
                         "(timm.list_models()), or the path of a transformers config.json (or its folder)")
    if spec.family == "timm":
        if seq_len is not None:
            raise ValueError(f"{model!r} is an image model: its tokens come from the image size; pass "
                             "--image-size instead of --seq-len")
        kwargs = dict(spec.kwargs, **({"img_size": image_size} if image_size else {}))
        spec = replace(spec, kwargs=kwargs, num_classes=num_classes or spec.num_classes)
    else:
        if image_size is not None:
            raise ValueError(f"{model!r} is a text model: pass --seq-len, not --image-size")
        spec = replace(spec, seq_len=seq_len or spec.seq_len, num_classes=num_classes or spec.num_classes)
    return spec, where


def _is_timm(name: str) -> bool:
    import timm
    return bool(timm.is_model(name))

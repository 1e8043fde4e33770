"""Tasks the training job knows: name -> module (see :mod:`experiments.tasks.base` for what a module defines).

Offline (data and weights ship in pip packages, run anywhere): ``tweets-sentiment`` (minilm-l6), ``mnist5k``
(vit-mnist), ``tweets-lm`` (llama-tiny). Paper tasks (need downloaded data and weights, see ``--data-dir``):
``cifar10`` / ``cifar100`` (vit-b16, vit-l16, swin-t), ``glue-<task>`` (roberta-base, bert-large), ``alpaca``
(llama-7b, llama-13b).
"""
from __future__ import annotations

import importlib

_MODULES = {
    "tweets-sentiment": "tweets_sentiment",
    "mnist5k": "mnist5k",
    "tweets-lm": "tweets_lm",
    "cifar10": "cifar",
    "cifar100": "cifar",
    "alpaca": "alpaca",
}
GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte")
_MODULES.update({f"glue-{t}": "glue" for t in GLUE_TASKS})


def names() -> list[str]:
    return list(_MODULES)


def get(name: str):
    """The task module for ``name``; ValueError listing the valid names otherwise."""
    if name not in _MODULES:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(names())}")
    module = importlib.import_module(f"experiments.tasks.{_MODULES[name]}")
    if hasattr(module, "for_task"):  # one module serving several tasks (cifar10/100, glue-*)
        module = module.for_task(name)
    return module


def all_models() -> dict[str, list[str]]:
    """model name -> the tasks it can train."""
    out: dict[str, list[str]] = {}
    for name in names():
        for model in get(name).MODELS:
            out.setdefault(model, []).append(name)
    return out

"""What a task hands the training job: the model, the data, how to compute the loss, how to evaluate.

A task module (one per task under ``experiments/tasks/``) defines ``NAME``, ``MODELS`` (the models it can train,
the first one the default), ``METRIC``, ``DEFAULTS`` (hyper-parameters used when the command line gives none),
``check(cfg)`` (raises :class:`MissingData` at once when data or weights are absent) and ``build(model_name, cfg)
-> Setup``. ``cfg`` is the parsed configuration (an ``argparse.Namespace``). Optionally ``METHOD_DEFAULTS``:
method name -> hyper-parameters that replace ``DEFAULTS`` when the method spec contains that method (e.g. the
larger learning rate LoRA needs); :func:`defaults_for` is the one place the two are merged.

Splits: the test split of every offline task is fixed (drawn with :data:`SPLIT_SEED`, whatever ``--seed`` is), so
runs with different seeds are scored on the same examples; ``--seed`` chooses the training subsample, the order of
the batches and the initialisation of new weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SPLIT_SEED = 1234


class MissingData(RuntimeError):
    """Data or weights for a task are not present; the message says what to fetch and where to put it."""


@dataclass
class Setup:
    model: nn.Module
    train: Sequence[Any]  # examples; ``collate`` turns a list of them into a batch (dict of tensors)
    test: Sequence[Any]
    collate: Callable[[list], dict]
    loss: Callable[[nn.Module, dict], torch.Tensor]  # mean training loss of one batch
    evaluate: Callable[[nn.Module, Iterable[dict]], float]  # the task's metric over the test batches
    metric: str  # "accuracy" | "perplexity"
    seq_len: int | None  # tokens per sample (ViT: patches + cls; text: the maximum length)
    tokens: Callable[[dict], int | None] = lambda batch: None  # tokens in a batch (non-padding), for tokens/s
    info: dict = field(default_factory=dict)  # sizes etc., copied into the record's options


def defaults_for(task, method_spec: str) -> dict:
    """The task's default hyper-parameters for ``method_spec`` (names joined with '+'): ``DEFAULTS``, updated by
    ``METHOD_DEFAULTS[name]`` of every method in the spec (in spec order)."""
    out = dict(task.DEFAULTS)
    per_method = getattr(task, "METHOD_DEFAULTS", {})
    for name in (m.strip() for m in method_spec.split("+")):
        out.update(per_method.get(name, {}))
    return out


def split_indices(n: int, n_test: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed (seed-independent) split of ``range(n)`` into train and test indices."""
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def subsample(idx: np.ndarray, limit: int | None, seed: int) -> np.ndarray:
    """At most ``limit`` of ``idx``, drawn with ``seed`` (all of them when limit is None)."""
    if limit is None or limit >= len(idx):
        return idx
    return np.sort(np.random.default_rng(seed).choice(idx, size=limit, replace=False))


def classification_loss(forward: Callable[[nn.Module, dict], torch.Tensor]):
    def loss(model, batch):
        return F.cross_entropy(forward(model, batch).float(), batch["labels"])
    return loss


def classification_accuracy(forward: Callable[[nn.Module, dict], torch.Tensor]):
    @torch.no_grad()
    def evaluate(model, batches):
        right = total = 0
        for batch in batches:
            pred = forward(model, batch).argmax(-1)
            right += int((pred == batch["labels"]).sum())
            total += int(batch["labels"].numel())
        return right / max(total, 1)
    return evaluate


def lm_loss(model, batch):
    """Causal LM loss through the model's own ``labels`` path (-100 marks padding)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


@torch.no_grad()
def lm_perplexity(model, batches):
    """exp(mean negative log-likelihood per predicted token) over all test tokens."""
    nll = 0.0
    count = 0
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"][:, 1:]
        logits = logits[:, :-1]
        mask = labels != -100
        nll += float(F.cross_entropy(logits[mask], labels[mask], reduction="sum"))
        count += int(mask.sum())
    return math.exp(nll / max(count, 1))


def count_mask(key: str):
    return lambda batch: int(batch[key].sum())

"""``--synthetic-data``: a paper task run with random weights and generated inputs of the paper's shapes, for memory
and speed, with nothing downloaded.

The model is the paper model of :data:`lowmembp.estimator.step.MODELS` built with random weights
(:func:`lowmembp.estimator.step.build`, the model the estimator and the planner measure), with the task's number of
classes; ``--layers N`` keeps its first N blocks at the paper's width, ``--synthetic-overrides`` changes its config
(e.g. a tiny width for tests). One batch of the paper's shapes is generated once, on the run's device, from
``--seed``, and every step trains on it (no host work per step): images ``batch × 3 × H × W`` with labels for
``cifar*``, token ids at the full ``--max-len`` (GLUE 256, Alpaca 512 by default) with a full attention mask for
``glue-*`` and ``alpaca`` (Alpaca: labels = the ids, a causal LM). The task's own loss trains it; the model is in
the dtype the real task loads it in (Alpaca: ``--dtype``; the others fp32 under autocast).

There is no metric: generated data says nothing about accuracy, so the job does not evaluate (the record's
``metric`` is null and ``run.synthetic_data`` is true), refuses ``--eval-every``, and the pipeline's accuracy tables
leave such records out.
"""
from __future__ import annotations

import dataclasses

from experiments.tasks.base import Setup, classification_loss, count_mask, lm_loss

KIND = {"cifar10": "vision", "cifar100": "vision", "alpaca": "causal-lm"}  # and glue-*: "classifier"
CLASSES = {"cifar10": 10, "cifar100": 100}
WHAT = ("random weights (lowmembp.estimator.step.build) and one generated batch of the paper's shapes, trained on at "
        "every step: memory and speed only, no metric")


def kind(task_name: str) -> str | None:
    """The kind of inputs ``task_name`` gets (``vision``, ``classifier``, ``causal-lm``); None for a task with data
    of its own (the offline tasks), which ``--synthetic-data`` refuses."""
    if task_name.startswith("glue-"):
        return "classifier"
    return KIND.get(task_name)


def _classes(task_name: str) -> int:
    if task_name.startswith("glue-"):
        from experiments.tasks.glue import LABELS

        return LABELS.get(task_name.split("-", 1)[1], 2)
    return CLASSES.get(task_name, 0)


def build(task, model_name: str, cfg, device) -> Setup:
    """The :class:`~experiments.tasks.base.Setup` of ``task`` on generated data (see the module doc)."""
    import torch

    from lowmembp.estimator.step import MODELS, build as build_model

    what = kind(task.NAME)
    spec = MODELS[model_name]
    if what != "causal-lm":
        spec = dataclasses.replace(spec, num_classes=_classes(task.NAME))
    # built where it trains: a GPU initialises a 10^9-parameter model in a second, a CPU in tens of seconds
    model = build_model(spec, layers=cfg.layers, overrides=cfg.synthetic_overrides, device=str(device))
    if what == "causal-lm" and cfg.dtype in ("bf16", "fp16"):  # as alpaca.build loads the weights
        model = model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype])
    gen = torch.Generator().manual_seed(cfg.seed)
    bs = cfg.batch_size
    if what == "vision":
        base = getattr(model, "patch_embed", None)
        hw = tuple(getattr(base, "img_size", None) or model.default_cfg.get("input_size", (3, 224, 224))[1:])
        batch = {"x": torch.randn(bs, 3, *hw, generator=gen),
                 "labels": torch.randint(0, spec.num_classes, (bs,), generator=gen)}
        seq = (hw[0] // 16) * (hw[1] // 16) + 1 if model_name.startswith("vit") else (hw[0] // 4) * (hw[1] // 4)
        loss = classification_loss(lambda m, b: m(b["x"]))
        tokens = lambda b: int(b["x"].shape[0]) * seq  # noqa: E731
    else:
        seq = cfg.max_len or spec.seq_len
        vocab = int(model.config.vocab_size)
        ids = torch.randint(3, vocab, (bs, seq), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones(bs, seq, dtype=torch.long)}
        if what == "causal-lm":
            batch["labels"] = ids.clone()
            loss = lm_loss
        else:
            batch["labels"] = torch.randint(0, spec.num_classes, (bs,), generator=gen)
            loss = classification_loss(
                lambda m, b: m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits)
        tokens = count_mask("attention_mask")
    batch = {k: v.to(device) for k, v in batch.items()}

    def evaluate(net, batches):
        raise RuntimeError("--synthetic-data: generated inputs have no metric (the job does not evaluate them)")

    return Setup(model=model, train=list(range(bs)), test=[], collate=lambda items: batch, loss=loss,
                 evaluate=evaluate, metric="none (synthetic data)", seq_len=seq, tokens=tokens,
                 info={"synthetic_data": WHAT, "layers": cfg.layers, "synthetic_overrides": cfg.synthetic_overrides,
                       "train_pool": bs, "test_size": 0})

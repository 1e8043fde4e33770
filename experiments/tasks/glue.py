"""``glue-<task>`` (cola, sst2, mrpc, qqp, mnli, qnli, rte) with ``roberta-base`` or ``bert-large``: the paper's
RoBERTa and TokenTune runs. Metric: accuracy on the validation split (mnli: validation_matched); GLUE's test labels
are hidden. (The paper reports Matthews correlation for CoLA; this job reports accuracy for every task.)

Data: ``<data>/glue/<task>/``, a ``datasets`` ``save_to_disk`` directory. Fetch once on a machine with internet:
``python -c "import datasets; datasets.load_dataset('glue', 'sst2').save_to_disk('data/glue/sst2')"`` (needs
``pip install datasets``), or pass ``--download``. Weights: see :mod:`experiments.tasks.paper_models`.
Paper settings: ``experiments/configs/roberta-base-glue.yaml``, ``bert-large-glue-tokentune.yaml``.
"""
from __future__ import annotations

from types import SimpleNamespace

from experiments.tasks import paper_models
from experiments.tasks.base import (MissingData, Setup, classification_accuracy, classification_loss, count_mask,
                                    subsample)

MODELS = ("roberta-base", "bert-large")
KEYS = {"cola": ("sentence", None), "sst2": ("sentence", None), "mrpc": ("sentence1", "sentence2"),
        "qqp": ("question1", "question2"), "mnli": ("premise", "hypothesis"), "qnli": ("question", "sentence"),
        "rte": ("sentence1", "sentence2")}
LABELS = {"mnli": 3}


def _forward(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def for_task(name: str):
    glue = name.split("-", 1)[1]

    def check(cfg):
        root = paper_models.data_dir(cfg) / "glue" / glue
        if not cfg.download and not (root / "dataset_dict.json").is_file():
            raise MissingData(
                f"GLUE {glue} not found: expected a datasets save_to_disk directory at {root}/. Fetch it on a "
                f"machine with internet: `pip install datasets && python -c \"import datasets; "
                f"datasets.load_dataset('glue', '{glue}').save_to_disk('{root}')\"` and copy it here (or set "
                f"--data-dir / LOWMEMBP_DATA_DIR), or pass --download")
        paper_models.check_weights(cfg, cfg.model)

    def build(model_name, cfg):
        import numpy as np
        import torch
        try:
            import datasets
        except ImportError as err:
            raise MissingData("GLUE tasks need the `datasets` package: pip install datasets") from err
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if cfg.download:
            data = datasets.load_dataset("glue", glue)
        else:
            data = datasets.load_from_disk(str(paper_models.data_dir(cfg) / "glue" / glue))
        src = paper_models.hf_source(cfg, model_name)
        tokenizer = AutoTokenizer.from_pretrained(src)
        model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=LABELS.get(glue, 2))
        train, test = data["train"], data["validation_matched" if glue == "mnli" else "validation"]
        a, b = KEYS[glue]
        train_idx = subsample(np.arange(len(train)), cfg.limit, cfg.seed).tolist()
        test_idx = subsample(np.arange(len(test)), cfg.eval_limit, 0).tolist()
        max_len = cfg.max_len or 256

        def collate(items):
            split = train if items[0][0] == "train" else test
            rows = [split[int(i)] for _, i in items]
            enc = tokenizer([r[a] for r in rows], [r[b] for r in rows] if b else None, padding=True,
                            truncation=True, max_length=max_len, return_tensors="pt")
            return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                    "labels": torch.tensor([r["label"] for r in rows])}

        return Setup(model=model, train=[("train", i) for i in train_idx], test=[("test", i) for i in test_idx],
                     collate=collate, loss=classification_loss(_forward), evaluate=classification_accuracy(_forward),
                     metric="accuracy", seq_len=max_len, tokens=count_mask("attention_mask"),
                     info={"train_pool": len(train_idx), "test_size": len(test_idx), "max_len": max_len})

    return SimpleNamespace(NAME=name, MODELS=MODELS, METRIC="accuracy", check=check, build=build,
                           DEFAULTS=dict(steps=1000, lr=5e-4, max_len=256))

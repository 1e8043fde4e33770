"""Model weights between runs: ``--save-model PATH`` writes a trained model's weights, ``--init PATH`` starts a run
from them (before the method is applied, so any method fine-tunes the same base).

Format: safetensors (no pickle), the model's ``state_dict`` as it is after training, with string metadata (task,
model, method, steps, seed, test metric, ...). Saved from a run whose method keeps the model's own parameter names
(``baseline``, ``checkpointing``, ``tokentune``, ``mesa``, ...): ``--init`` loads strictly into the task's freshly
built model and fails with the missing / unexpected names otherwise.

Written atomically (``lowmembp.atomic``: a temporary file in the destination's directory, fsync'ed, then
``os.replace``) — a killed run leaves either no file or a whole one. The file is serialised in memory first
(``safetensors.torch.save``), which is fine for the small bases this is for.
"""
from __future__ import annotations

import hashlib
import os

import torch.nn as nn


def sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def save_weights(model: nn.Module, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write ``model.state_dict()`` to ``path`` (safetensors) atomically; ``metadata`` values are stored as text."""
    from safetensors.torch import save

    from lowmembp.atomic import atomic_write

    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    atomic_write(path, save(state, metadata=meta))


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_weights(model: nn.Module, path: str | os.PathLike) -> dict:
    """Load ``path`` into ``model`` (strict); returns the record's ``base`` section: path, sha256 and the file's
    metadata."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"--init {path}: the weights do not fit model {type(model).__name__} — missing "
            f"{list(result.missing_keys)[:5]}, unexpected {list(result.unexpected_keys)[:5]} (save the base from a "
            "run of the same model and task with a method that keeps parameter names, e.g. baseline)")
    return {"path": str(path), "sha256": sha256(path), "metadata": read_metadata(path)}

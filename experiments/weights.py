"""Model weights between runs: ``--save-model PATH`` writes a trained model's weights, ``--init PATH`` starts a run
from them (before the method is applied, so any method fine-tunes the same base).

Format: safetensors (no pickle), the model's ``state_dict`` as it is after training, with string metadata (task,
model, method, steps, seed, test metric, ...). Saved from a run whose method keeps the model's own parameter names
(``baseline``, ``checkpointing``, ``tokentune``, ``mesa``, ...): ``--init`` loads strictly into the task's freshly
built model and fails with the missing / unexpected names otherwise.

Written atomically (``lowmembp.atomic``: a temporary file in the destination's directory, fsync'ed, then
``os.replace``) — a killed run leaves either no file or a whole one. The file is serialised in memory first
(``safetensors.torch.save``), which is fine for the small bases this is for.

Byte for byte the same for the same weights and metadata, so that its sha256 (the record's ``base.sha256``) names
them: safetensors writes its metadata map in a hash map's order, which changes with every save (20 saves of one
state dict with 8 metadata keys gave 20 different files), so the metadata is stored as one entry, ``lowmembp``, a
JSON object with sorted keys; :func:`read_metadata` unpacks it (and reads files with plain metadata as they are).
"""
from __future__ import annotations

import hashlib
import json
import os

import torch.nn as nn

_META_KEY = "lowmembp"  # the one metadata entry: every value of the run's metadata, as sorted JSON (module doc)


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
    atomic_write(path, save(state, metadata={_META_KEY: json.dumps(meta, sort_keys=True)}))


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if set(meta) == {_META_KEY}:
        return json.loads(meta[_META_KEY])
    return meta


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

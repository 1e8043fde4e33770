"""One run's JSON record (DESIGN.md §5): the environment, schema validation, and the atomic write.

The record is validated against ``experiments/record.schema.json`` before it is written; it is written to a
temporary file in the destination's directory, flushed and fsync'ed, then renamed over the destination with
``os.replace`` — so a reader (or Snakemake) sees either no file or a whole one, even if the job is killed.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

SCHEMA_PATH = Path(__file__).with_name("record.schema.json")
REPO = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(record: dict) -> None:
    """Raise ``jsonschema.ValidationError`` if ``record`` does not match the schema."""
    import jsonschema

    jsonschema.validate(record, schema())


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _version(dist: str) -> str | None:
    """The installed version from the package metadata (no import of the package: importing transformers or
    timm costs seconds)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD's commit of the repository this file is in: one ``git rev-parse`` with a short timeout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=3)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device) -> dict:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"  # processor() runs `uname -p`
    return {"device": name, "torch": torch.__version__, "triton": _version("triton"), "timm": _version("timm"),
            "transformers": _version("transformers"), "git_commit": git_commit(), "hostname": platform.node()}


def write_atomic(record: dict, path: str | os.PathLike) -> Path:
    """Validate ``record`` and write it to ``path`` atomically (temp file in the same directory + os.replace)."""
    validate(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=2, sort_keys=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a record is an ordinary file
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path

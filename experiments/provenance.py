"""What a run ran on, for its record's ``environment`` section: the machine (device, CUDA, driver), the versions of
Python and the libraries, lowmembp's ops backend, and the code (git commit, uncommitted changes).

    env = capture_environment(device)          # an experiments.record.Environment; never raises
    read_git_commit(), read_git_changes()      # HEAD, (dirty, diff hash); $LOWMEMBP_GIT_COMMIT for a copied tree
"""
from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

from experiments.record import Environment

REPO = Path(__file__).resolve().parent.parent


def _version(dist: str) -> str | None:
    """The installed version from the package metadata (no import: importing transformers or timm costs seconds)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


SENT_COMMIT = "LOWMEMBP_GIT_COMMIT"  # "<sha>" or "<sha> dirty": the commit a copied tree (stale or no .git) came from


def _sent_commit() -> tuple[str, bool | None] | None:
    line = os.environ.get(SENT_COMMIT, "").strip()
    if not line:
        return None
    sha, _, rest = line.partition(" ")
    return sha, ("dirty" in rest) if rest else None


@lru_cache(maxsize=1)
def read_git_commit() -> str | None:
    """HEAD's commit of the repository this file is in: one ``git rev-parse`` with a short timeout; where
    ``$LOWMEMBP_GIT_COMMIT`` is set (a tree copied to another machine, e.g. the GPU run's), that commit instead."""
    sent = _sent_commit()
    if sent:
        return sent[0]
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=3)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@lru_cache(maxsize=1)
def read_git_changes() -> tuple[bool | None, str | None]:
    """(dirty, sha256 of ``git diff HEAD``) of the repository's tracked files; (None, None) without git. With
    ``$LOWMEMBP_GIT_COMMIT``: its dirty flag, and no diff hash (the copy's .git cannot say)."""
    import hashlib

    sent = _sent_commit()
    if sent:
        return sent[1], None
    try:
        out = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--binary"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if out.returncode != 0:
        return None, None
    return (True, hashlib.sha256(out.stdout).hexdigest()[:16]) if out.stdout else (False, None)


@lru_cache(maxsize=1)
def read_nvidia_driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return lines[0].strip() if lines else None


def capture_environment(device=None) -> Environment:
    """What the run ran on. Never raises: a part that cannot be read is recorded as such."""
    dirty, diff = read_git_changes()
    env = Environment(device="unknown", hostname=platform.node(), python=platform.python_version(),
                      git_commit=read_git_commit(), git_dirty=dirty, git_diff_sha256=diff, triton=_version("triton"),
                      timm=_version("timm"), transformers=_version("transformers"))
    try:
        import torch

        env.torch = torch.__version__
        env.threads = torch.get_num_threads()
        kind = getattr(device, "type", None) or (str(device) if device is not None else "cpu")
        if kind.startswith("cuda"):
            env.device = torch.cuda.get_device_name(device)
            props = torch.cuda.get_device_properties(device)
            env.cuda, env.driver = torch.version.cuda, read_nvidia_driver()
            env.capability, env.device_memory_bytes = f"{props.major}.{props.minor}", int(props.total_memory)
        else:
            env.device = f"cpu ({platform.machine()}, {env.threads} threads)"  # processor() runs `uname -p`
    except Exception as err:  # e.g. cuda asked for on a machine without it
        env.device = f"unknown ({type(err).__name__}: {err})"
    try:
        import torch

        from lowmembp.ops.backend import backend_for

        env.ops_backend = backend_for(torch.empty(0, device=device if device is not None else "cpu"))
    except Exception as err:  # e.g. LOWMEMBP_BACKEND=cpu for a CUDA run
        env.ops_backend = f"unknown ({type(err).__name__}: {err})"
    return env

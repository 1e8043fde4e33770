"""Where lowmembp keeps what it makes once per machine and reuses: the CPU kernels' compiled library
(``cpu_kernels/``) and the parsed arrays of the training job's mnist5k task.

    from lowmembp.cache import cache_dir
    cache_dir() / "cpu_kernels"

``$LOWMEMBP_CACHE_DIR``, else ``$XDG_CACHE_HOME/lowmembp``, else ``~/.cache/lowmembp``; read at each call, so a
changed environment variable takes effect at once. Everything in it can be deleted: it is made again on first use.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "cache_dir"]

ENV_VAR = "LOWMEMBP_CACHE_DIR"


def cache_dir() -> Path:
    """``$LOWMEMBP_CACHE_DIR``, else ``$XDG_CACHE_HOME/lowmembp``, else ``~/.cache/lowmembp`` (not created here)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowmembp"

"""Run one paper-scale reproduction from lowmembp.repro and write its rows as CSV (atomically).

    python repro.py NAME OUT.csv [key=value ...]      # by hand; under Snakemake: rule repro

NAME is one of block-breakdown, fig1, mesa-table, tokentune-memory; key=value pairs (or the config's
repro.options.<NAME>) are passed to the reproduction's function as keyword arguments (e.g. a reduced scale).
"""

import importlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd


def find_function(name: str):
    """The reproduction's function: lowmembp.repro's registry if it has one, else the module/function by name."""
    repro = importlib.import_module("lowmembp.repro")
    for reg in ("REPRODUCTIONS", "REPROS", "REGISTRY"):
        table = getattr(repro, reg, None)
        if isinstance(table, dict) and name in table:
            return table[name]
    attr = name.replace("-", "_")
    fn = getattr(repro, attr, None)
    if callable(fn):
        return fn
    try:
        mod = importlib.import_module(f"lowmembp.repro.{attr}")
    except ImportError:
        mod = None
    for cand in (getattr(mod, "run", None), getattr(mod, attr, None), getattr(mod, "reproduce", None)):
        if callable(cand):
            return cand
    raise SystemExit(f"lowmembp.repro has no reproduction {name!r}; expected one of "
                     "block-breakdown, fig1, mesa-table, tokentune-memory")


def to_frame(result) -> pd.DataFrame:
    if isinstance(result, pd.DataFrame):
        return result
    if isinstance(result, tuple) and result and isinstance(result[0], (pd.DataFrame, list)):
        result = result[0]
    return pd.DataFrame([r if isinstance(r, dict) else vars(r) for r in result])


def run(name: str, out: str | Path, **options) -> pd.DataFrame:
    t0 = time.perf_counter()
    df = to_frame(find_function(name)(**options))
    logging.info("%s: %d rows in %.1f s (options %s)", name, len(df), time.perf_counter() - t0, options)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        df.to_csv(tmp, index=False)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return df


def _parse(kv: str):
    k, v = kv.split("=", 1)
    for conv in (int, float):
        try:
            return k, conv(v)
        except ValueError:
            pass
    return k, {"true": True, "false": False}.get(v.lower(), v)


if "snakemake" in globals():
    logging.basicConfig(filename=snakemake.log[0], level=logging.INFO, format="%(message)s")  # noqa: F821
    run(snakemake.wildcards.name, snakemake.output[0], **dict(snakemake.params.options))  # noqa: F821
elif __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run(sys.argv[1], sys.argv[2], **dict(_parse(a) for a in sys.argv[3:]))

"""Run one paper-scale reproduction from lowmembp.repro and write its rows as CSV (atomically).

    python repro.py NAME OUT.csv [key=value ...]      # by hand; under Snakemake: rule repro

NAME is one of block-breakdown, fig1, mesa-table, tokentune-memory; key=value pairs (or the config's
repro.options.<NAME>) are passed to the reproduction's function as keyword arguments (e.g. a reduced scale).
"""

import logging
import sys
import time
from pathlib import Path

HERE = Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).resolve().parent  # noqa: F821
sys.path.insert(0, str(HERE))
from aggregate import write_csv_atomic  # noqa: E402


def run(name: str, out: str | Path, **options):
    """Run reproduction ``name`` (lowmembp.repro.REPROS) with ``options`` and write its table to ``out``."""
    from lowmembp.repro import run as run_repro

    t0 = time.perf_counter()
    df = run_repro(name, **options)
    logging.info("%s: %d rows in %.1f s (options %s)", name, len(df), time.perf_counter() - t0, options)
    write_csv_atomic(df, out)
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

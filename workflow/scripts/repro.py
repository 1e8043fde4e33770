"""Run one paper-scale reproduction from experiments.repro and write its rows as CSV (atomically).

    python repro.py NAME OUT.csv [key=value ...]      # by hand; under Snakemake: rule repro

NAME is a reproduction of workflow/catalogue.py (experiments.repro.REPROS); key=value pairs (or the config's
repro.options.<NAME>) are passed to the reproduction's function as keyword arguments (e.g. a reduced scale).
"""

import logging
import sys
import time

from lowmembp.atomic import atomic_open


def run(name: str, out: str, **options):
    """Run reproduction ``name`` (experiments.repro.REPROS) with ``options`` and write its table to ``out``."""
    from experiments.repro import run as run_repro

    t0 = time.perf_counter()
    df = run_repro(name, **options)
    logging.info("%s: %d rows in %.1f s (options %s)", name, len(df), time.perf_counter() - t0, options)
    with atomic_open(out, "w") as fh:
        df.to_csv(fh, index=False)
    return df


def _parse(kv: str):
    k, v = kv.split("=", 1)
    for conv in (int, float):
        try:
            return k, conv(v)
        except ValueError:
            pass
    return k, {"true": True, "false": False}.get(v.lower(), v)


def main(argv: list[str]) -> int:
    """By hand: 0 when the table was written, 1 when the reproduction failed or produced no rows (nothing written),
    2 for a bad command line."""
    from experiments.repro import REPROS

    bad = [a for a in argv[2:] if "=" not in a]
    why = ("give NAME and OUT.csv" if len(argv) < 2 else f"unknown reproduction {argv[0]!r}" if argv[0] not in REPROS
           else f"options are key=value, not {bad[0]!r}" if bad else None)
    if why:
        print(f"error: {why}\nusage: python repro.py NAME OUT.csv [key=value ...]; NAME one of {', '.join(REPROS)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        run(argv[0], argv[1], **dict(_parse(a) for a in argv[2:]))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if "snakemake" in globals():
    logging.basicConfig(filename=snakemake.log[0], level=logging.INFO, format="%(message)s")  # noqa: F821
    run(snakemake.wildcards.name, snakemake.output[0], **dict(snakemake.params.options))  # noqa: F821
elif __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

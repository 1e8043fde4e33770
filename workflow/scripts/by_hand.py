"""The command line of a workflow script run by hand (outside Snakemake): its positional arguments, or a usage error.

    main(*by_hand.arguments("python plots.py RUNS.csv NAME OUT.png", sys.argv[1:], 3))

A wrong number of arguments exits 2 with the usage line on stderr (``-h`` / ``--help``: the usage, exit 0), instead
of a traceback from the script's first use of a missing argument.
"""
from __future__ import annotations

import sys

USAGE_ERROR = 2


def arguments(usage: str, argv: list[str], count: int, *, more: bool = False) -> list[str]:
    """``argv`` when it holds ``count`` arguments (``more``: at least ``count``); otherwise print ``usage`` and exit,
    2 for a wrong count, 0 when help was asked for."""
    asked = any(a in ("-h", "--help") for a in argv)
    if not asked and (len(argv) == count or (more and len(argv) > count)):
        return argv
    wanted = f"{count} or more" if more else str(count)
    print(f"usage: {usage}" + ("" if asked else f"\nerror: {wanted} argument(s) expected, got {len(argv)}"),
          file=sys.stderr)
    sys.exit(0 if asked else USAGE_ERROR)

"""``python -m experiments.repro <name> [--small] [--csv OUT]``: print one reproduction (or ``all``) as a markdown
table. Exit status: 0 when every table has rows, 1 when a reproduction failed or produced no rows (the others still
run), 2 for a bad argument."""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    from experiments.repro import REPROS, run, to_markdown
    from lowmembp.atomic import atomic_open

    names = list(REPROS)

    ap = argparse.ArgumentParser(prog="python -m experiments.repro", description=__doc__)
    ap.add_argument("name", choices=names + ["all"])
    ap.add_argument("--small", action="store_true", help="reduced scale (seconds; for smoke tests)")
    ap.add_argument("--csv", default=None, help="also write the table to this CSV file")
    args = ap.parse_args(argv)
    failed = []
    for name in names if args.name == "all" else [args.name]:
        t0 = time.perf_counter()
        try:
            df = run(name, small=args.small)
        except RuntimeError as err:  # an empty table (or a reproduction's own failure): the others still run
            print(f"error: {err}", file=sys.stderr)
            failed.append(name)
            continue
        print(f"\n## {name}\n")
        print(to_markdown(df))
        note = getattr(df, "attrs", {}).get("caption")
        if note:
            print(f"\n{note}")
        print(f"\n({time.perf_counter() - t0:.1f} s on the CPU)")
        if args.csv:
            with atomic_open(args.csv if args.name != "all" else f"{args.csv.removesuffix('.csv')}-{name}.csv") as fh:
                df.to_csv(fh, index=False)
        sys.stdout.flush()
    if failed:
        print(f"error: {len(failed)} reproduction(s) failed: {', '.join(failed)} (see the messages above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

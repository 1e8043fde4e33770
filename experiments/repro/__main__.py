"""``python -m experiments.repro <name> [--small]``: print one reproduction as a markdown table."""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    from experiments.repro import REPROS, run, to_markdown

    names = list(REPROS)

    ap = argparse.ArgumentParser(prog="python -m experiments.repro", description=__doc__)
    ap.add_argument("name", choices=names + ["all"])
    ap.add_argument("--small", action="store_true", help="reduced scale (seconds; for smoke tests)")
    ap.add_argument("--csv", default=None, help="also write the table to this CSV file")
    args = ap.parse_args(argv)
    for name in names if args.name == "all" else [args.name]:
        t0 = time.perf_counter()
        df = run(name, small=args.small)
        print(f"\n## {name}\n")
        print(to_markdown(df))
        note = getattr(df, "attrs", {}).get("caption")
        if note:
            print(f"\n{note}")
        print(f"\n({time.perf_counter() - t0:.1f} s on the CPU)")
        if args.csv:
            df.to_csv(args.csv if args.name != "all" else f"{args.csv.removesuffix('.csv')}-{name}.csv", index=False)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

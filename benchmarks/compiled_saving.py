"""Eager vs compiled saved-for-backward bytes per method: the ``compiled-saving`` reproduction with its knobs.

    OMP_NUM_THREADS=1 python benchmarks/compiled_saving.py --families bert --methods baseline,lowmembp
    python benchmarks/compiled_saving.py --backend inductor            # the real code generator (slower)
    python -m experiments.repro compiled-saving [--small]                 # the same table at its defaults

The measurement is :mod:`experiments.repro.compiled_saving` (see there what is counted and how); this wrapper only
exposes its options on the command line.
"""
from __future__ import annotations

import argparse
import sys

from experiments.repro import to_markdown
from experiments.repro.compiled_saving import FAMILIES, METHODS, compiled_saving, read_choices


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2, help="blocks per model")
    ap.add_argument("--k", type=int, default=16, help="tokentune: tokens per sequence with gradients")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--backend", default="aot_eager_decomp_partition",
                    help="torch.compile backend (default: inductor's partitioner without code generation; "
                         "'inductor' generates code too)")
    a = ap.parse_args(argv)
    try:
        methods, families = read_choices(a.methods, a.families)
    except ValueError as err:
        ap.error(str(err))
    df = compiled_saving(methods=methods, families=families,
                         seq_len=a.seq_len, batch=a.batch, depth=a.depth, k=a.k, backend=a.backend)
    print(to_markdown(df.drop(columns=["note"]), floatfmt=".1f"))
    print(f"\n{df.attrs['caption']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

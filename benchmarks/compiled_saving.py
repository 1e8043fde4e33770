"""Saved-for-backward bytes per method, eager and compiled (``<method>+compile``), on the small random ViT / BERT /
LLaMA of ``benchmarks/saved_bytes_methods.py`` (CPU, fp32).

    OMP_NUM_THREADS=1 python benchmarks/compiled_saving.py --families bert --methods baseline,lowmembp
    python benchmarks/compiled_saving.py --seq-len 64 --backend inductor          # default backend: inductor

Eager: the training forward under :class:`lowmembp.memory.SavedTensorAccountant`. Compiled: the same model with
``compile`` applied last; one forward + backward first (compiles both graphs, outside the count), then the forward
under the same accountant — the compiled autograd function saves its tensors through ``save_for_backward``, which
the accountant's hooks see (parameters excluded, as for eager). "saving" is 1 − bytes / the baseline's bytes in the
same mode (eager against eager baseline, compiled against compiled baseline); "kept" is compiled saving / eager
saving (issue 14 asks for ≥ 90 %).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

from lowmembp.memory import saved_bytes  # noqa: E402
from saved_bytes_methods import FAMILIES, apply, build  # noqa: E402

METHODS = ("baseline", "lowmembp", "mesa", "lora", "lora+lowmembp", "checkpointing", "tokentune")


def measure(family: str, method: str, compiled: bool, seq_len: int = 64, k: int = 16, batch: int = 2,
            backend: str = "inductor") -> int:
    """Saved bytes of one training forward of ``method`` on ``family``, eager or compiled."""
    torch._dynamo.reset()
    model, b, loss = build(family, seq_len, batch)
    if method != "baseline":
        model = apply(model, method, k)
    if compiled:
        import lowmembp
        model = lowmembp.apply(model, "compile", compile_backend=backend)
        torch.manual_seed(0)
        loss(model, b).backward()
        model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    return saved_bytes(model, lambda: loss(model, b))["total"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=16, help="tokentune: tokens per sequence with gradients")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager_decomp_partition: "
                    "the same partitioner without code generation, faster to compile)")
    a = ap.parse_args(argv)
    methods, families = a.methods.split(","), a.families.split(",")
    if "baseline" not in methods:
        methods = ["baseline"] + methods
    print(f"saved for backward, KiB, eager | compiled ({a.backend}); fp32, batch {a.batch}, L = {a.seq_len}")
    print("| family | method | eager KiB | compiled KiB | eager saving | compiled saving | kept |")
    print("|---|---|---|---|---|---|---|")
    for f in families:
        base = {c: measure(f, "baseline", c, a.seq_len, a.k, a.batch, a.backend) for c in (False, True)}
        for m in methods:
            v = base if m == "baseline" else {c: measure(f, m, c, a.seq_len, a.k, a.batch, a.backend)
                                              for c in (False, True)}
            se, sc = 1 - v[False] / base[False], 1 - v[True] / base[True]
            kept = f"{sc / se:.0%}" if m != "baseline" and se > 0 else "—"
            print(f"| {f} | {m} | {v[False] / 1024:.0f} | {v[True] / 1024:.0f} | {se:.0%} | {sc:.0%} | {kept} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

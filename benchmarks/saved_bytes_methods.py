"""Saved-for-backward bytes per method × family on small random models at sequence length L (CPU, fp32).

    OMP_NUM_THREADS=1 python benchmarks/saved_bytes_methods.py                 # L = 128, k = 16, batch 2
    OMP_NUM_THREADS=1 python benchmarks/saved_bytes_methods.py --peak          # also the step's peak memory
    python benchmarks/saved_bytes_methods.py --seq-len 256 --k 32 --methods baseline,mesa,tokentune

Models (random weights, 2 blocks, width 64, 4 heads): timm ViT with a 64×128 image and 8-px patches (128 patches +
class token), BERT for sequence classification and LLaMA for causal LM (2 KV heads), L tokens each. The forward runs
in training mode under :class:`lowmembp.measurement.saved.SavedTensorAccountant` (storage-deduplicated bytes that
autograd
saves, parameters excluded; for ``checkpointing`` that includes the block inputs each checkpoint keeps for
recomputation — they are saved tensors, see :mod:`lowmembp.measurement.saved`). ``--peak`` adds the
peak of one whole training step (AdamW) measured by :func:`lowmembp.measurement.peak.measure_step_peak` (CPU tensor
tracker),
activations + temporaries only.
"""
from __future__ import annotations

import argparse
import sys

import torch

import lowmembp
from lowmembp.measurement.saved import saved_bytes
from experiments.repro.compiled_saving import FAMILIES, WIDTH, read_choices
from experiments.repro.compiled_saving import build as build_model

METHODS = ("baseline", "lora", "checkpointing", "mesa", "mesa-gelu-ln", "lowmembp", "lowmembp-act",
           "lowmembp-norm", "tokentune", "lora+lowmembp", "lora+checkpointing", "lora+mesa-gelu-ln",
           "lowmembp+tokentune", "lora+lowmembp+tokentune")
DEPTH = 2


def build(family: str, seq_len: int = 128, batch: int = 2, seed: int = 0):
    """``(model in train mode, forward)`` for ``family`` at ``seq_len`` tokens: the models of
    :func:`experiments.repro.compiled_saving.build` at this benchmark's depth; ``forward(model)`` is one fixed batch's
    loss."""
    return build_model(family, seq_len, batch, depth=DEPTH, seed=seed)


def apply(model, method: str, k: int):
    return lowmembp.apply(model, method, **({"k": k} if "tokentune" in method.split("+") else {}))


def measure(family: str, method: str, seq_len: int = 128, k: int = 16, batch: int = 2, peak: bool = False) -> dict:
    """Saved bytes (and optionally the step peak) of ``method`` on ``family``."""
    model, forward = build(family, seq_len, batch)
    model = apply(model, method, k)
    rep = saved_bytes(model, lambda: forward(model))
    out = {"saved": rep["total"]}
    if peak:
        from lowmembp.measurement.peak import measure_step_peak

        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)

        def step():
            forward(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        cats = measure_step_peak(model, opt, step)["by_category"]
        out["peak_act"] = cats.get("activations", 0) + cats.get("temporaries", 0)
    return out


def table(methods=METHODS, families=FAMILIES, seq_len=128, k=16, batch=2, peak=False) -> dict:
    return {(m, f): measure(f, m, seq_len, k, batch, peak) for m in methods for f in families}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=16, help="tokentune: tokens per sequence with gradients")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--peak", action="store_true", help="also measure the peak of one training step (slower)")
    a = ap.parse_args(argv)
    try:
        methods, families = read_choices(a.methods, a.families)
    except ValueError as err:
        ap.error(str(err))
    res = table(methods, families, a.seq_len, a.k, a.batch, a.peak)
    print(f"saved for backward, KiB (fp32, batch {a.batch}, L = {a.seq_len}, k = {a.k}, {DEPTH} blocks of width "
          f"{WIDTH}); in brackets: share of baseline")
    cols = [f for f in families]
    head = "| method | " + " | ".join(cols) + " |"
    print(head)
    print("|---" * (len(cols) + 1) + "|")
    for m in methods:
        cells = []
        for f in families:
            r, base = res[(m, f)], res.get(("baseline", f))
            v = r["saved"]
            share = f" ({v / base['saved']:.0%})" if base else ""
            cells.append(f"{v / 1024:.0f}{share}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    if a.peak:
        print("\npeak of one training step, activations + temporaries, KiB")
        print(head)
        print("|---" * (len(cols) + 1) + "|")
        for m in methods:
            print(f"| {m} | " + " | ".join(f"{res[(m, f)]['peak_act'] / 1024:.0f}" for f in families) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

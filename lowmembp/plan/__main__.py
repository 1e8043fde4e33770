"""``python -m lowmembp.plan``: the planner on the command line (a ranked table; ``--json`` / ``--csv FILE``).

    python -m lowmembp.plan --model llama-7b --gpu-memory 24GiB --batch-size 4 --seq-len 2048
    python -m lowmembp.plan --model vit_base_patch16_224 --gpu-memory 12GiB --batch-size 64 --option lora.rank=4,16
    python -m lowmembp.plan --model path/to/config.json --gpu-memory 80GiB --batch-size 8 --seq-len 4096 --json
"""
from __future__ import annotations

import argparse
import os
import sys

from lowmembp.estimator.step import DTYPES
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS
from lowmembp.plan.combos import ALL, DEFAULT_MAX_METHODS


def main(argv: list[str] | None = None, start_method: str | None = None) -> int:
    """The command line; ``start_method``: how the planner's worker processes start (:mod:`lowmembp.plan.pool`;
    ``python -m lowmembp.plan`` forks them, a caller's process may have run autograd and keeps the default)."""
    ap = argparse.ArgumentParser(prog="python -m lowmembp.plan", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="a paper model (llama-7b, vit-b16, ...), a timm model name, or a transformers config.json")
    ap.add_argument("--gpu-memory", default="24GiB", help="memory of one GPU, e.g. 24GiB, 40GB (default 24GiB)")
    ap.add_argument("--batch-size", type=int, required=True, help="the batch size you want to train with")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (text models)")
    ap.add_argument("--image-size", type=int, default=None, help="image side in pixels (timm models)")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="autocast dtype (default: the model's)")
    ap.add_argument("--weights", default="auto",
                    help="how the weights are stored: auto (default: a LoRA-family base in the compute dtype, trained "
                         "weights as fp32 masters under autocast), fp32, bf16, fp16 (the model loaded in that dtype), "
                         "nf4 (QLoRA's 4-bit base, LoRA-family methods only), or several comma-separated: each "
                         "combination planned with each")
    ap.add_argument("--optimizer", default=DEFAULT_OPTIMIZER,
                    help=f"{', '.join(OPTIMIZERS)} (default {DEFAULT_OPTIMIZER}), or several comma-separated: each "
                         "combination planned with each (lowmembp.methods.optimizers)")
    ap.add_argument("--find", default="batch", metavar="batch|seq-len",
                    help="seq-len: also the largest sequence length that fits at --batch-size for each row, found by "
                         "steps and checked (the largest batch is always searched)")
    ap.add_argument("--plot", default=None, metavar="FILE",
                    help="also write a figure: one stacked bar per row, the peak by category (PNG/PDF/SVG)")
    ap.add_argument("--world-size", type=int, default=1,
                    help="GPUs sharing the model (FSDP2: one rank's peak, the batch per GPU; "
                         "lowmembp.estimator.step.fsdp_peak)")
    ap.add_argument("--methods", default=None,
                    help="only combinations of these methods (comma-separated: lora,lowmembp plans every combination "
                         "of them); a name joined with + (lora+lowmembp) is that exact combination: then every "
                         "comma-separated entry is planned as written, beside the baseline")
    ap.add_argument("--exclude", default=None, help="leave these methods out (comma-separated)")
    ap.add_argument("--max-methods", type=_max_methods, default=None, metavar="N|all",
                    help=f"at most N methods per combination, or all (default: {DEFAULT_MAX_METHODS} for the default "
                         "plan, all for the combinations of --methods)")
    ap.add_argument("--option", action="append", default=[], metavar="METHOD.OPTION=V1[,V2]",
                    help="set or sweep a method option, e.g. tokentune.k=16,256 or lora.rank=64 (repeatable)")
    ap.add_argument("--margin", type=float, default=None,
                    help="allocator margin as a fraction of the tensor bytes (default: results/gpu/margin.json, "
                         "else 0.10)")
    ap.add_argument("--reserved", default=None, help="fixed reserve for CUDA context and workspaces (default 1GiB)")
    ap.add_argument("--runs", default=None, help="runs.csv with measured step times (default: results/runs.csv, "
                                                 "else results/reference/runs.csv)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    ap.add_argument("--also-gpu", default=None, metavar="SIZES",
                    help="other GPU sizes for the max-batch column, e.g. 40GiB,80GiB (the same estimates reused)")
    ap.add_argument("--progress", action="store_true",
                    help="print each finished combination to stderr (default: a progress bar there, on a terminal)")
    ap.add_argument("--json", action="store_true", help="print the whole plan as JSON instead of the table")
    ap.add_argument("--csv", default=None, metavar="FILE", help="also write the rows as CSV to FILE")
    a = ap.parse_args(argv)

    from lowmembp.plan import make_plan
    from lowmembp.plan.combos import parse_option_sweeps

    def names(text):
        return [n.strip() for n in text.split(",") if n.strip()] if text else None

    methods, combos = names(a.methods), None
    if methods and any("+" in m for m in methods):  # exact combinations, as every other command spells them
        if a.exclude or a.max_methods is not None:
            ap.error("--methods with a combination (a+b) plans exactly the entries named; leave out --exclude and "
                     "--max-methods, or name single methods to plan every combination of them")
        methods, combos = None, methods
    try:
        p = make_plan(a.model, batch_size=a.batch_size, gpu_memory=a.gpu_memory, seq_len=a.seq_len, dtype=a.dtype,
                 world_size=a.world_size, methods=methods, exclude=names(a.exclude), combos=combos,
                 max_methods=a.max_methods, options=parse_option_sweeps(a.option), margin=a.margin,
                 reserved=a.reserved, runs=a.runs, jobs=a.jobs, image_size=a.image_size,
                 more_gpus=names(a.also_gpu), weights=names(a.weights), progress=_progress if a.progress else "bar",
                 start_method=start_method, optimizer=names(a.optimizer), find=names(a.find))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}\n(python -m lowmembp.plan --help lists every option)", file=sys.stderr)
        return 2
    print(p.to_json() if a.json else p.table())
    if a.csv:
        p.to_csv(a.csv)
    if a.plot and any(r["status"] == "ok" for r in p.rows):
        p.plot(a.plot)
    if not any(r["status"] == "ok" for r in p.rows):
        reasons = sorted({f"{r['label']}: {r.get('reason') or r['status']}" for r in p.rows})
        print("error: nothing could be estimated:\n  " + "\n  ".join(reasons or ["no combination was run"]),
              file=sys.stderr)
        return 1
    return 0


def _max_methods(text: str):
    if text.strip().lower() == ALL:
        return ALL
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"give a positive number or {ALL}, not {text!r}")
    return n


def _start_method() -> str | None:
    """Workers forked from this process where the platform can: run as ``python -m lowmembp.plan`` nothing here has
    run a backward pass (which would stop autograd in a forked child), and the workers start without importing
    torch, transformers and peft again (~4 s sooner than from a fork server)."""
    import multiprocessing as mp
    return "fork" if "fork" in mp.get_all_start_methods() else None


def _progress(row: dict) -> None:
    from lowmembp.plan.report import _size

    what = (f"peak {_size(row['peak_bytes'])}, max batch {row['largest_batch']}" if row["status"] == "ok"
            else row["reason"])
    print(f"  {row['label']}: {what} ({row.get('seconds', 0):.1f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(start_method=_start_method()))

"""End to end on the CPU: the training step of LowMemoryBP and Mesa against the baseline's, on each default-sweep task.

    PYTHONPATH=$PWD python benchmarks/cpu_steps.py                    # the three tasks, batch 8, 1 thread
    PYTHONPATH=$PWD python benchmarks/cpu_steps.py --tasks mnist5k --batch-size 32 --rounds 10 --threads 2

For each task of the default sweep (config/config.yaml: mnist5k / vit-mnist, tweets-sentiment / minilm-l6,
tweets-lm / llama-tiny) it builds one run per method exactly as ``python -m experiments.train`` does
(:class:`experiments.train.Run`: the task's model and data, ``lowmembp.apply``, AdamW) and times whole optimizer
steps of all of them taken in turns in one process (:func:`lowmembp.measurement.timing.time_interleaved`, rotating
order), so
that every method sees the same load of a shared machine. It prints each method's median step time and its ratio to
the baseline's. Random initial weights (no ``--init``): the step time does not depend on them. The LowMemoryBP and
Mesa ops run as dispatched on CPU tensors (the CPU fast path); ``--reference`` runs them with
``LOWMEMBP_BACKEND=torch`` (the PyTorch references) for comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile

TASKS = {  # the default sweep's tasks, with its sequence lengths
    "mnist5k": ("vit-mnist", []),
    "tweets-sentiment": ("minilm-l6", ["--max-len", "32"]),
    "tweets-lm": ("llama-tiny", ["--max-len", "64"]),
}
METHODS = ["baseline", "lowmembp", "mesa"]


def build_runs(task: str, methods, batch_size: int, threads: int, out_dir: str):
    from experiments.args import parse_args
    from experiments.train import Run, new_sections

    model, extra = TASKS[task]
    runs = {}
    for method in methods:
        cfg, mod = parse_args(["--task", task, "--model", model, "--method", method, "--batch-size", str(batch_size),
                               "--steps", "100000", "--threads", str(threads), "--out",
                               os.path.join(out_dir, f"{task}-{method}.json"), *extra])
        runs[method] = Run(cfg, mod, new_sections(cfg))
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8, help="timed steps per method (medians reported)")
    p.add_argument("--reference", action="store_true", help="LOWMEMBP_BACKEND=torch: the PyTorch references")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.reference:
        os.environ["LOWMEMBP_BACKEND"] = "torch"
    import torch

    from lowmembp.measurement.timing import time_interleaved

    if "baseline" not in a.methods:
        p.error("--methods must include baseline (the ratios are to it)")
    from lowmembp.methods.registry import parse

    for method in a.methods:
        try:
            parse(method)
        except ValueError as err:
            p.error(str(err))
    print(f"torch {torch.__version__}; {a.threads} thread(s); batch {a.batch_size}; ops: "
          f"{'PyTorch references' if a.reference else 'as dispatched (CPU fast path)'}; "
          f"load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for task in a.tasks:
            runs = build_runs(task, a.methods, a.batch_size, a.threads, tmp)
            torch.set_num_threads(a.threads)
            steps = {m: (lambda r, run=run: run.step(r, contextlib.nullcontext())) for m, run in runs.items()}
            t = time_interleaved(steps, rounds=a.rounds, warmup=2, rotate=True)
            med = {m: statistics.median(v) for m, v in t.items()}
            base = med["baseline"]
            print(f"\n{task} ({TASKS[task][0]}), batch {a.batch_size}: median step ms (ratio to baseline)")
            for m in a.methods:
                print(f"  {m:10s} {med[m] * 1e3:9.1f}  {med[m] / base:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

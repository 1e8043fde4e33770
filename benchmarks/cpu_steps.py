"""End to end on the CPU: the training step of LowMemoryBP and Mesa against the baseline's, on each default-sweep task.

    PYTHONPATH=$PWD python benchmarks/cpu_steps.py                    # the three tasks, batch 8, 1 thread
    PYTHONPATH=$PWD python benchmarks/cpu_steps.py --tasks mnist5k --batch-size 32 --rounds 10 --threads 2
    PYTHONPATH=$PWD python benchmarks/cpu_steps.py --rounds 8 --out OUTDIR      # also as OUTDIR/cpu_steps.{md,csv}

For each task of the default sweep (config/config.yaml: mnist5k / vit-mnist, tweets-sentiment / minilm-l6,
tweets-lm / llama-tiny) it builds one run per method exactly as ``python -m experiments.train`` does
(:class:`experiments.train.Run`: the task's model and data, ``lowmembp.apply``, AdamW) and times whole optimizer
steps of all of them taken in turns in one process (:func:`lowmembp.measurement.timing.time_interleaved`, rotating
order), so that every method sees the same load of a shared machine. It prints each method's median step time and
its ratio to the baseline's. Random initial weights (no ``--init``): the step time does not depend on them. Every
method other than the baseline is timed twice in the same rounds: with the CPU fast path (``LOWMEMBP_BACKEND=cpu``,
what CPU tensors run by default) and with the PyTorch references (``LOWMEMBP_BACKEND=torch``, the oracle;
``--no-reference`` leaves them out, ``--reference`` times only them). ``--out DIR`` also writes the table as
``DIR/cpu_steps.{md,csv}``. As ``cpu_ops.py``, it holds freed memory in the process before timing
(``--malloc default``: glibc's own thresholds).
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
REFERENCE = "reference ops"  # the label of a method's second timing, with the PyTorch references


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
    p.add_argument("--no-reference", action="store_true", help="time only the CPU fast path, not the references")
    p.add_argument("--reference", action="store_true", help="time only the PyTorch references (no fast path)")
    p.add_argument("--out", default=None, help="also write the table as OUT/cpu_steps.{md,csv}")
    p.add_argument("--malloc", choices=["hold", "default"], default="hold",
                   help="hold: freed memory stays in the process for reuse (glibc; the default); default: glibc's own")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.environ.get("LOWMEMBP_BACKEND", "").strip().lower() not in ("", "auto"):
        p.error("unset LOWMEMBP_BACKEND: each timing sets its own (cpu, and torch for the references)")
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder's cpu_ops, also when loaded by path
    from cpu_ops import malloc_note, with_backend

    from lowmembp.measurement.timing import hold_freed_memory, time_interleaved

    if "baseline" not in a.methods:
        p.error("--methods must include baseline (the ratios are to it)")
    from lowmembp.methods.registry import parse

    for method in a.methods:
        try:
            parse(method)
        except ValueError as err:
            p.error(str(err))
    a.malloc_held = a.malloc == "hold" and hold_freed_memory()
    print(f"torch {torch.__version__}; {a.threads} thread(s); batch {a.batch_size}; "
          f"load average {os.getloadavg()}; {malloc_note(a.malloc_held)}", flush=True)
    table, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for task in a.tasks:
            runs = build_runs(task, a.methods, a.batch_size, a.threads, tmp)
            torch.set_num_threads(a.threads)
            steps = {}
            for m, run in runs.items():
                def step(r, run=run):
                    return run.step(r, contextlib.nullcontext())

                if m == "baseline" or not a.reference:
                    steps[m] = step if m == "baseline" else with_backend(step, "cpu")
                if m != "baseline" and not a.no_reference:
                    steps[f"{m}, {REFERENCE}"] = with_backend(step, "torch")
            t = time_interleaved(steps, rounds=a.rounds, warmup=2, rotate=True)
            med = {m: statistics.median(v) for m, v in t.items()}
            base = med["baseline"]
            print(f"\n{task} ({TASKS[task][0]}), batch {a.batch_size}: median step ms (ratio to baseline)")
            for m in steps:
                print(f"  {m:26s} {med[m] * 1e3:9.1f}  {med[m] / base:5.2f}x", flush=True)
                table.append({"task": task, "model": TASKS[task][0], "timed": m, "batch_size": a.batch_size,
                              "threads": a.threads, "step_ms_p50": med[m] * 1e3, "ratio_to_baseline": med[m] / base})
            load.append(os.getloadavg()[0])
    if a.out:
        write_table(table, load, a)
    return 0


def write_table(table: list[dict], load: list[float], a) -> None:
    import pandas as pd

    from bench_tables import write_benchmark_table  # main() put this folder on the path
    from cpu_ops import malloc_note

    df = pd.DataFrame(table)
    shown = pd.DataFrame({"task / model": [f"{t} / {m}" for t, m in zip(df["task"], df["model"])],
                          "method": df["timed"], "step p50 (ms)": df["step_ms_p50"].map("{:.1f}".format),
                          "ratio to baseline": df["ratio_to_baseline"].map("{:.2f}×".format)})
    write_benchmark_table(
        df, a.out, "cpu_steps", "Training steps on the CPU: LowMemoryBP and Mesa against the baseline, on each "
        "default-sweep task",
        caption=f"Whole AdamW training steps built as `python -m experiments.train` builds them, batch "
                f"{a.batch_size}, {a.threads} thread(s), every timing taken in turns in one process ({a.rounds} "
                "rounds after 2 warm-up, rotating order); median step time and its ratio to the baseline's. A method "
                f"runs the CPU fast path (the default on CPU tensors); '{REFERENCE}': the same run with the "
                "PyTorch references (LOWMEMBP_BACKEND=torch). Allocation: " + malloc_note(a.malloc_held) + ".",
        command="PYTHONPATH=$PWD python benchmarks/cpu_steps.py " + " ".join(sys.argv[1:]), load=load,
        parts=[("", shown, "steps")])


if __name__ == "__main__":
    sys.exit(main())

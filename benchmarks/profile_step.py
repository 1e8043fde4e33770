"""Where a training step's time goes: host time per op and device time per kernel, for cells of the training job.

    PYTHONPATH=$PWD python benchmarks/profile_step.py --out results/gpu/profile \\
        --cell lora="--task cifar100 --model vit-b16 --method lora --lora-targets qkv --batch-size 64 --dtype fp16 \\
                     --synthetic-data" \\
        --cell lowmembp="--task cifar100 --model vit-b16 --method lora+lowmembp --lora-targets qkv --batch-size 64 \\
                         --dtype fp16 --synthetic-data"

Each cell (the training job's own, ``experiments.train.Run``) takes ``--warmup`` steps, then ``--steps`` steps under
``torch.profiler`` (CPU, and CUDA where the cell runs on a GPU). Written per cell, into ``--out``:

- ``<cell>.md``: the step's wall time, the device's busy time (the kernels' summed time) and their ratio (below 1:
  the device waits for the host), then the ops by their self host time and the kernels by their device time, per
  step (top ``--top`` of each), with their calls per step;
- ``<cell>.json``: the same figures for a script; ``<cell>.trace.json`` with ``--trace`` (chrome://tracing).

The prepared GPU run calls it after Fig. 1 (part ``profile``), so that a missed speed target comes with where the
time went.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def profile_cell(name: str, argv: list[str], out: Path, warmup: int, steps: int, top: int, trace: bool) -> dict:
    """Build the cell, take ``warmup`` steps, profile ``steps`` steps; write ``out/<name>.{md,json}``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from experiments.args import parse_args
    from experiments.train import Run, new_sections

    cfg, task = parse_args(list(argv) + ["--out", str(out / f"{name}.record.json")])
    run = Run(cfg, task, new_sections(cfg))
    cuda = run.device.type == "cuda"
    for s in range(warmup):
        run.step(s, contextlib.nullcontext())
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for s in range(warmup, warmup + steps):
            run.step(s, contextlib.nullcontext())
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()

    def device_us(e):
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    kernels = sorted((e for e in events if device_us(e) > 0), key=device_us, reverse=True)
    busy = sum(device_us(e) for e in kernels) / steps / 1e6
    facts = {
        "cell": name, "argv": argv, "device": str(run.device), "steps": steps, "warmup": warmup,
        "step_wall_s": wall, "device_busy_s": busy if cuda else None,
        "device_busy_fraction": busy / wall if cuda and wall > 0 else None,
        "host_ops": [{"name": e.key, "calls_per_step": e.count / steps,
                      "self_host_us_per_step": e.self_cpu_time_total / steps} for e in host],
        "kernels": [{"name": e.key, "calls_per_step": e.count / steps,
                     "device_us_per_step": device_us(e) / steps} for e in kernels[:top]],
    }
    lines = [f"# {name}", "", f"`{shlex.join(argv)}` on {run.device}, {steps} profiled steps after {warmup}.", "",
             f"- step wall time: {wall * 1e3:.2f} ms"]
    if cuda:
        lines.append(f"- device busy: {busy * 1e3:.2f} ms ({busy / wall:.0%} of the step; below 100 %: the device "
                     "waits for the host)")
    lines += ["", "| op (host) | calls / step | self host µs / step |", "|---|---|---|"]
    lines += [f"| `{r['name'][:70]}` | {r['calls_per_step']:.0f} | {r['self_host_us_per_step']:.0f} |"
              for r in facts["host_ops"]]
    if cuda:
        lines += ["", "| kernel (device) | calls / step | device µs / step |", "|---|---|---|"]
        lines += [f"| `{r['name'][:70]}` | {r['calls_per_step']:.0f} | {r['device_us_per_step']:.0f} |"
                  for r in facts["kernels"]]
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".md", "\n".join(lines) + "\n"), (".json", json.dumps(facts, indent=1))):
        tmp = out / f".{name}{suffix}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / f"{name}{suffix}")
    if trace:
        prof.export_chrome_trace(str(out / f"{name}.trace.json"))
    return facts


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cell", action="append", default=[], metavar='NAME="JOB ARGS"',
                   help="a training-job cell: its name and its arguments (without --out); repeat for more")
    p.add_argument("--out", required=True, help="folder for <cell>.md / .json")
    p.add_argument("--warmup", type=int, default=5, help="steps before profiling (default 5)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    p.add_argument("--top", type=int, default=25, help="rows of each table (default 25)")
    p.add_argument("--trace", action="store_true", help="also a chrome trace per cell")
    a = p.parse_args(argv)
    cells = {}
    for c in a.cell:
        name, sep, args = c.partition("=")
        if not sep or not name.strip() or not args.strip():
            p.error(f'--cell takes NAME="JOB ARGS", got {c!r}')
        cells[name.strip()] = shlex.split(args)
    if not cells:
        p.error("give at least one --cell")
    if a.warmup < 0 or a.steps < 1 or a.top < 1:
        p.error("--warmup must be >= 0, --steps and --top >= 1")
    a.cells = cells
    return a


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(ROOT))
    failed = 0
    for name, job in a.cells.items():
        try:
            f = profile_cell(name, job, Path(a.out), a.warmup, a.steps, a.top, a.trace)
            busy = f"device busy {f['device_busy_fraction']:.0%}" if f["device_busy_fraction"] is not None else ""
            print(f"{name}: step {f['step_wall_s'] * 1e3:.2f} ms {busy}", flush=True)
        except Exception as e:  # one cell's failure is reported; the others go on
            failed += 1
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

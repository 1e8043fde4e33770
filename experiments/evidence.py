"""Evidence that the methods keep accuracy and what they cost in CPU step time, on ``tweets-sentiment``.

    python -m experiments.evidence [--steps 40] [--batch-size 8] [--seeds 0 1 2] [--out-dir results/evidence]

Runs ``python -m experiments.train`` for every method × seed (seed-major order, so every method sees the same machine
load within a seed), one record each under ``--out-dir`` (existing records are reused unless ``--fresh``), then prints a
markdown table: test accuracy per seed, mean ± sd, the gap to baseline in points, and CPU step time.

Step time is measured apart, in one process, with every method's model built side by side and their training steps
interleaved (one step of each method per round, the order rotated each round, the same batch for all in a round),
so that all methods see the same machine load: on a shared machine, separate runs minutes apart are not comparable.
The ratio to baseline is the median over rounds of (method's step time / baseline's step time in that round).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

METHODS = ("baseline", "lowmembp", "mesa", "tokentune", "checkpointing")


def run_all(args) -> dict:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records: dict = {}
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for seed in args.seeds:
        for method in args.methods:
            path = out / f"{method}-s{seed}.json"
            if args.fresh or not path.exists():
                cmd = [sys.executable, "-m", "experiments.train", "--task", "tweets-sentiment", "--model", "minilm-l6",
                       "--method", method, "--batch-size", str(args.batch_size), "--seed", str(seed),
                       "--steps", str(args.steps), "--eval-limit", str(args.eval_limit), "--max-len",
                       str(args.max_len), "--no-progress", "--out", str(path)]
                if method == "tokentune":
                    cmd += ["--k", str(args.k)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                print(done.stdout.strip() or done.stderr.strip()[-2000:], file=sys.stderr, flush=True)
            if path.exists():
                records[(method, seed)] = json.loads(path.read_text())
    return records


def interleaved_step_times(methods, k: int, batch_size: int, max_len: int, rounds: int, warmup: int = 2) -> dict:
    """{method: [seconds per training step, one per round]} with the methods' steps interleaved (see module doc)."""
    import torch

    import lowmembp
    from experiments.tasks import tweets_sentiment
    from lowmembp.measurement.timing import time_interleaved

    cfg = argparse.Namespace(seed=0, limit=None, eval_limit=8, max_len=max_len)
    built = {}
    for m in methods:
        torch.manual_seed(0)
        setup = tweets_sentiment.build("minilm-l6", cfg)
        model = lowmembp.apply(setup.model, m, **({"k": k} if m == "tokentune" else {}))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        built[m] = (setup, model, opt)
    setup = built[methods[0]][0]
    batches = [setup.collate(setup.train[i * batch_size:(i + 1) * batch_size]) for i in range(rounds + warmup)]

    def step(setup, model, opt):
        def run(r):
            setup.loss(model, batches[r]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    return time_interleaved({m: step(*built[m]) for m in methods}, rounds=rounds, warmup=warmup, rotate=True)


def table(records: dict, methods, seeds, k: int, times: dict) -> str:
    def acc(m, s):
        r = records.get((m, s))
        return r["metric"]["value"] * 100 if r and r["status"] == "ok" else None

    head = ("| method | " + " | ".join(f"acc seed {s} (%)" for s in seeds)
            + " | mean ± sd (%) | vs baseline (points) | step p50 (ms) | step time / baseline |")
    lines = [head, "|" + "---|" * (len(seeds) + 5)]
    base = [acc("baseline", s) for s in seeds]
    base_mean = statistics.mean([a for a in base if a is not None]) if any(a is not None for a in base) else None
    for m in methods:
        accs = [acc(m, s) for s in seeds]
        have = [a for a in accs if a is not None]
        mean = statistics.mean(have) if have else None
        sd = statistics.stdev(have) if len(have) > 1 else 0.0
        ratios = [t / b for t, b in zip(times.get(m, []), times.get("baseline", []))]
        step = times.get(m, [])
        name = f"{m} (k={k})" if m == "tokentune" else m
        cells = [f"{a:.1f}" if a is not None else "—" for a in accs]
        cells.append(f"{mean:.1f} ± {sd:.1f}" if mean is not None else "—")
        cells.append(f"{mean - base_mean:+.1f}" if mean is not None and base_mean is not None else "—")
        cells.append(f"{statistics.median(step) * 1e3:.0f}" if step else "—")
        cells.append(f"{statistics.median(ratios):.2f}" if ratios else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.evidence", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-limit", type=int, default=500)
    p.add_argument("--max-len", type=int, default=48)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--out-dir", default="results/evidence")
    p.add_argument("--fresh", action="store_true", help="rerun cells whose record exists")
    p.add_argument("--timing-rounds", type=int, default=10, help="interleaved timing rounds (0: no timing)")
    args = p.parse_args(argv)
    records = run_all(args)
    times = {}
    if args.timing_rounds > 0:
        if "baseline" not in args.methods:
            args.methods = ["baseline", *args.methods]
        times = interleaved_step_times(args.methods, args.k, args.batch_size, args.max_len, args.timing_rounds)
    print(f"tweets-sentiment, minilm-l6, batch {args.batch_size}, {args.steps} steps, max length {args.max_len}, "
          f"test accuracy on {args.eval_limit} fixed test tweets (chance 42.4 %), CPU fp32; step time: median of "
          f"{args.timing_rounds} interleaved rounds (torch threads {torch_threads()})\n")
    print(table(records, args.methods, args.seeds, args.k, times))
    bad = [f"{m}-s{s}: {r['status']} {r['message']}" for (m, s), r in records.items() if r["status"] != "ok"]
    if bad:
        print("\nnot ok:\n" + "\n".join(bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())

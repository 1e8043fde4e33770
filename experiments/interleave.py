"""Several cells of the training job in one process, their timed steps taken in turns: the one timing protocol
(``lowmembp.measurement.timing``) applied to cells that are compared with each other.

    python -m experiments.interleave --rounds 20 --out-dir runs/ \
        --cell lora="--task cifar100 --model vit-b16 --method lora --batch-size 64 --dtype fp16 --synthetic-data" \
        --cell lowmembp="--task cifar100 --model vit-b16 --method lora+lowmembp --batch-size 64 ..."
    records, ratios = run_cells({"lora": argv_a, "lowmembp": argv_b}, rounds=20, out_dir="runs/")

Each cell is the training job's own (``experiments.train.Run``: the task's setup, the method, the optimizer, the step,
``--capture``), built one after the other, each taking its own steps 0 and 1 right after its build (saved bytes, then
the peak of a whole step) and the capture's warm-up where it has one. Then ``--warmup-rounds`` untimed rounds and
``--rounds`` timed rounds: one step of every cell per round (``time_interleaved``; CUDA events on a GPU), so a
drift of the machine hits every cell alike. Each cell's record is the job's (``experiments/record.py``, written
atomically to ``<out-dir>/<name>.json``) with ``step_time_s`` from its rounds (median and 95 % interval) and a note
saying so; ``ratios`` holds every cell's step-time ratio to the first cell, per round, with its interval.

Peaks with other cells resident: on CUDA a cell's peak is the allocator's peak during its step 1 less what was
allocated before its build (the cells built before it, which do not change while it steps), so it is the cell's own;
``reserved_bytes`` is the process's (all cells). On a CPU the storage tracker counts the step's own tensors only.
``transform``: ``{name: fn(model) -> None}`` applied to a cell's model after the job built it (the GPU run swaps the
official CUDA ops into a LowMemoryBP ViT that way).
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path


def _adjust_peak(sections: dict, baseline: int) -> None:
    dev = (sections.get("peak") or {}).get("device")
    if not dev or baseline <= 0:
        return
    dev["bytes"] = int(dev["bytes"]) - baseline
    cats = dev.get("by_category") or {}
    if "activations_and_temporaries" in cats:
        cats["activations_and_temporaries"] = max(0, int(cats["activations_and_temporaries"]) - baseline)
    dev["how"] = f"{dev['how']} less {baseline} bytes allocated before this cell's build (other cells resident)"


def run_cells(cells: dict[str, list[str]], *, rounds: int, warmup_rounds: int = 2, out_dir: str | Path,
              transform: dict | None = None, progress=print) -> tuple[dict[str, dict], dict[str, dict]]:
    """Build, probe, then time ``cells`` (``{name: training-job arguments without --out}``) round by round; write one
    record per cell. Returns ``(records, ratios)``: ``{name: record dict}`` and ``{name: ratio_interval of its step
    times to the first cell's}``. A cell that fails to build or step gets an ``error`` / ``oom`` record and leaves
    the rounds; the others go on."""
    import torch

    from experiments.args import parse_args
    from experiments.record import now, write
    from experiments.train import Run, finish, is_oom, new_sections
    from lowmembp.measurement.timing import median_interval, ratio_interval, summarize, time_interleaved

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    built, records, failed = {}, {}, {}
    for name, argv in cells.items():
        out = out_dir / f"{name}.json"
        cfg, task = parse_args(list(argv) + ["--out", str(out)])
        sections, started = new_sections(cfg), now()
        try:
            cuda = (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
            if cuda:
                torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated() if cuda else 0
            run = Run(cfg, task, sections)
            if transform and name in transform:
                transform[name](run.model)
            probes = [p for p in run.probes() if type(p).__name__ != "StepTimer"]
            from experiments.probes import run_step

            losses = []
            first_timed = run.schedule.time_from
            for step in range(first_timed):  # the probes' steps, the capture's warm-up and capture
                losses.append(run_step(step, lambda forward, s=step: run.step(s, forward), probes).loss)
            for p in probes:
                p.report(sections)
            _adjust_peak(sections, baseline)
            built[name] = dict(cfg=cfg, run=run, sections=sections, started=started, losses=losses, step=first_timed,
                               out=out)
            progress(f"  {name}: built, {first_timed} steps (probes, warm-up)")
        except Exception as err:  # the cell is recorded; the others go on
            failed[name] = (cfg, sections, started, "oom" if is_oom(err) else "error", f"{type(err).__name__}: {err}")
            progress(f"  {name}: {failed[name][3]}: {failed[name][4][:300]}")
            with contextlib.suppress(Exception):  # a failed capture may leave CUDA refusing even this
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    def stepper(name):
        b = built[name]

        def one(_round):
            if "failed" in b:  # a cell that failed in an earlier round sits the others out
                return
            try:
                result = b["run"].step(b["step"], contextlib.nullcontext())
            except Exception as err:
                b["failed"] = ("oom" if is_oom(err) else "error", f"{type(err).__name__}: {err} (step {b['step']})")
                progress(f"  {name}: {b['failed'][0]} in the rounds: {b['failed'][1][:300]}")
                return
            b["losses"].append(result.loss)
            b["step"] += 1
        return one

    device = next((b["run"].device for b in built.values()), "cpu")
    times = time_interleaved({n: stepper(n) for n in built}, rounds=rounds, warmup=warmup_rounds, rotate=True,
                             device=device) if built else {}
    for name in [n for n, b in built.items() if "failed" in b]:
        b = built.pop(name)
        failed[name] = (b["cfg"], b["sections"], b["started"], *b["failed"])
        b["sections"]["run"]["steps"] = b["step"]
    for name, b in built.items():
        cfg, sections, run = b["cfg"], b["sections"], b["run"]
        ts = times[name]
        stats = summarize(ts, ("cuda events" if run.device.type == "cuda" else "perf_counter")
                          + f", interleaved with {len(built) - 1} other cells, {rounds} rounds after "
                            f"{warmup_rounds} untimed")
        ci = median_interval(ts)
        sections["step_time_s"] = dict(stats, ci95_low=ci["low"], ci95_high=ci["high"])
        samples = cfg.batch_size
        tok = run.setup.tokens(next(run.batches))
        sections["throughput"] = {"samples_per_s": samples / stats["p50"],
                                  "tokens_per_s": tok / stats["p50"] if tok else None}
        sections["run"]["steps"] = b["step"]
        tail = b["losses"][-10:]
        sections["final_loss"] = float(sum(tail) / len(tail)) if tail else None
        if not getattr(cfg, "synthetic_data", False):
            sections["metric"] = {"name": run.setup.metric, "value": run.evaluate(),
                                  "split": f"test ({len(run.setup.test)})"}
        else:
            sections.setdefault("notes", []).append("synthetic data: no metric (generated inputs are not evaluated)")
        sections.setdefault("notes", []).append(
            f"experiments.interleave: step times over {rounds} rounds taken in turns with {', '.join(built)}; "
            "throughput at the median step")
        rec = finish(cfg, sections, "ok", None, b["started"])
        write(rec, b["out"])
        records[name] = rec
    for name, (cfg, sections, started, status, message) in failed.items():
        rec = finish(cfg, sections, status, message, started)
        write(rec, out_dir / f"{name}.json")
        records[name] = rec
    ratios = {}
    names = list(built)
    if names:
        ref = times[names[0]]
        ratios = {n: ratio_interval(times[n], ref) for n in names}
    return records, ratios


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.interleave", description=__doc__.splitlines()[0])
    p.add_argument("--cell", action="append", required=True, metavar="NAME=ARGS",
                   help="a cell: its name, '=', the training job's arguments (without --out) in one string")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--out-dir", required=True)
    a = p.parse_args(argv)
    cells = {}
    for c in a.cell:
        name, sep, args = c.partition("=")
        if not sep or not name:
            p.error(f"--cell {c!r}: expected NAME=ARGS")
        cells[name] = shlex.split(args)
    from experiments.args import ArgError

    try:
        records, ratios = run_cells(cells, rounds=a.rounds, warmup_rounds=a.warmup_rounds, out_dir=a.out_dir)
    except ArgError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, rec in records.items():
        r = ratios.get(name)
        extra = f"  time ratio {r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" if r else ""
        print(f"{name}: {rec['status']} peak {((rec['peak']['device'] or {}).get('bytes') or 0) / 2**20:.0f} MiB"
              + extra)
    return 0 if all(r["status"] == "ok" for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

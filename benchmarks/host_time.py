"""Host time of one op call: ours beside the native op it replaces (and, on a GPU, the official CUDA extension).

    PYTHONPATH=$PWD python benchmarks/host_time.py                          # CPU: the fast path vs the native ops
    PYTHONPATH=$PWD python benchmarks/host_time.py --device cuda --official third_party/lomem --build-dir /tmp/lb
    PYTHONPATH=$PWD python benchmarks/host_time.py --rounds 21 --out results/reference/benchmarks  # + .md, .csv

What is timed: the wall time of ``--calls`` calls made back to back, per call, for one forward (``fwd``) or one
forward + backward (``fwd+bwd``, ``torch.autograd.grad``), with no synchronisation inside the loop. On the CPU that is
the whole cost of a call; on a GPU, where the calls only enqueue kernels, it is the host's cost (Python, the
dispatcher, the launches), which bounds a small model's step when it exceeds the kernels' time. Beside it, on a GPU,
the device time per call: the same calls enqueued behind a sleeping kernel (so that the device starts only once the
host has queued them all) and timed with CUDA events, which is the kernels' time alone.

Implementations, taken in turns round by round (``--rounds``, rotating order, warm-up discarded): ``ours`` (the
module a converted model holds: :class:`~lowmembp.ops.ReGELU2`, :class:`~lowmembp.ops.ReSiLU2`,
:class:`~lowmembp.ops.MSLayerNorm`, :class:`~lowmembp.ops.MSRMSNorm`), ``native`` (``F.gelu`` / ``F.silu`` /
``F.layer_norm`` / ``F.rms_norm`` without affine: what the model ran before) and, on a GPU with ``--official``,
``official`` (the official LowMemoryBP extension, benchmarks/official_lomem.py). Each figure is the median over the
rounds with its 95 % interval; ``ours - native`` and ``ours / best`` are taken per round (paired) and summarised the
same way (lowmembp.measurement.timing.median_interval / ratio_interval). Autocast: ``--autocast`` adds rows with the
inputs in fp32 under fp16 autocast (the Fig. 1 setting), where our ops emit fp16.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # official_lomem beside this file

from lowmembp.measurement.timing import hold_freed_memory, median_interval, ratio_interval
from lowmembp.ops import MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_SHAPES = [(1, 8), (8, 17, 64)]
CUDA_SHAPES = [(1, 8), (8, 17, 64), (64, 197, 768)]  # the last: ViT-B/16 at batch 64 (Fig. 1), a norm's input
OPS = ("regelu2", "resilu2", "ms-layernorm", "ms-rmsnorm")
COLUMNS = ["device", "op", "shape", "dtype", "autocast", "pass", "impl", "host_us", "host_low", "host_high",
           "device_us", "over_native_us", "over_low", "over_high", "ratio_best", "ratio_low", "ratio_high", "rounds",
           "calls"]


def _ours(op: str, n: int) -> torch.nn.Module:
    return {"regelu2": ReGELU2, "resilu2": ReSiLU2}[op]() if op in ("regelu2", "resilu2") else \
        (MSLayerNorm(n, eps=1e-5) if op == "ms-layernorm" else MSRMSNorm(n, eps=1e-6))


def _native(op: str, n: int):
    if op == "regelu2":
        return F.gelu
    if op == "resilu2":
        return F.silu
    if op == "ms-layernorm":
        return lambda x: F.layer_norm(x, (n,), eps=1e-5)
    return lambda x: F.rms_norm(x, (n,), eps=1e-6)


def _official(ops, op: str):
    return {"regelu2": ops.regelu2, "resilu2": ops.resilu2, "ms-layernorm": lambda x: ops.layer_norm(x, 1e-5),
            "ms-rmsnorm": lambda x: ops.rms_norm(x, 1e-6)}[op]


def _call(fn, x, dy, backward: bool, autocast: bool, device: str):
    """One call of fn: the forward, and the backward through torch.autograd.grad when asked."""
    if autocast:
        with torch.autocast(device, dtype=torch.float16):
            y = fn(x)
    else:
        y = fn(x)
    if backward:
        torch.autograd.grad(y, x, dy.to(y.dtype))


def host_seconds(fn, x, dy, backward, autocast, device, calls) -> float:
    """Wall seconds per call of ``calls`` calls made back to back (no synchronisation inside; the device, if any,
    drained before the clock starts)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        _call(fn, x, dy, backward, autocast, device)
    return (time.perf_counter() - t0) / calls


def device_seconds(fn, x, dy, backward, autocast, calls) -> float:
    """Kernel seconds per call on the GPU: the calls enqueued behind a sleeping kernel, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(int(2e7))  # ~10 ms of device time: long enough for the host to enqueue every call behind it
    start.record()
    for _ in range(calls):
        _call(fn, x, dy, backward, autocast, "cuda")
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def case_rows(device, op, shape, dtype_name, autocast, backward, impls, rounds, calls, warmup=2):
    """The rows of one case: each implementation's host time (and device time) over ``rounds`` rounds taken in
    turns, with ``ours``'s excess over native and its ratio to the fastest other implementation, paired by round."""
    dtype = torch.float32 if autocast else DTYPES[dtype_name]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype).requires_grad_(backward)
    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    names = list(impls)
    host = {k: [] for k in names}
    dev = {k: [] for k in names}
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            t = host_seconds(impls[k], x, dy, backward, autocast, device, calls)
            if r >= warmup:
                host[k].append(t)
                if device == "cuda":
                    dev[k].append(device_seconds(impls[k], x, dy, backward, autocast, calls))
    rows = []
    others = [k for k in names if k != "ours"]
    best = min(others, key=lambda k: statistics.median(host[k])) if others else None
    for k in names:
        m = median_interval(host[k])
        row = dict(device=device, op=op, shape="x".join(map(str, shape)),
                   dtype="fp32+amp16" if autocast else dtype_name,
                   autocast=autocast, **{"pass": "fwd+bwd" if backward else "fwd"}, impl=k,
                   host_us=m["median"] * 1e6, host_low=m["low"] * 1e6, host_high=m["high"] * 1e6,
                   device_us=statistics.median(dev[k]) * 1e6 if dev[k] else None, rounds=rounds, calls=calls)
        if k == "ours" and "native" in host:
            diff = median_interval([a - b for a, b in zip(host["ours"], host["native"])])
            row.update(over_native_us=diff["median"] * 1e6, over_low=diff["low"] * 1e6, over_high=diff["high"] * 1e6)
        if k == "ours" and best is not None:
            ratio = ratio_interval(host["ours"], host[best])
            row.update(ratio_best=ratio["median"], ratio_low=ratio["low"], ratio_high=ratio["high"])
        rows.append(row)
    return rows


def _fmt(v, digits=1):
    return "" if v is None or v == "" else f"{v:.{digits}f}"


def markdown(rows, header: str) -> str:
    """The table: per case ours, native (and official) host µs, ours' excess over native with its interval, and on
    a GPU the device µs."""
    cuda = any(r["device"] == "cuda" for r in rows)
    cases: dict = {}
    for r in rows:
        cases.setdefault((r["op"], r["shape"], r["dtype"], r["pass"]), {})[r["impl"]] = r
    head = ["op", "shape", "dtype", "pass", "ours µs", "native µs"] + (["official µs"] if cuda else []) + \
        ["ours − native µs (95 %)", "ours / fastest"] + (["ours device µs"] if cuda else [])
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, shape, dtype, pas), c in cases.items():
        o, n, off = c.get("ours"), c.get("native"), c.get("official")
        cells = [op, shape, dtype, pas, _fmt(o and o["host_us"]), _fmt(n and n["host_us"])]
        if cuda:
            cells.append(_fmt(off and off["host_us"]))
        over = f"{_fmt(o['over_native_us'])} [{_fmt(o['over_low'])}, {_fmt(o['over_high'])}]" \
            if o and o.get("over_native_us") is not None else ""
        ratio = f"{_fmt(o['ratio_best'], 2)} [{_fmt(o['ratio_low'], 2)}, {_fmt(o['ratio_high'], 2)}]" \
            if o and o.get("ratio_best") is not None else ""
        cells += [over, ratio]
        if cuda:
            cells.append(_fmt(o and o["device_us"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--dtypes", default=None, help="comma-separated (default: fp32,bf16 on the CPU, + fp16 on CUDA)")
    p.add_argument("--rounds", type=int, default=11, help="rounds per case, taken in turns (default 11)")
    p.add_argument("--calls", type=int, default=200, help="calls per timing (default 200)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--autocast", action="store_true", help="also fp32 inputs under fp16 autocast (CUDA)")
    p.add_argument("--official", default=None, help="the official lomem sources (third_party/lomem): a GPU column")
    p.add_argument("--build-dir", default=None, help="their build folder (see benchmarks/official_lomem.py)")
    p.add_argument("--out", default=None, help="also write OUT/host_time.{md,csv} (host_time_cuda.* on a GPU)")
    a = p.parse_args(argv)
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    bad = [o for o in a.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    a.dtypes = [d.strip() for d in (a.dtypes or ("fp32,bf16,fp16" if a.device == "cuda" else "fp32,bf16")).split(",")]
    if any(d not in DTYPES for d in a.dtypes):
        p.error(f"--dtypes: choose from {', '.join(DTYPES)}")
    if a.rounds < 1 or a.calls < 1:
        p.error("--rounds and --calls must be >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return a


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(a.threads)
    held = hold_freed_memory() if a.device == "cpu" else False
    official = None
    if a.official and a.device == "cuda":
        from official_lomem import load_official
        official = load_official(a.official, a.build_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                                          "lowmembp_lomem_build"))
    shapes = CUDA_SHAPES if a.device == "cuda" else CPU_SHAPES
    rows = []
    cases = [(op, s, d, ac, bw) for op in a.ops for s in shapes for d in a.dtypes for ac in (False,)
             for bw in (False, True)]
    if a.autocast and a.device == "cuda":
        cases += [(op, s, "fp32", True, bw) for op in a.ops for s in shapes for bw in (False, True)]
    for i, (op, shape, dt, ac, bw) in enumerate(cases, 1):
        n = shape[-1]
        impls = {"ours": _ours(op, n).to(a.device), "native": _native(op, n)}
        if official is not None:
            impls["official"] = _official(official, op)
        try:
            rows += case_rows(a.device, op, shape, dt, ac, bw, impls, a.rounds, a.calls)
        except Exception as e:  # one case's failure (e.g. a dtype the official op lacks) is reported, not fatal
            print(f"  {op} {shape} {dt}: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"\r[{i}/{len(cases)}] {op} {shape} {dt}{' amp' if ac else ''} {'fwd+bwd' if bw else 'fwd'}",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    name = torch.cuda.get_device_name() if a.device == "cuda" else (platform.processor() or platform.machine())
    header = (f"Host time per call on {name} ({a.device}, torch {torch.__version__}, {a.threads} thread(s)"
              f"{', freed memory held' if held else ''}): median of {a.rounds} rounds x {a.calls} calls, "
              f"`python benchmarks/host_time.py --device {a.device} --rounds {a.rounds} --calls {a.calls}`.")
    table = markdown(rows, header)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = "host_time" if a.device == "cpu" else "host_time_cuda"
        tmp = out / f".{stem}.csv.tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS, extrasaction="ignore", restval="")
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, out / f"{stem}.csv")
        (out / f".{stem}.md.tmp").write_text(table)
        os.replace(out / f".{stem}.md.tmp", out / f"{stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

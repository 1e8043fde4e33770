"""Host time of ReGELU2 / ReSiLU2 on the CPU by route, interleaved in one process: native, C++ node, Python route.

    PYTHONPATH=$PWD python benchmarks/host_time_node.py --rounds 21 --out results/host_time_node

The same protocol as benchmarks/host_time.py (its ``_call``: ``y = fn(x)``, then ``torch.autograd.grad(y, x, dy)``
for fwd+bwd; ``--calls`` calls per timing, 2 warm-up rounds, the order rotating per round, 1 torch thread, freed
memory held), with ``ours`` (the module a converted model holds) timed twice: through the C++ autograd node
(``node``) and with it turned off (``python``: the route before the node, lowmembp.ops.approx_act_cpu.fwd_node
returning None). Two clocks per timing: wall (perf_counter, as host_time.py) and the thread's CPU time, which other
processes sharing the cores cannot inflate. Figures: medians with the 95 % interval of
lowmembp.measurement.timing.median_interval; differences paired by round.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_time import DTYPES, _call, _native, _ours  # noqa: E402

from lowmembp.measurement.timing import hold_freed_memory, median_interval  # noqa: E402
from lowmembp.ops import approx_act_cpu  # noqa: E402


def _timed(fn, x, dy, backward, calls):
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        _call(fn, x, dy, backward, False, "cpu")
    return (time.perf_counter() - w0) / calls, (time.thread_time() - c0) / calls


def case(op, shape, dtype, backward, rounds, calls, warmup=2):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(DTYPES[dtype]).requires_grad_(backward)
    dy = torch.randn(shape, generator=gen).to(DTYPES[dtype])
    ours = _ours(op, shape[-1])
    node = approx_act_cpu._node_setup()
    routes = {"native": (_native(op, shape[-1]), node), "node": (ours, node), "python": (ours, None)}
    names = list(routes)
    t = {k: {"wall": [], "cpu": []} for k in names}
    for r in range(warmup + rounds):
        for k in names[r % 3:] + names[:r % 3]:
            fn, ext = routes[k]
            approx_act_cpu._NODE[:] = [ext]
            wall, cpu = _timed(fn, x, dy, backward, calls)
            if r >= warmup:
                t[k]["wall"].append(wall * 1e6)
                t[k]["cpu"].append(cpu * 1e6)
    approx_act_cpu._NODE[:] = [node]
    out = {"op": op, "shape": "x".join(map(str, shape)), "dtype": dtype, "pass": "fwd+bwd" if backward else "fwd"}
    for clock in ("wall", "cpu"):
        for k in names:
            out[f"{k}_{clock}"] = median_interval(t[k][clock])
        for k in ("node", "python"):
            out[f"{k}-native_{clock}"] = median_interval([a - b for a, b in zip(t[k][clock], t["native"][clock])])
        out[f"node-python_{clock}"] = median_interval([a - b for a, b in zip(t["node"][clock], t["python"][clock])])
    return out


def _fmt(m):
    return f"{m['median']:+.1f} [{m['low']:+.1f}, {m['high']:+.1f}]"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="regelu2,resilu2")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--passes", default="fwd+bwd", help="comma-separated of fwd, fwd+bwd")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    held = hold_freed_memory()
    rows = [case(op, shape, dt, ps == "fwd+bwd", a.rounds, a.calls) for op in a.ops.split(",")
            for shape in [(1, 8), (8, 17, 64)] for dt in a.dtypes.split(",") for ps in a.passes.split(",")]
    lines = [f"Host time per call, µs (torch {torch.__version__}, 1 thread, freed memory held: {held}; "
             f"{a.rounds} rounds x {a.calls} calls; load average before/after: {LOAD0} / {os.getloadavg()})", "",
             "| op | shape | dtype | pass | clock | native | node | python | node − native | python − native "
             "| node − python |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for clock in ("cpu", "wall"):
            lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['pass']} | {clock} | "
                         f"{r[f'native_{clock}']['median']:.1f} | {r[f'node_{clock}']['median']:.1f} | "
                         f"{r[f'python_{clock}']['median']:.1f} | {_fmt(r[f'node-native_{clock}'])} | "
                         f"{_fmt(r[f'python-native_{clock}'])} | {_fmt(r[f'node-python_{clock}'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "host_time_node.md").write_text(text)
        (a.out / "host_time_node.json").write_text(json.dumps(rows, indent=1))


LOAD0 = os.getloadavg()
if __name__ == "__main__":
    main()

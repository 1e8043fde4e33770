"""CPU forward+backward of LowMemoryBP's ops and Mesa's 8-bit quantiser against the native ops, with the roofline.

    PYTHONPATH=$PWD python benchmarks/cpu_ops.py                      # every op, fp32 and bf16, 1 and 2 threads
    PYTHONPATH=$PWD python benchmarks/cpu_ops.py --ops regelu2 --dtypes fp32 --threads 1 --rounds 5

    PYTHONPATH=$PWD python benchmarks/cpu_ops.py --rounds 9 --out OUTDIR        # also as OUTDIR/cpu_ops.{md,csv}

For each op, shape, dtype and thread count it times one forward + backward (``torch.autograd.grad``) of

- ``ours``: the CPU fast path (``LOWMEMBP_BACKEND=cpu``, what CPU tensors run by default),
- ``ref``: the PyTorch reference (``LOWMEMBP_BACKEND=torch``), the oracle the fast path equals bit for bit,
- ``native``: the op it replaces (``F.gelu`` / ``F.silu`` / ``F.layer_norm`` / ``F.rms_norm``, no affine); for
  Mesa there is no native op: ``native`` is then a plain ``copy_`` of the input into a fresh tensor (the baseline's
  step does not have these passes at all),

taken in turns in one process (:func:`lowmembp.measurement.timing.time_interleaved`, rotating order) and reports the
medians,
``ours / native`` and ``ref / native``. The machine's copy bandwidth is measured first (a ``copy_`` of a 256 MiB
tensor, read + write counted); ``bytes`` is what the op must move at least (forward + backward), ``roof ms`` that
divided by the bandwidth, and ``ours/roof`` how far from the memory limit ours runs. On a shared machine the medians
move with the load; the ratios, taken in turns, are the figures to read. ``--out DIR`` also writes the table as
``DIR/cpu_ops.{md,csv}`` (one part per thread count; the machine, load and bandwidth in its lines).

Before timing it holds freed memory in the process (:func:`lowmembp.measurement.timing.hold_freed_memory`: glibc's
mmap threshold fixed at 32 MiB, no trimming), so each call's fresh tensors reuse freed memory rather than fault
fresh pages in, which glibc's adaptive defaults do or not depending on the process's history (the same op's time
then moved by up to 2× between runs); ``--malloc default`` leaves glibc's defaults.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from lowmembp.ops.approx_act import regelu2, resilu2
from lowmembp.ops.mesa_quant import dequantize, draw_seed_tensor, quantize
from lowmembp.ops.ms_norm import ms_layer_norm, ms_rms_norm
from lowmembp.measurement.timing import hold_freed_memory, time_interleaved
from lowmembp.ops.backend import use_backend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# name: (shape, ours, native, kind)
OPS = {
    "regelu2": ((8, 197, 3072), regelu2, F.gelu, "act"),
    "regelu2-llama": ((1, 512, 11008), regelu2, F.gelu, "act"),
    "resilu2": ((1, 512, 11008), resilu2, F.silu, "act"),
    "ms-layernorm": ((1576, 768), lambda x: ms_layer_norm(x, 1e-5), lambda x: F.layer_norm(x, x.shape[-1:], eps=1e-5),
                     "norm"),
    "ms-rmsnorm": ((512, 4096), lambda x: ms_rms_norm(x, 1e-6), lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6),
                   "norm"),
    "mesa": ((8, 197, 3072), None, None, "mesa"),  # quantise + dequantise, 8 channel groups (a linear's input)
}
MESA_GROUPS = 8


def copy_bandwidth(rounds: int) -> float:
    """Bytes per second of a big ``copy_`` (read + write counted), median of ``rounds``."""
    src = torch.randn(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time_interleaved({"copy": lambda r: dst.copy_(src)}, rounds=rounds, warmup=1)["copy"]
    return 2 * src.numel() * 4 / statistics.median(t)


def min_bytes(kind: str, n: int, rows: int, es: int) -> tuple[int, int]:
    """(ours, native) bytes moved by forward + backward at the least (each tensor read or written once)."""
    if kind == "act":  # ours: x, y | codes (0.25 B/el), dy, dx ; native: x, y | x, dy, dx
        return 2 * n * es + n // 4 + n // 4 + 2 * n * es, 2 * n * es + 3 * n * es
    if kind == "norm":  # ours: x, y, rstd | y, g, dx, rstd ; native: x, y, mean/rstd | x, g, dx, mean/rstd
        return 5 * n * es + 8 * rows, 5 * n * es + 16 * rows
    return n * es + n + n + n * es, 2 * n * es  # mesa: x, codes | codes, x̂ ; native: a copy of x


def case_steps(name: str, dtype: torch.dtype):
    shape, ours, native, kind = OPS[name]
    x = (torch.randn(shape) * 3).to(dtype).requires_grad_(kind != "mesa")
    dy = torch.randn(shape).to(dtype)
    if kind == "mesa":
        inner = shape[-1] // MESA_GROUPS
        mn = x.detach().reshape(-1, MESA_GROUPS, inner).amin(dim=(0, 2)).float()
        mx = x.detach().reshape(-1, MESA_GROUPS, inner).amax(dim=(0, 2)).float()
        out = torch.empty_like(x)

        def mesa_step(_r):
            q = quantize(x, mx - mn, mn, inner, MESA_GROUPS, draw_seed_tensor())
            return dequantize(q)

        return ({"ours": with_backend(mesa_step, "cpu"), "ref": with_backend(mesa_step, "torch"),
                 "native": lambda r: out.copy_(x)}, kind, x.numel(), 1)

    def step_of(fn):
        return lambda _r: torch.autograd.grad(fn(x), x, dy)[0]

    rows = x.numel() // shape[-1]
    return ({"ours": with_backend(step_of(ours), "cpu"), "ref": with_backend(step_of(ours), "torch"),
             "native": step_of(native)}, kind, x.numel(), rows)


def with_backend(step, backend: str):
    """``step`` run with the ops' backend forced to ``backend`` (lowmembp.ops.backend.use_backend), the previous
    setting restored after."""
    def run(r):
        with use_backend(backend):
            return step(r)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case (medians are reported)")
    p.add_argument("--no-ref", action="store_true", help="leave the reference out (faster)")
    p.add_argument("--out", default=None, help="also write the table as OUT/cpu_ops.{md,csv}")
    p.add_argument("--malloc", choices=["hold", "default"], default="hold",
                   help="hold: freed memory stays in the process for reuse (glibc; the default); default: glibc's own")
    a = p.parse_args(argv)
    if os.environ.get("LOWMEMBP_BACKEND", "").strip().lower() not in ("", "auto"):
        p.error("unset LOWMEMBP_BACKEND: each column sets its own (ours: cpu, ref: torch)")
    torch.manual_seed(0)
    a.malloc_held = a.malloc == "hold" and hold_freed_memory()
    load = [os.getloadavg()[0]]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs visible; load average {os.getloadavg()}; "
          f"{malloc_note(a.malloc_held)}")
    table, bandwidth = [], {}
    head = (f"{'op':14s} {'shape':16s} {'dtype':5s} {'thr':>3s} {'native ms':>9s} {'ours ms':>8s} {'ref ms':>8s} "
            f"{'ours/nat':>8s} {'ref/nat':>8s} {'MB ours':>8s} {'MB nat':>7s} {'roof ms':>7s} {'ours/roof':>9s}")
    for threads in a.threads:
        torch.set_num_threads(threads)
        bw = bandwidth[threads] = copy_bandwidth(max(3, a.rounds))
        print(f"\n{threads} thread(s): copy bandwidth {bw / 1e9:.2f} GB/s (copy_ of 256 MiB, read + write)")
        print(head)
        for name in a.ops:
            for dn in a.dtypes:
                dtype = DTYPES[dn]
                steps, kind, n, rows = case_steps(name, dtype)
                if a.no_ref:
                    steps.pop("ref")
                t = time_interleaved(steps, rounds=a.rounds, warmup=1, rotate=True)
                med = {k: statistics.median(v) for k, v in t.items()}
                b_ours, b_nat = min_bytes(kind, n, rows, dtype.itemsize)
                roof = b_ours / bw
                ref = med.get("ref", float("nan"))
                shape = "x".join(map(str, OPS[name][0]))
                print(f"{name:14s} {shape:16s} {dn:5s} {threads:3d} {med['native'] * 1e3:9.2f} "
                      f"{med['ours'] * 1e3:8.2f} "
                      f"{ref * 1e3:8.2f} {med['ours'] / med['native']:8.2f} {ref / med['native']:8.2f} "
                      f"{b_ours / 1e6:8.1f} {b_nat / 1e6:7.1f} {roof * 1e3:7.2f} {med['ours'] / roof:9.2f}",
                      flush=True)
                table.append({"op": name, "shape": shape, "dtype": dn, "threads": threads,
                             "native_ms": med["native"] * 1e3, "ours_ms": med["ours"] * 1e3, "ref_ms": ref * 1e3,
                             "ours/native": med["ours"] / med["native"], "ref/native": ref / med["native"],
                             "MB_ours": b_ours / 1e6, "MB_native": b_nat / 1e6, "roof_ms": roof * 1e3,
                             "ours/roof": med["ours"] / roof})
                load.append(os.getloadavg()[0])
    if a.out:
        write_table(table, bandwidth, load, a, a.out)
    return 0


def malloc_note(held: bool) -> str:
    """How the process allocated, for the printout and the table's caption."""
    if held:
        return ("freed memory held for reuse (glibc mmap threshold 32 MiB, no trimming: "
                "lowmembp.measurement.timing.hold_freed_memory)")
    return "glibc's default malloc thresholds (freed memory may be returned to the OS)"


def write_table(rows: list[dict], bandwidth: dict, load: list[float], a, out: str) -> None:
    """``out/cpu_ops.csv`` (every column) and ``out/cpu_ops.md`` (one part per thread count), read alone."""
    import pandas as pd

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_tables, also when loaded by path
    from bench_tables import write_benchmark_table

    df = pd.DataFrame(rows)
    mesa = "Mesa: quantise + dequantise of a linear's input, 8 channel groups; its native is a copy_ of the input."
    parts = []
    for threads, sub in df.groupby("threads", sort=False):
        shown = pd.DataFrame({
            "op": [f"{o} {s}" for o, s in zip(sub["op"], sub["shape"])], "dtype": sub["dtype"],
            "native (ms)": sub["native_ms"].map("{:.2f}".format), "ours (ms)": sub["ours_ms"].map("{:.2f}".format),
            "reference (ms)": sub["ref_ms"].map("{:.2f}".format),
            "ours / native": sub["ours/native"].map("{:.2f}".format),
            "MB ours (native)": [f"{o:.1f} ({n:.1f})" for o, n in zip(sub["MB_ours"], sub["MB_native"])],
            "roof (ms)": sub["roof_ms"].map("{:.2f}".format), "ours / roof": sub["ours/roof"].map("{:.2f}".format)})
        parts.append((f"{threads} thread{'s' if threads > 1 else ''}: copy bandwidth "
                      f"{bandwidth[threads] / 1e9:.1f} GB/s", shown, f"threads-{threads}"))
    write_benchmark_table(
        df, out, "cpu_ops", "CPU forward + backward of LowMemoryBP's and Mesa's ops against the native ops, with the "
        "roofline",
        caption="Medians of forward + backward (torch.autograd.grad) taken in turns in one process "
                f"({a.rounds} rounds, rotating order): ours = the CPU fast path (the default on CPU tensors), "
                "reference = the PyTorch reference (LOWMEMBP_BACKEND=torch), native = the op it replaces (F.gelu, "
                "F.silu, F.layer_norm, F.rms_norm; no affine). MB: the least forward + backward must move; roof = "
                "MB / the copy bandwidth (a copy_ of 256 MiB, read + write). " + mesa + " Allocation: "
                + malloc_note(a.malloc_held) + ".",
        command="PYTHONPATH=$PWD python benchmarks/cpu_ops.py " + " ".join(sys.argv[1:]), load=load, parts=parts)


if __name__ == "__main__":
    sys.exit(main())

"""Part "kernels" of benchmarks/gpu_run.py: our ops, the official LowMemoryBP CUDA ops, Liger-Kernel and PyTorch side
by side in one process — forward and backward time, bytes saved for backward, and each one's output and gradients
against a reference. One row per (op, shape, dtype, implementation) in ``kernels.csv``.

Ops (each called through autograd, as a model calls it):
  regelu2 / resilu2   ours, official, torch (F.gelu / F.silu: exact backward, saves its input)
  geglu / swiglu      act(a) * b, the gated MLP: ours and official with ReGELU2 / ReSiLU2, torch, Liger's fused
                      GeGLU (tanh GELU) / SwiGLU
  ms_layernorm / ms_rmsnorm   no affine (LowMemoryBP folds γ/β into the next linear): ours, official, torch
                      (F.layer_norm / F.rms_norm), Liger (γ = 1, β = 0, not trained)
Reference ("semantics" column): ``approx`` — lowmembp's own PyTorch reference op in fp32 (exact forward, 2-bit
backward: what ReGELU2/ReSiLU2 compute, ours and theirs alike); ``exact`` — the PyTorch op in fp32 (tanh GELU for
Liger's GeGLU). Errors are max |impl − ref| / max |ref| over the output and over every input gradient.
Times: ``triton.testing.do_bench`` medians (ms) of the forward (building the graph) and of the backward alone
(``retain_graph``); ``*_vs_ours``: impl time / ours. CPU dry run: tiny shapes, ours through Triton's interpreter, the
official ops replaced by the reference stand-in of :mod:`official_lomem` (flagged), Liger skipped, no times.
"""
from __future__ import annotations

import math
import os
import time
import traceback
import zlib

COLUMNS = ["op", "shape", "dtype", "impl", "semantics", "status", "y_err", "dx_err", "fwd_ms", "bwd_ms",
           "saved_bytes", "saved_bytes_per_element", "fwd_vs_ours", "bwd_vs_ours", "note"]
SHAPES_GPU = {"act": {"vit-b 64x197x3072": (64, 197, 3072), "llama7b 4x2048x11008": (4, 2048, 11008)},
              "norm": {"vit-b 64x197x768": (64, 197, 768), "llama7b 4x2048x4096": (4, 2048, 4096)}}
SHAPES_SMOKE = {"act": {"tiny 2x5x40": (2, 5, 40)}, "norm": {"tiny 6x48": (6, 48)}}
TOL = {"float16": (2e-3, 4e-3), "bfloat16": (1e-2, 2e-2), "float32": (1e-5, 1e-4)}  # (y, dx) relative to max |ref|


def _saved_bytes(torch, fn, inputs):
    """(output, bytes of the distinct storages saved for backward by one forward)."""
    seen = {}

    def pack(t):
        try:
            s = t.untyped_storage()
            seen[(s.data_ptr(), t.device)] = s.nbytes()
        except Exception:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(*inputs)
    return y, sum(seen.values())


def _rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    scale = float(b.abs().max()) if b.numel() else 1.0
    return float((a - b).abs().max()) / (scale or 1.0) if b.numel() else 0.0


class KernelBench:
    def __init__(self, ctx, sink):
        import torch
        self.torch, self.ctx, self.sink = torch, ctx, sink
        self.device = "cpu" if ctx.smoke else "cuda"

    # --------------------------------------------------------------------------------------------- timing
    def time_ms(self, fn):
        if self.ctx.smoke:  # the interpreter: run it (the code path), claim nothing
            fn()
            return None
        import triton.testing
        try:
            return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))
        except TypeError:  # older triton
            return float(triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=[0.5])[0])

    # ------------------------------------------------------------------------------------------ one row
    def run(self, op, shape_name, dtype, impl, semantics, fn, ref_fn, inputs, note=""):
        torch = self.torch
        row = dict(op=op, shape=shape_name, dtype=str(dtype).replace("torch.", ""), impl=impl, semantics=semantics,
                   note=note)
        try:
            # copies, never views of ``inputs``: Liger's GeGLU / SwiGLU backward writes the input gradients into the
            # storage of the inputs it saved (liger_kernel/ops/geglu.py, swiglu.py: ``tl.store(a + ...)``), which
            # would change the reference's inputs and every later row's
            xs = [x.detach().clone().requires_grad_() for x in inputs]
            y, saved = _saved_bytes(torch, fn, xs)
            dy = torch.randn_like(y)
            grads = torch.autograd.grad(y, xs, dy.clone())
            ref_in = [x.detach().float().requires_grad_() for x in inputs]
            from lowmembp.ops.backend import use_backend

            with use_backend("torch"):  # our reference path, in fp32
                y_ref = ref_fn(*ref_in)
                g_ref = torch.autograd.grad(y_ref, ref_in, dy.float())
            y_err = _rel_err(y, y_ref)
            dx_err = max(_rel_err(g, r) for g, r in zip(grads, g_ref))
            tol_y, tol_dx = TOL[row["dtype"]]
            ok = y_err <= tol_y and dx_err <= tol_dx and math.isfinite(y_err) and math.isfinite(dx_err)
            n = inputs[0].numel()
            row.update(status="ok" if ok else "FAIL", y_err=f"{y_err:.2e}", dx_err=f"{dx_err:.2e}",
                       saved_bytes=saved, saved_bytes_per_element=f"{saved / n:.3f}")
            del y, grads, y_ref, g_ref, ref_in
            xs = [x.detach().clone().requires_grad_() for x in inputs]  # the timing on the inputs' values
            row["fwd_ms"] = self.time_ms(lambda: fn(*xs))
            y = fn(*xs)
            row["bwd_ms"] = self.time_ms(lambda: torch.autograd.grad(y, xs, dy, retain_graph=True))
            del y, xs, dy
        except Exception as e:
            row.update(status="error", note=(note + "; " if note else "") + f"{type(e).__name__}: {str(e)[:300]}")
            if os.environ.get("GPU_RUN_TRACEBACKS"):
                traceback.print_exc()
        self.sink.write(row)
        _progress(row)
        return row


def _progress(row):
    t = "" if row.get("fwd_ms") is None else f" fwd {row['fwd_ms']:.4f} ms bwd {row['bwd_ms']:.4f} ms"
    print(f"  {row['status']:5s} {row['op']:12s} {row['shape']:22s} {row['dtype']:8s} {row['impl']:9s} "
          f"y {row.get('y_err', '-')} dx {row.get('dx_err', '-')} saved {row.get('saved_bytes', '-')}{t} "
          f"{row.get('note', '')}", flush=True)


def _ratios(rows):
    """fwd/bwd time of each impl over ours at the same (op, shape, dtype)."""
    ours = {(r["op"], r["shape"], r["dtype"]): r for r in rows if r["impl"] == "ours"}
    for r in rows:
        o = ours.get((r["op"], r["shape"], r["dtype"]))
        for k in ("fwd", "bwd"):
            a, b = r.get(f"{k}_ms"), (o or {}).get(f"{k}_ms")
            r[f"{k}_vs_ours"] = f"{a / b:.3f}" if a and b else ""
    return rows


def load_liger(smoke):
    """Liger's functional ops, or (None, reason)."""
    if smoke:
        return None, "liger: skipped without CUDA (its kernels do not run under Triton's interpreter)"
    try:
        from liger_kernel.transformers import functional as lf
        return lf, ""
    except Exception as e:
        return None, f"liger: not importable ({type(e).__name__}: {e}); run benchmarks/prepare_gpu_run.sh and carry " \
                     "third_party"


def run_kernels(ctx, sink, deadline):
    """All rows; stops (writing what it has) when ``deadline`` (time.time()) is near."""
    from lowmembp.ops.backend import use_backend

    with use_backend("triton" if ctx.smoke else None):  # smoke: "ours" through the interpreter (TRITON_INTERPRET=1)
        return _run_all(ctx, sink, deadline)


def _run_all(ctx, sink, deadline):
    import torch
    import torch.nn.functional as F
    from official_lomem import OfficialUnavailable, load_official

    from lowmembp.ops.approx_act import regelu2, resilu2
    from lowmembp.ops.ms_norm import ms_layer_norm, ms_rms_norm

    bench = KernelBench(ctx, sink)
    st = dict(official=None, note="", impl="official-stand-in" if ctx.smoke else "official")
    liger, liger_note = load_liger(ctx.smoke)
    if liger is None:
        print(f"kernels: {liger_note}", flush=True)
    shapes = SHAPES_SMOKE if ctx.smoke else SHAPES_GPU
    dev = bench.device

    def ones(n, dt):
        return torch.ones(n, device=dev, dtype=dt)

    def zeros(n, dt):
        return torch.zeros(n, device=dev, dtype=dt)

    def ops_for(kind):
        """[(op, n_inputs, [(impl, semantics, fn or None, ref_fn, note)])]."""
        off, official_note, impl_official = st["official"], st["note"], st["impl"]
        if kind == "act":
            return [
                ("regelu2", 1, [("ours", "approx", regelu2, regelu2, ""),
                                (impl_official, "approx", off and off.regelu2, regelu2, official_note),
                                ("torch", "exact", F.gelu, F.gelu, "")]),
                ("resilu2", 1, [("ours", "approx", resilu2, resilu2, ""),
                                (impl_official, "approx", off and off.resilu2, resilu2, official_note),
                                ("torch", "exact", F.silu, F.silu, "")]),
                ("geglu", 2, [("ours", "approx", lambda a, b: regelu2(a) * b, lambda a, b: regelu2(a) * b, ""),
                              (impl_official, "approx", off and (lambda a, b: off.regelu2(a) * b),
                               lambda a, b: regelu2(a) * b, official_note),
                              ("torch", "exact", lambda a, b: F.gelu(a) * b, lambda a, b: F.gelu(a) * b, ""),
                              ("liger", "exact", liger and liger.liger_geglu,
                               lambda a, b: F.gelu(a, approximate="tanh") * b, liger_note or "tanh GELU")]),
                ("swiglu", 2, [("ours", "approx", lambda a, b: resilu2(a) * b, lambda a, b: resilu2(a) * b, ""),
                               (impl_official, "approx", off and (lambda a, b: off.resilu2(a) * b),
                                lambda a, b: resilu2(a) * b, official_note),
                               ("torch", "exact", lambda a, b: F.silu(a) * b, lambda a, b: F.silu(a) * b, ""),
                               ("liger", "exact", liger and liger.liger_swiglu, lambda a, b: F.silu(a) * b,
                                liger_note)]),
            ]
        ln = lambda x: F.layer_norm(x, x.shape[-1:], eps=1e-5)  # noqa: E731
        rms = lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6)  # noqa: E731
        return [
            ("ms_layernorm", 1, [("ours", "exact", lambda x: ms_layer_norm(x, 1e-5), ln, ""),
                                 (impl_official, "exact", off and (lambda x: off.layer_norm(x, 1e-5)), ln,
                                  official_note),
                                 ("torch", "exact", ln, ln, ""),
                                 ("liger", "exact", liger and (lambda x: liger.liger_layer_norm(
                                     x, ones(x.shape[-1], x.dtype), zeros(x.shape[-1], x.dtype), 1e-5)), ln,
                                  liger_note or "gamma=1, beta=0 (not trained)")]),
            ("ms_rmsnorm", 1, [("ours", "exact", lambda x: ms_rms_norm(x, 1e-6), rms, ""),
                               (impl_official, "exact", off and (lambda x: off.rms_norm(x, 1e-6)), rms,
                                official_note),
                               ("torch", "exact", rms, rms, ""),
                               ("liger", "exact", liger and (lambda x: liger.liger_rms_norm(
                                   x, ones(x.shape[-1], x.dtype), 1e-6)), rms,
                                liger_note or "gamma=1 (not trained), casting_mode llama, in_place dY")]),
        ]

    rows, stopped = [], []
    dtypes = [torch.float16, torch.bfloat16]

    def run_pass(official_pass: bool):
        for kind in ("act", "norm"):
            for sname, shape in shapes[kind].items():
                for dt in dtypes:
                    for op, n_in, impls in ops_for(kind):
                        impls = [i for i in impls if i[0].startswith("official") == official_pass]
                        if time.time() > deadline:
                            stopped.append(op)
                            return
                        g = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{op} {sname} {dt}".encode()))
                        inputs = [(torch.randn(shape, device=dev, generator=g) * 3 + (0.5 if kind == "norm" else 0))
                                  .to(dt) for _ in range(n_in)]  # the same inputs in both passes
                        for impl, sem, fn, ref, why in impls:
                            if fn is None:
                                row = dict(op=op, shape=sname, dtype=str(dt).replace("torch.", ""), impl=impl,
                                           semantics=sem, status="skipped", note=why)
                                sink.write(row)
                                _progress(row)
                                rows.append(row)
                                continue
                            rows.append(bench.run(op, sname, dt, impl, sem, fn, ref, inputs, note=why))
                        del inputs
                        if dev == "cuda":
                            torch.cuda.empty_cache()

    # ours, torch and Liger first: the official ops' nvcc build may still be running in the background
    run_pass(official_pass=False)
    try:
        if os.environ.get("GPU_RUN_OFFICIAL_FAILED"):
            raise OfficialUnavailable(os.environ["GPU_RUN_OFFICIAL_FAILED"])
        if not ctx.smoke:
            _wait_for_build(ctx.build_dir, deadline - 20)
        st["official"] = load_official(ctx.third_party / "lomem", ctx.build_dir, stand_in=ctx.smoke)
        st["note"] = st["official"].source + "; " + st["official"].python
        print(f"kernels: official ops: {st['note']} (build/load {st['official'].build_s:.0f} s)", flush=True)
    except OfficialUnavailable as e:
        st["note"] = f"official: {e}"
        print(f"kernels: {st['note']}", flush=True)
    run_pass(official_pass=True)
    if stopped:
        print("kernels: stopped at the part's time limit; the rows so far are written", flush=True)
    order = {(k, n): i for i, (k, n) in enumerate((r["op"], r["shape"]) for r in rows)}
    rows.sort(key=lambda r: (order[(r["op"], r["shape"])], r["dtype"], r["impl"] != "ours"))
    return _ratios(rows), bool(stopped)


def _wait_for_build(build_dir, until: float):
    """Wait while another process builds into ``build_dir`` (torch's JIT holds ``build_dir/lock``)."""
    from official_lomem import OfficialUnavailable
    lock = os.path.join(str(build_dir), "lock")
    t = time.time()
    while os.path.exists(lock):
        if time.time() > until:
            raise OfficialUnavailable(f"the background nvcc build still held {lock} after {time.time() - t:.0f} s "
                                      "(the part's time limit); see official_build.log")
        time.sleep(1.0)

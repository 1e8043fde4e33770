"""One call on a CUDA machine: every Triton kernel of lowmembp against its PyTorch reference, plus achieved bandwidth.

    python benchmarks/gpu_check.py                      # CUDA: full check, results in results/gpu_check/
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc   # no GPU: tiny shapes through Triton's interpreter

Kernels checked (each forward and backward, fp32 and bf16, at ViT-B and LLaMA-7B shapes):
  approx_act  ReGELU2 / ReSiLU2 (lowmembp/ops/approx_act.py): codes bitwise, output within fp32 rounding / 1 ulp,
              gradient bitwise.
  ms_norm     MS-LayerNorm / MS-RMSNorm (lowmembp/ops/ms_norm.py): output and rstd to rounding, gradient to rounding.
  mesa_quant  Mesa int8 quantise ("fwd") / dequantise ("bwd") (lowmembp/ops/mesa_quant.py): codes bitwise (off-by-one
              from FMA contraction is counted and reported), dequantised values to rounding.
A module that is absent is reported as skipped; one that fails to import or has changed its API is a failure.
It also checks 64-bit offsets: a bf16 tensor of just over 2**31 elements per op, tail against the reference (about
15 GB of GPU memory; --skip-large leaves it out; the smoke test runs the same code at a small size), and that the public
regelu2/resilu2 dispatch to Triton on this device and save only the packed codes.

Bandwidth: bytes the kernel must move (read + write) over its median time (triton.testing.do_bench), in GB/s and as a
percentage of a device-to-device ``Tensor.copy_`` moving the same number of bytes (copy of half as many bytes: it
reads them and writes them). The reference and the native PyTorch op are timed alongside for context.

Writes <out>/gpu_check.json and <out>/gpu_check.md. Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA
device (and --cpu-smoke not given). Takes well under a minute of GPU time on an H200.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

SHAPES_GPU = {  # activation tensors (MLP hidden) and norm tensors (model width)
    "act": {"vit-b 64x197x3072": (64, 197, 3072), "llama7b 8x512x11008": (8, 512, 11008)},
    "norm": {"vit-b 64x197x768": (64, 197, 768), "llama7b 8x512x4096": (8, 512, 4096)},
}
SHAPES_SMOKE = {"act": {"tiny 3x5x37": (3, 5, 37)}, "norm": {"tiny 6x48": (6, 48)}}
MESA_GROUPS = 8  # lowmembp.methods.mesa default channel groups


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/gpu_check", help="output folder (default: results/gpu_check/)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    p.add_argument("--skip-large", action="store_true", help="leave out the >2**31-element offset checks")
    p.add_argument("--ops", default="approx_act,ms_norm,mesa_quant", help="comma-separated op modules to check")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------- comparisons
def _ulp(v, dtype):
    import torch
    m = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    v = v.double().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(v)) - m).clamp_min(tiny * 2.0 ** -m)


def within_ulps(a, b, dtype, ulps, atol=0.0):
    """(ok, worst error in ulps beyond atol): |a - b| <= ulps·ulp(max(|a|, |b|)) + atol elementwise."""
    if a.numel() == 0:
        return True, 0.0
    a, b = a.double(), b.double()
    err = ((a - b).abs() - atol).clamp_min(0) / _ulp(torch_maximum_abs(a, b), dtype)
    worst = float(err.max())
    return worst <= ulps, worst


def torch_maximum_abs(a, b):
    import torch
    return torch.maximum(a.abs(), b.abs())


def close(a, b, rtol, atol_rel):
    """(ok, max |a-b| / max|b|): |a - b| <= rtol·|b| + atol_rel·max|b| (atol scaled: terms that cancel)."""
    if a.numel() == 0:
        return True, 0.0
    a, b = a.double(), b.double()
    scale = float(b.abs().max()) or 1.0
    ok = bool(((a - b).abs() <= rtol * b.abs() + atol_rel * scale).all())
    return ok, float((a - b).abs().max()) / scale


# ---------------------------------------------------------------------------------------------------- the runner
class _NoTiming(Exception):
    pass


class Runner:
    def __init__(self, device, smoke):
        import torch
        self.torch, self.device, self.smoke = torch, device, smoke
        self.rows, self._copy = [], {}

    def time_ms(self, fn):
        if fn is None:
            return None
        if self.smoke:  # the interpreter: one timed call, no meaning as bandwidth
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        import triton.testing
        try:
            return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
        except TypeError:  # an older triton without return_mode
            return float(triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=[0.5])[0])

    def copy_gbps(self, nbytes):
        """GB/s of dst.copy_(src) moving `nbytes` in all (nbytes/2 read, nbytes/2 written)."""
        half = max(nbytes // 2, 1)
        key = half
        if key not in self._copy:
            src = self.torch.empty(half, dtype=self.torch.uint8, device=self.device)
            dst = self.torch.empty_like(src)
            ms = self.time_ms(lambda: dst.copy_(src))
            self._copy[key] = 2 * half / (ms * 1e-3) / 1e9
            del src, dst
        return self._copy[key]

    def record(self, op, direction, shape_name, dtype, nbytes, check, triton_fn, ref_fn=None, native_fn=None):
        """Run `check` (-> (ok, detail)) and time the three implementations; one row of the report."""
        row = dict(op=op, dir=direction, shape=shape_name, dtype=str(dtype).replace("torch.", ""), bytes=nbytes)
        try:
            ok, detail = check()
            row.update(ok=bool(ok), detail=detail)
        except Exception as e:  # a crash is a failed check, and the rest still runs
            row.update(ok=False, detail=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            self.rows.append(row)
            print(f"FAIL {op} {direction} {shape_name} {row['dtype']}: {row['detail']}", flush=True)
            return
        try:
            ms = self.time_ms(triton_fn) if triton_fn is not None else None
            if ms is None:  # a check without timing (the 64-bit offset checks)
                raise _NoTiming
            row.update(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9)
            row["copy_gbps"] = self.copy_gbps(nbytes)
            row["pct_copy"] = 100.0 * row["gbps"] / row["copy_gbps"]
            row["ref_ms"] = self.time_ms(ref_fn)
            row["native_ms"] = self.time_ms(native_fn)
        except _NoTiming:
            pass
        except Exception as e:
            row.update(ok=False, detail=f"timing failed: {type(e).__name__}: {e}", traceback=traceback.format_exc())
        self.rows.append(row)
        status = "ok  " if row["ok"] else "FAIL"
        bw = f"{row.get('gbps', 0):8.1f} GB/s {row.get('pct_copy', 0):5.1f}% of copy" if "gbps" in row else ""
        print(f"{status} {op:14s} {direction:3s} {shape_name:22s} {row['dtype']:9s} {bw}  {row['detail']}", flush=True)

    def skip(self, op, why):
        self.rows.append(dict(op=op, dir="-", shape="-", dtype="-", bytes=0, ok=True, skipped=True, detail=why))
        print(f"skip {op}: {why}", flush=True)

    def fail(self, op, why, tb=""):
        self.rows.append(dict(op=op, dir="-", shape="-", dtype="-", bytes=0, ok=False, detail=why, traceback=tb))
        print(f"FAIL {op}: {why}", flush=True)


def _randn(torch, shape, dtype, device, scale=3.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------- op: approx_act
def check_approx_act(r, mod, shapes, dtypes, large):
    torch, dev = r.torch, r.device
    import torch.nn.functional as F
    kinds = {"regelu2": ("gelu", F.gelu, torch.ops.aten.gelu_backward),
             "resilu2": ("silu", F.silu, torch.ops.aten.silu_backward)}
    for name, (k, native, native_bwd) in kinds.items():
        for sname, shape in shapes["act"].items():
            for dt in dtypes:
                x = _randn(torch, shape, dt, dev)
                dy = _randn(torch, shape, dt, dev, 1.0)
                n, e = x.numel(), x.element_size()
                cb = (n + 3) // 4 + 1  # packed codes + the non-finite flag byte
                y_t, p_t = mod.forward_triton(x, k)
                y_r, p_r = mod.forward_reference(x, k)

                def fwd_check():
                    codes_bad = int((p_t != p_r).sum())
                    # fp32: Triton's exp / division are the fast PTX forms, a few ulp from torch's
                    ok, worst = within_ulps(y_t, y_r, dt, 4.0 if dt == torch.float32 else 1.0, atol=1e-6)
                    return ok and codes_bad == 0, f"code bytes differing {codes_bad}/{cb}; y worst {worst:.2f} ulp"

                r.record(name, "fwd", sname, dt, 2 * n * e + cb, fwd_check, lambda: mod.forward_triton(x, k),
                         lambda: mod.forward_reference(x, k), lambda: native(x))
                dx_t = mod.backward_triton(dy, p_r, k)
                dx_r = mod.backward_reference(dy, p_r, k)

                def bwd_check():
                    if r.smoke:  # the interpreter truncates bf16 stores
                        ok, worst = within_ulps(dx_t, dx_r, dt, 1.0)
                        return ok, f"dx worst {worst:.2f} ulp"
                    bad = int((dx_t != dx_r).sum())
                    return bad == 0, f"dx elements differing {bad}/{n} (expected bitwise equal)"

                r.record(name, "bwd", sname, dt, 2 * n * e + cb, bwd_check, lambda: mod.backward_triton(dy, p_r, k),
                         lambda: mod.backward_reference(dy, p_r, k), lambda: native_bwd(dy, x))
                del x, dy, y_t, p_t, y_r, p_r, dx_t, dx_r
        _api_approx_act(r, mod, name, k, shapes)
        if large:
            _large_approx_act(r, mod, name, k, large)


def _api_approx_act(r, mod, name, k, shapes):
    """The public function on this device: dispatches to Triton, saves only the codes, matches the launchers."""
    torch = r.torch
    from lowmembp.ops.backend import backend_for
    fn = mod.regelu2 if k == "gelu" else mod.resilu2
    shape = next(iter(shapes["act"].values()))

    def check():
        x = _randn(torch, shape, torch.bfloat16, r.device).requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fn(x)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        y_l, p_l = mod.forward_triton(x.detach(), k)
        dx_l = mod.backward_triton(torch.ones_like(y), p_l, k)
        n = x.numel()
        ok = (backend_for(x) == "triton" and len(saved) == 1 and saved[0].dtype == torch.uint8
              and saved[0].numel() == (n + 3) // 4 + 1 and torch.equal(y, y_l) and torch.equal(dx, dx_l))
        return ok, f"backend {backend_for(x)}, saved {[(str(t.dtype), t.numel()) for t in saved]} for n={n}"

    r.record(name, "api", next(iter(shapes["act"])), torch.bfloat16, 0, check, None)


def _large_approx_act(r, mod, name, k, big):
    torch = r.torch
    n = big + 4100
    tail = 8192  # n - tail is a multiple of 4: whole code bytes (the flag byte follows the codes, in both)

    def check():
        x = torch.empty(n, dtype=torch.bfloat16, device=r.device).normal_(0, 3)
        y, p = mod.forward_triton(x, k)
        s = n - tail
        y_r, p_r = mod.forward_reference(x[s:], k)
        ok_y, worst = within_ulps(y[s:], y_r, torch.bfloat16, 1.0, atol=1e-6)
        ok_p = torch.equal(p[s // 4:], p_r)
        del y
        dx = mod.backward_triton(x, p, k)  # x doubles as dy
        dx_r = mod.backward_reference(x[s:], p[s // 4:], k)
        ok_dx = within_ulps(dx[s:], dx_r, torch.bfloat16, 1.0)[0] if r.smoke else torch.equal(dx[s:], dx_r)
        return ok_y and ok_p and ok_dx, f"n={n} tail: y {worst:.2f} ulp, codes equal {ok_p}, dx equal {ok_dx}"

    r.record(name, "64b", f"{n}", torch.bfloat16, 0, check, None)
    _empty_cache(torch)


# -------------------------------------------------------------------------------------------------- op: ms_norm
def check_ms_norm(r, mod, shapes, dtypes, large):
    torch, dev = r.torch, r.device
    import torch.nn.functional as F
    natives = {"layernorm": lambda x: F.layer_norm(x, x.shape[-1:]),
               "rmsnorm": lambda x: F.rms_norm(x, x.shape[-1:]) if hasattr(F, "rms_norm") else None}
    for kind in ("layernorm", "rmsnorm"):
        eps = 1e-5 if kind == "layernorm" else 1e-6
        name = "ms_" + kind
        for sname, shape in shapes["norm"].items():
            for dt in dtypes:
                x = _randn(torch, shape, dt, dev) + 0.5
                g = _randn(torch, shape, dt, dev, 1.0)
                rows, nn_ = math.prod(shape[:-1]), shape[-1]
                fb, bb = mod.ms_norm_bytes(rows, nn_, dt, dt, kind)
                y_t, r_t = mod.ms_norm_fwd_triton(x, kind, eps)
                y_r, r_r = mod.ms_norm_fwd_ref(x, kind, eps)
                tol = 1.0 if dt != torch.float32 else 4.0

                def fwd_check():
                    ok_y, worst = within_ulps(y_t, y_r, dt, tol, atol=1e-6)
                    ok_r, rerr = close(r_t, r_r, 1e-5, 0.0)
                    return ok_y and ok_r, f"y worst {worst:.2f} ulp; rstd rel err {rerr:.1e}"

                xg = x.detach().requires_grad_()
                yn = natives[kind](xg)
                r.record(name, "fwd", sname, dt, fb, fwd_check, lambda: mod.ms_norm_fwd_triton(x, kind, eps),
                         lambda: mod.ms_norm_fwd_ref(x, kind, eps),
                         (lambda: natives[kind](x)) if yn is not None else None)
                dx_t = mod.ms_norm_bwd_triton(g, y_r, r_r, kind, dt)
                dx_r = mod.ms_norm_bwd_ref(g, y_r, r_r, kind, dt)

                def bwd_check():
                    rtol = 2e-6 if dt == torch.float32 else 2 ** -7
                    ok, err = close(dx_t, dx_r, rtol, 1e-5)
                    return ok, f"dx max err / max|dx| {err:.1e}"

                native_bwd = (lambda: torch.autograd.grad(yn, xg, g, retain_graph=True)) if yn is not None else None
                r.record(name, "bwd", sname, dt, bb, bwd_check, lambda: mod.ms_norm_bwd_triton(g, y_r, r_r, kind, dt),
                         lambda: mod.ms_norm_bwd_ref(g, y_r, r_r, kind, dt), native_bwd)
                del x, g, y_t, r_t, y_r, r_r, dx_t, dx_r, xg, yn
        if large:
            _large_ms_norm(r, mod, name, kind, eps, large)


def _large_ms_norm(r, mod, name, kind, eps, big):
    torch = r.torch
    n = 4096
    rows = big // n + 3

    def check():
        x = torch.empty(rows, n, dtype=torch.bfloat16, device=r.device).normal_(0.5, 2)
        y, rs = mod.ms_norm_fwd_triton(x, kind, eps)
        y_r, rs_r = mod.ms_norm_fwd_ref(x[-4:], kind, eps)
        ok_y, worst = within_ulps(y[-4:], y_r, torch.bfloat16, 1.0, atol=1e-6)
        ok_r, _ = close(rs[-4:], rs_r, 1e-5, 0.0)
        dx = mod.ms_norm_bwd_triton(x, y, rs, kind, torch.bfloat16)  # x doubles as the upstream gradient
        ok_dx, err = close(dx[-4:], mod.ms_norm_bwd_ref(x[-4:], y[-4:], rs[-4:], kind, torch.bfloat16), 2 ** -7, 1e-5)
        return ok_y and ok_r and ok_dx, f"rows*N={rows * n} tail: y {worst:.2f} ulp, rstd {ok_r}, dx err {err:.1e}"

    r.record(name, "64b", f"{rows}x{n}", torch.bfloat16, 0, check, None)
    _empty_cache(torch)


# ----------------------------------------------------------------------------------------------- op: mesa_quant
def check_mesa_quant(r, mod, shapes, dtypes, large):
    torch, dev = r.torch, r.device
    for sname, shape in shapes["act"].items():
        for dt in dtypes:
            x = _randn(torch, shape, dt, dev) + 1.0
            n, e = x.numel(), x.element_size()
            inner, G = mod.group_layout(x, "channel", MESA_GROUPS)
            mn, mx = mod.group_min_max(x, inner, G)
            alpha, beta = (mx - mn) * 0.8, mn  # some values outside the range: clamping is checked too
            scale, step = (255.0 / alpha).contiguous(), (alpha / 255.0).contiguous()
            seed = 1234567
            # the references in one chunk: their default chunks of 8192 elements launch some 30 small kernels each,
            # over 5000 chunks at these shapes (seconds a call on a GPU, and the reference is timed too); the codes
            # do not depend on the chunk
            q_t = mod._quantize_triton(x, scale, beta, inner, G, seed)
            q_r = mod.quantize_ref(x, scale, beta, inner, G, seed, chunk=n)

            def q_check():
                diff = (q_t.int() - q_r.int()).abs()
                bad, worst = int((diff != 0).sum()), int(diff.max()) if n else 0
                # bit-for-bit is the contract; FMA contraction can move a value sitting on a rounding edge by one
                ok = worst <= 1 and bad <= max(1, n // 100_000)
                return ok, f"codes differing {bad}/{n} (max {worst}); contract is bitwise"

            r.record("mesa_quantize", "fwd", sname, dt, n * e + n, q_check,
                     lambda: mod._quantize_triton(x, scale, beta, inner, G, seed),
                     lambda: mod.quantize_ref(x, scale, beta, inner, G, seed, chunk=n))
            d_t = mod._dequantize_triton(q_r, step, beta, inner, G, dt)
            d_r = mod.dequantize_ref(q_r, step, beta, inner, G, dt, chunk=n)

            def d_check():
                ok, worst = within_ulps(d_t, d_r, dt, 1.0, atol=1e-6)
                return ok, f"dequantised worst {worst:.2f} ulp"

            r.record("mesa_dequantize", "bwd", sname, dt, n + n * e, d_check,
                     lambda: mod._dequantize_triton(q_r, step, beta, inner, G, dt),
                     lambda: mod.dequantize_ref(q_r, step, beta, inner, G, dt, chunk=n))
            del x, q_t, q_r, d_t, d_r
    if large:
        _large_mesa(r, mod, large)


def _large_mesa(r, mod, big):
    torch = r.torch
    c = 4096
    rows = big // c + 3

    def check():
        x = torch.empty(rows, c, dtype=torch.bfloat16, device=r.device).normal_(0, 2)
        inner, G = mod.group_layout(x, "channel", MESA_GROUPS)
        mn, mx = mod.group_min_max(x, inner, G)
        scale, step, beta = (255.0 / (mx - mn)).contiguous(), ((mx - mn) / 255.0).contiguous(), mn.contiguous()
        q = mod._quantize_triton(x, scale, beta, inner, G, 99)
        s = (rows - 4) * c  # a multiple of inner·G: group indices line up
        xt = x[-4:].reshape(-1).float()
        g = (torch.arange(xt.numel(), device=r.device) // inner) % G
        u = mod.hash_uniform(xt.numel(), 99, r.device, start=s)
        q_r = torch.floor((xt - beta[g]) * scale[g] + u).clamp_(0, 255).to(torch.uint8)
        diff = (q[-4:].reshape(-1).int() - q_r.int()).abs()
        d = mod._dequantize_triton(q, step, beta, inner, G, torch.bfloat16)
        ok_d, worst = within_ulps(d[-4:], mod.dequantize_ref(q[-4:], step, beta, inner, G, torch.bfloat16),
                                  torch.bfloat16, 1.0, atol=1e-6)
        ok_q = int(diff.max()) <= 1
        return ok_q and ok_d, (f"tail: codes differing {int((diff != 0).sum())} (max {int(diff.max())}), "
                               f"dequant {worst:.2f} ulp")

    r.record("mesa_quant", "64b", f"{rows}x{c}", torch.bfloat16, 0, check, None)
    _empty_cache(torch)


def _empty_cache(torch):
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


CHECKS = {"approx_act": check_approx_act, "ms_norm": check_ms_norm, "mesa_quant": check_mesa_quant}


# ------------------------------------------------------------------------------------------------------- output
def _fmt(v, f):
    return "" if v is None else format(v, f)


def write_report(out: Path, meta: dict, rows: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# gpu_check — {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, {meta['when']}, "
             f"{meta['seconds']:.0f} s"
             f"{' (CPU smoke: timings are the interpreter, not bandwidth)' if meta['smoke'] else ''}",
             "",
             *([f"**Incomplete**: not checked (the run stopped before them): {', '.join(meta['pending'])}", ""]
               if not meta.get("complete", True) else []),
             "Times: median ms (3 significant digits). GB/s: the kernel's bytes read and written per second; "
             "% of copy: of a device copy (dst.copy_(src)) moving as many bytes, timed alike. reference: the "
             "PyTorch reference of the same semantics; native: the op it replaces.",
             "",
             "<!-- --8<-- [start:checks] -->",
             "| op | shape, dtype | check | kernel ms | GB/s | % of copy | reference ms | native ms | detail |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        status = "skipped" if x.get("skipped") else ("ok" if x["ok"] else "**FAIL**")
        dtype = str(x["dtype"]).replace("torch.", "")
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
        lines.append(f"| {x['op']} {x['dir']} | {x['shape']} {dtype} | "
                     f"{status} | {_fmt(x.get('ms'), '.3g')} | "
                     f"{_fmt(x.get('gbps'), '.0f')} | {_fmt(x.get('pct_copy'), '.0f')} | "
                     f"{_fmt(x.get('ref_ms'), '.3g')} | "
                     f"{_fmt(x.get('native_ms'), '.3g')} | {str(x['detail']).replace('|', chr(92) + '|')} |")
    lines.append("<!-- --8<-- [end:checks] -->")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        os.environ["LOWMEMBP_BACKEND"] = "triton"  # the public functions too take the (interpreted) kernels
    import torch
    if args.cpu_smoke:
        from lowmembp.ops.backend import set_backend
        set_backend("triton")  # (also where lowmembp was imported before: the variable is read at its import)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here. Run it on a GPU machine, or `--cpu-smoke` for the interpreter "
              "smoke test.", file=sys.stderr)
        return 2
    try:
        import triton
    except Exception as e:
        print(f"gpu_check: triton is not importable ({e}); install triton", file=sys.stderr)
        return 1
    t0 = time.time()
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    r = Runner(device, smoke)
    shapes = SHAPES_SMOKE if smoke else SHAPES_GPU
    dtypes = [torch.float32, torch.bfloat16]
    # the offset checks: just over 2**31 elements on the GPU; the same code at a small size in the smoke test
    large = 0 if args.skip_large else (3 * 4096 if smoke else 2 ** 31)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]

    def run_meta(pending=()):
        """``complete``: every op named was checked (a report written after an op, by a run later stopped at its time
        limit, says which ops it lacks in ``pending``)."""
        return dict(device=("CPU smoke, " + platform.processor()) if smoke else torch.cuda.get_device_name(),
                    torch=torch.__version__, triton=triton.__version__, commit=_git_commit(),
                    when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), seconds=time.time() - t0, smoke=smoke,
                    complete=not pending, pending=list(pending))

    write_report(Path(args.out), run_meta(ops), r.rows)  # a run stopped in its first op: an empty, incomplete report
    for i, op in enumerate(ops):
        if op not in CHECKS:
            r.fail(op, f"unknown op {op!r}: choose from {sorted(CHECKS)}")
            continue
        try:
            mod = importlib.import_module(f"lowmembp.ops.{op}")
        except ModuleNotFoundError as e:
            if e.name == f"lowmembp.ops.{op}":
                r.skip(op, f"lowmembp/ops/{op}.py is not there yet")
                continue
            r.fail(op, f"import failed: {e}", traceback.format_exc())
            continue
        except Exception as e:
            r.fail(op, f"import failed: {type(e).__name__}: {e}", traceback.format_exc())
            continue
        try:
            CHECKS[op](r, mod, shapes, dtypes, large)
        except AttributeError as e:  # the module changed its API: the check needs updating
            r.fail(op, f"API mismatch, update benchmarks/gpu_check.py: {e}", traceback.format_exc())
        except Exception as e:
            r.fail(op, f"{type(e).__name__}: {e}", traceback.format_exc())
        write_report(Path(args.out), run_meta(ops[i + 1:]), r.rows)  # after each op: a run stopped by a time limit
        # keeps it, marked incomplete
    meta = run_meta()
    out = Path(args.out)
    write_report(out, meta, r.rows)
    failed = [x for x in r.rows if not x["ok"]]
    ran = [x for x in r.rows if not x.get("skipped")]
    print(f"\n{len(r.rows) - len(failed)}/{len(r.rows)} checks passed in {meta['seconds']:.0f} s; "
          f"report: {out / 'gpu_check.md'}")
    if not ran:
        print(f"gpu_check: nothing was checked (--ops {args.ops!r}: every op skipped or none named); name ops from "
              f"{', '.join(sorted(CHECKS))}", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

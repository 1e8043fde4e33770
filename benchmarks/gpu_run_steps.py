"""Parts "fig1", "llama" and "estimates" of benchmarks/gpu_run.py: whole training steps measured by the allocator,
and lowmembp's fake-tensor estimate of the same steps.

fig1   LowMemoryBP Fig. 1 (docs/design.md#papers): timm ViT-B/16 (random weights), batch 64, fp16 autocast, LoRA r4 on
qkv only
       FIRST (Fig. 1's setting, the official lora_qv: q and v, here one adapter on timm's fused qkv;
       experiments/configs/vit-b16-cifar100-lora-qv.yaml), then on all linears (qkv, proj, fc1, fc2: lora_all):
       lora, lora+checkpointing, lora+mesa-gelu-ln, lora+lowmembp, lora+liger (refused for timm models: recorded so).
llama  transformers LLaMA-7B width (hidden 4096, intermediate 11008, 32 heads), 4 layers, batch 4 x seq 640 (the
       official run's longest batch: source 512 + target 128), bf16 autocast, LoRA r64 α16 with dropout 0.1 on all
       linears (experiments/configs/llama-7b-alpaca-lora.yaml; the base in bf16, not NF4: bitsandbytes is not
       expected on the device): lora, lora+lowmembp, lora+liger, lora+checkpointing. Their estimates run dropout as
       CUDA does (a 1-byte mask; the CPU dropout of a fake step keeps one of the input's dtype); in the CPU dry run
       both sides use the CPU's.
Each model is built once (fp32 weights under autocast, as :func:`lowmembp.estimator.step.estimate` builds them), warmed
up
right after its build, then the configurations take steps in turn (round-robin), so drifts of clock or temperature
hit them alike. A step is forward, loss, backward, fused AdamW (lr 1e-4, wd 0.1), ``zero_grad(set_to_none=True)`` —
the step the estimate measures, on the batch and loss the estimate builds.

Peak of one configuration's step with the others resident: ``max_memory_allocated`` after
``reset_peak_memory_stats`` minus what was allocated when the step began, plus the configuration's own resident
bytes (``memory_allocated`` after its warm-up minus before its build: weights, optimizer state, batch, buffers).
The median over its steps is reported. CPU dry run: tiny models, the CPU storage tracker of
:func:`lowmembp.measurement.peak.measure_step_peak` stands in for the allocator (flagged), times are no measurement.

estimates  :func:`lowmembp.estimator.step.estimate` of every configuration (CPU, fake tensors; run in parallel with the
GPU
parts by benchmarks/gpu_run.py).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
import traceback
from dataclasses import dataclass, field

STEP_COLUMNS = ["config", "model", "method", "lora_targets", "batch_size", "seq_len", "dtype", "status", "steps",
                "peak_bytes", "peak_mib", "resident_bytes", "step_ms_p20", "step_ms_p50", "step_ms_p80",
                "throughput", "throughput_unit", "measured_how", "note"]
ESTIMATE_COLUMNS = ["config", "method", "estimate_bytes", "saved_bytes", "seconds", "status", "note"]
ERROR_COLUMNS = ["config", "method", "estimate_bytes", "measured_bytes", "ratio", "measured_how", "note"]

FIG1_METHODS = ["lora", "lora+checkpointing", "lora+mesa-gelu-ln", "lora+lowmembp", "lora+liger"]
LLAMA_METHODS = ["lora", "lora+lowmembp", "lora+liger", "lora+checkpointing"]
VIT_SMOKE = dict(img_size=32, embed_dim=48, num_heads=2)
LLAMA_SMOKE = dict(hidden_size=64, intermediate_size=172, num_attention_heads=4, num_key_value_heads=4,
                   vocab_size=512, max_position_embeddings=64)


@dataclass(frozen=True)
class StepConfig:
    part: str            # "fig1" | "llama"
    config: str          # the row key shared by fig1.csv / llama.csv and estimates.csv
    model: str           # a key of lowmembp.estimator.step.MODELS
    method: str
    options: dict = field(default_factory=dict, hash=False)
    batch_size: int = 1
    seq_len: int | None = None
    dtype: str = "bf16"
    layers: int | None = None
    overrides: dict | None = field(default=None, hash=False)
    lora_targets: str = "all"


def step_configs(smoke: bool) -> list[StepConfig]:
    out = []
    for targets, label in (("qkv", "qkv"), (None, "all")):  # Fig. 1's setting (lora_qv) first
        for m in FIG1_METHODS:
            out.append(StepConfig("fig1", f"fig1-{label}", "vit-b16", m, {"rank": 4, "targets": targets},
                                  batch_size=2 if smoke else 64, dtype="fp16", layers=2 if smoke else None,
                                  overrides=dict(VIT_SMOKE) if smoke else None,
                                  lora_targets="qkv, proj, fc1, fc2" if targets is None else targets))
    for m in LLAMA_METHODS:
        out.append(StepConfig("llama", "llama7b-4layers", "llama-7b", m, {"rank": 64, "alpha": 16, "dropout": 0.1},
                              batch_size=2 if smoke else 4, seq_len=16 if smoke else 640, dtype="bf16",
                              layers=2 if smoke else 4, overrides=dict(LLAMA_SMOKE) if smoke else None,
                              lora_targets="all linears"))
    return out


def missing_methods(method: str) -> list[str]:
    import lowmembp
    known = lowmembp.list_methods()
    return [n for n in method.split("+") if n.strip() not in known]


# ------------------------------------------------------------------------------------------------- one model
@contextlib.contextmanager
def module_globals_kept(model):
    """Restore, after the block, every module-level name that the block rebinds in the modules defining the model's
    classes. Liger-Kernel 0.8.5 patches a model instance *and* module globals (``apply_rotary_pos_emb``, the norm and
    MLP classes of ``modeling_llama``); left in place, those would reach every other configuration built or run in
    this process. Yields the list of restored names (the liger row then runs without Liger's RoPE: noted)."""
    import sys
    mods = {type(m).__module__ for m in model.modules()}
    snap = {name: dict(vars(sys.modules[name])) for name in mods if name in sys.modules}
    restored = []
    try:
        yield restored
    finally:
        for name, before in snap.items():
            mod = sys.modules[name]
            for k, v in before.items():
                if vars(mod).get(k, None) is not v:
                    setattr(mod, k, v)
                    restored.append(f"{name.rsplit('.', 1)[-1]}.{k}")


class StepRun:
    """One configuration: model, optimizer, batch and its step, built on ``device``."""

    def __init__(self, cfg: StepConfig, device: str):
        import torch
        import lowmembp
        from lowmembp.estimator.step import DTYPES, MODELS, _batch, _loss, build
        from lowmembp.measurement.peak import prime_optimizer

        self.cfg, self.device, self.torch = cfg, device, torch
        spec = MODELS[cfg.model]
        cuda = device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        self.before = torch.cuda.memory_allocated() if cuda else 0
        model = build(spec, layers=cfg.layers, overrides=cfg.overrides, device=device)
        with module_globals_kept(model) as self.restored:
            model = lowmembp.apply(model, cfg.method, **cfg.options)
        model.train()
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True) if params else None
        prime_optimizer(self.opt)
        batch = _batch(spec, model, cfg.batch_size, cfg.seq_len, (cfg.overrides or {}).get("vocab_size"))
        self.batch = {k: v.to(device) for k, v in batch.items()}
        amp = DTYPES[cfg.dtype]

        def step():
            with torch.autocast(device, dtype=amp, enabled=amp is not None):
                loss = _loss(spec, model, self.batch)
            loss.backward()
            if self.opt is not None:
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)

        self.step = step
        self.resident = 0
        self.peaks, self.times, self.how = [], [], ""

    def warm_up(self, n: int):
        for _ in range(n):
            self.step()
        if self.device == "cuda":
            self.torch.cuda.synchronize()
            self.resident = self.torch.cuda.memory_allocated() - self.before

    def measured_step(self):
        torch = self.torch
        if self.device == "cuda":
            torch.cuda.synchronize()
            a0 = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            self.step()
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - t)
            self.peaks.append(torch.cuda.max_memory_allocated() - a0 + self.resident)
            self.how = "cuda max_memory_allocated over the step - allocated at its start + own resident bytes"
        else:
            from lowmembp.measurement.peak import measure_step_peak
            t = time.perf_counter()
            pk = measure_step_peak(self.model, self.opt, self.step, warmup=0, external=tuple(self.batch.values()))
            self.times.append(time.perf_counter() - t)
            self.peaks.append(int(pk["bytes"]))
            self.how = f"CPU dry run: {pk['how']} (stands in for the allocator)"

    def row(self, smoke: bool) -> dict:
        cfg = self.cfg
        r = _base_row(cfg)
        if not self.times:
            r.update(status="error", note="no measured step (time limit)")
            return r
        ts = sorted(self.times)
        q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))] * 1e3  # noqa: E731
        p50 = statistics.median(ts)
        units = cfg.batch_size if cfg.part == "fig1" else cfg.batch_size * cfg.seq_len
        peak = int(statistics.median(self.peaks))
        r.update(status="ok", steps=len(ts), peak_bytes=peak, peak_mib=f"{peak / 2 ** 20:.0f}",
                 resident_bytes=self.resident, measured_how=self.how)
        if self.restored:
            r["note"] = "module globals the method rebound were restored (not used here): " + ", ".join(self.restored)
        if not smoke:
            r.update(step_ms_p20=f"{q(0.2):.2f}", step_ms_p50=f"{p50 * 1e3:.2f}", step_ms_p80=f"{q(0.8):.2f}",
                     throughput=f"{units / p50:.1f}", throughput_unit="img/s" if cfg.part == "fig1" else "tokens/s")
        else:
            r["note"] = "; ".join(x for x in ("CPU dry run: no timing", r.get("note")) if x)
        return r


def _base_row(cfg: StepConfig) -> dict:
    return dict(config=cfg.config, model=cfg.model, method=cfg.method, lora_targets=cfg.lora_targets,
                batch_size=cfg.batch_size, seq_len=cfg.seq_len or "", dtype=cfg.dtype)


def run_steps(ctx, part: str, sink, deadline: float, warmup: int | None = None, steps: int | None = None) -> dict:
    """Build every configuration of ``part``, warm each up, then round-robin measured steps; rows into ``sink``.

    Returns allocator facts of the part (max allocated / reserved, bytes outside PyTorch's allocator)."""
    import torch
    smoke = ctx.smoke
    device = "cpu" if smoke else "cuda"
    warmup = (1 if smoke else 3) if warmup is None else warmup
    steps = (2 if smoke else 20) if steps is None else steps
    runs, rows = [], []
    cfgs = [c for c in step_configs(smoke) if c.part == part]
    for cfg in cfgs:
        missing = missing_methods(cfg.method)
        if missing:
            rows.append(dict(_base_row(cfg), status="method not available",
                             note=f"not in lowmembp.list_methods(): {', '.join(missing)}"))
            print(f"  {part} {cfg.config} {cfg.method}: method not available ({missing})", flush=True)
            continue
        if time.time() > deadline:
            rows.append(dict(_base_row(cfg), status="error", note="not built: the part's time limit"))
            continue
        t = time.perf_counter()
        try:
            run = StepRun(cfg, device)
            run.warm_up(warmup)
            runs.append(run)
            print(f"  {part} {cfg.config} {cfg.method}: built + {warmup} warm-up steps in "
                  f"{time.perf_counter() - t:.1f} s, resident {run.resident / 2 ** 20:.0f} MiB", flush=True)
        except Exception as e:
            status = "oom" if "out of memory" in str(e).lower() else (
                "not applicable" if isinstance(e, (ValueError, RuntimeError)) and str(e).startswith("liger")
                else "error")
            rows.append(dict(_base_row(cfg), status=status, note=f"{type(e).__name__}: {str(e)[:400]}"))
            print(f"  {part} {cfg.config} {cfg.method}: {status}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            if os.environ.get("GPU_RUN_TRACEBACKS"):
                traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
    for i in range(steps):
        if time.time() > deadline:
            print(f"  {part}: time limit after {i} measured rounds", flush=True)
            break
        for run in list(runs):
            try:
                run.measured_step()
            except Exception as e:
                rows.append(dict(_base_row(run.cfg), status="error", note=f"step {i}: {type(e).__name__}: {e}"))
                runs.remove(run)
    for run in runs:
        r = run.row(smoke)
        rows.append(r)
        print(f"  {part} {r['config']:16s} {r['method']:22s} peak {r.get('peak_mib', '-'):>7s} MiB  "
              f"{r.get('throughput', '-')} {r.get('throughput_unit', '')}", flush=True)
    order = {(c.config, c.method): i for i, c in enumerate(cfgs)}
    for r in sorted(rows, key=lambda r: order.get((r["config"], r["method"]), len(order))):
        sink.write(r)
    facts = {}
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        facts = dict(max_memory_allocated=torch.cuda.max_memory_allocated(),
                     max_memory_reserved=torch.cuda.max_memory_reserved(),
                     memory_reserved=torch.cuda.memory_reserved(), memory_allocated=torch.cuda.memory_allocated(),
                     device_used=total - free, outside_allocator=total - free - torch.cuda.memory_reserved())
    return facts


# ------------------------------------------------------------------------------------------------ estimates
def _estimate_one(cfg: StepConfig, cuda_dropout: bool = False) -> dict:
    """lowmembp's estimate of ``cfg``'s step; ``cuda_dropout``: dropout as CUDA runs it (a 1-byte mask, where the CPU
    dropout of the fake step keeps one of the input's dtype), for the rows measured on a GPU with dropout > 0."""
    import torch
    torch.set_num_threads(max(1, int(os.environ.get("GPU_RUN_EST_THREADS", "2"))))
    import torch.nn.functional as F

    from lowmembp.estimator.step import estimate
    from experiments.repro.official_qlora import cuda_dropout as cuda_like
    t = time.perf_counter()
    row = dict(config=cfg.config, method=cfg.method)
    plain_dropout = F.dropout
    try:
        if cuda_dropout:
            F.dropout = cuda_like
        est = estimate(cfg.model, cfg.method, batch_size=cfg.batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype,
                       layers=cfg.layers, overrides=cfg.overrides, **cfg.options)
        row.update(status="ok", estimate_bytes=int(est["peak"]["bytes"]), saved_bytes=int(est["saved"]["total"]))
    except Exception as e:
        row.update(status="no estimate", note=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        F.dropout = plain_dropout
    row["seconds"] = f"{time.perf_counter() - t:.1f}"
    return row


def run_estimates(ctx, sink, deadline: float, workers: int = 1) -> None:
    cfgs = [c for c in step_configs(ctx.smoke) if not missing_methods(c.method)]
    for c in step_configs(ctx.smoke):
        if missing_methods(c.method):
            sink.write(dict(config=c.config, method=c.method, status="method not available"))
    if workers <= 1:
        for c in cfgs:
            if time.time() > deadline:
                sink.write(dict(config=c.config, method=c.method, status="no estimate", note="time limit"))
                continue
            r = _estimate_one(c, cuda_dropout=not ctx.smoke)
            sink.write(r)
            print(f"  estimate {r['config']} {r['method']}: {r.get('estimate_bytes', r.get('note'))}", flush=True)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futs = {pool.submit(_estimate_one, c, not ctx.smoke): c for c in cfgs}  # GPU rows: CUDA's dropout
        done, pending = wait(futs, timeout=max(1.0, deadline - time.time()))
        for f in done:
            r = f.result() if f.exception() is None else dict(config=futs[f].config, method=futs[f].method,
                                                              status="no estimate", note=repr(f.exception()))
            sink.write(r)
            print(f"  estimate {r['config']} {r['method']}: {r.get('estimate_bytes', r.get('note'))}", flush=True)
        for f in pending:
            f.cancel()
            sink.write(dict(config=futs[f].config, method=futs[f].method, status="no estimate", note="time limit"))
        pool.shutdown(wait=False, cancel_futures=True)


def estimator_error(measured: list[dict], estimates: list[dict]) -> list[dict]:
    """Rows of estimator_error.csv: every measured configuration beside its estimate, ratio = measured / estimate."""
    est = {(e["config"], e["method"]): e for e in estimates}
    out = []
    for m in measured:
        e = est.get((m["config"], m["method"]), {})
        row = dict(config=m["config"], method=m["method"], estimate_bytes=e.get("estimate_bytes", ""),
                   measured_bytes=m.get("peak_bytes", ""), measured_how=m.get("measured_how", ""), ratio="")
        try:
            row["ratio"] = f"{int(m['peak_bytes']) / int(e['estimate_bytes']):.4f}"
        except (KeyError, ValueError, TypeError, ZeroDivisionError):
            row["note"] = "; ".join(x for x in (f"measured: {m.get('status')}" if m.get("status") != "ok" else "",
                                                f"estimate: {e.get('status', 'missing')} {e.get('note', '')}".strip()
                                                if e.get("status") != "ok" else "") if x)
        out.append(row)
    return out


def margin_from(errors: list[dict], allocator: dict, smoke: bool, where: str) -> dict | None:
    """``results/gpu/margin.json`` for :func:`lowmembp.plan.sources.margin`: the fraction that covers the worst
    measured/estimated ratio times the allocator's reserved/allocated ratio, and the bytes outside the allocator."""
    ratios = [float(r["ratio"]) for r in errors if r.get("ratio")]
    if not ratios:
        return None
    frag = max([a["max_memory_reserved"] / a["max_memory_allocated"] for a in allocator.values()
                if a.get("max_memory_allocated")] or [1.0])
    fraction = max(0.0, max(ratios) * frag - 1.0)
    reserved = max([int(a.get("outside_allocator", 0)) for a in allocator.values()] or [0])
    src = (f"{where}: worst measured/estimated peak {max(ratios):.3f} over {len(ratios)} configurations "
           f"x reserved/allocated {frag:.3f}; reserved = device memory outside PyTorch's allocator")
    if smoke:
        src = "CPU dry run of benchmarks/gpu_run.py — NOT a measurement: " + src
    return {"fraction": round(fraction + 0.005, 2), "reserved_bytes": int(reserved), "source": src,
            "ratios": {f"{r['config']} {r['method']}": float(r["ratio"]) for r in errors if r.get("ratio")}}

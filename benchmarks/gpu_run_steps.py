"""Parts "fig1", "bound", "llama" and "estimates" of benchmarks/gpu_run.py: whole training steps measured by the
allocator, and lowmembp's fake-tensor estimate of the same steps.

fig1 and bound run their cells through the training job (:func:`run_job_part`: ``experiments.interleave``, the job's
own cells on random weights and generated inputs of the paper's shapes, ``--synthetic-data``, stepped in turns round
by round, one job record per cell under ``<out>/<part>_runs/``), and their CSV rows are read from those records;
llama still runs on this file's own step (:class:`StepRun`), which builds the estimator's models and their optimizers.

fig1   (through the training job) LowMemoryBP Fig. 1 (docs/design.md#papers): timm ViT-B/16 (random weights),
       batch 64, fp16 autocast, LoRA r4 on
       qkv only FIRST (Fig. 1's setting, the official lora_qv: q and v, here one adapter on timm's fused qkv;
       experiments/configs/vit-b16-cifar100-lora-qv.yaml), then on all linears (qkv, proj, fc1, fc2: lora_all):
       lora, lora+checkpointing, lora+mesa-gelu-ln, lora+lowmembp, lora+liger (refused for timm models: recorded so);
       then Fig. 1's setting with the step captured in a CUDA graph (``--capture cuda-graphs``: lora and the three
       levers; refused off CUDA, so the CPU dry run records them "skipped"), and ``lora+lowmembp`` with the official
       CUDA ops swapped into the same ViT (``benchmarks/official_lomem.py``; the dry run: their stand-in).
bound  (through the training job) the device-bound setting: ViT-B/16 at batch 256, LoRA r4 on qkv, fp16 — lora and
       the three levers, eager: a step several times the host's time, so the ratios compare with the paper's GPU.
llama  transformers LLaMA-7B width (hidden 4096, intermediate 11008, 32 heads, vocabulary 32000), 4 layers, bf16
       autocast over fp32 weights, two configurations:
       ``llama7b-4layers``: batch 4 x seq 640 (the official run's longest batch: source 512 + target 128), LoRA r64
       α16 with dropout 0.1 on all linears (experiments/configs/llama-7b-alpaca-lora.yaml; the base in fp32 under
       bf16 autocast, not NF4): lora, lora+lowmembp, lora+liger, lora+checkpointing, then the peers lora+cce (Cut
       Cross-Entropy's Triton kernel, ``impl="cce"``: refused off CUDA), velora (peft's VeLoRA, ``num_groups`` 64,
       which divides both input widths; LoRA dropout 0, as peft's VeLoRA has none) and lora+tiled-mlp (the
       library's default tiles of hidden_size tokens: the 2560 tokens make one tile, the MLP recomputed in the
       backward). Their estimates run dropout as CUDA does (a 1-byte mask; the CPU dropout of a fake step keeps one
       of the input's dtype); in the CPU dry run both sides use the CPU's.
       ``llama7b-4layers-full``: full fine-tuning (``baseline``: every weight trained, embeddings and head included,
       1.07e9 parameters) at batch 1 x 640, once per optimizer of ``lowmembp.methods.optimizers.OPTIMIZERS``
       (adamw, adamw8bit, adamw-fused-backward). Batch 1, so that the step's peak falls where the optimizer levers
       act: the estimate (``estimate("llama-7b", "baseline", batch_size=1, seq_len=640, layers=4, optimizer=...)``)
       puts it at 17.16e9 bytes with adamw (4.29e9 fp32 weights + 3.76e9 gradients in flight + 8.57e9 fp32 states
       at the optimizer step), 10.76e9 with adamw8bit (2.18e9 of 8-bit states and their absmax) and 15.88e9 with
       adamw-fused-backward (no gradient outlives its own step: the peak moves into the backward); at batch 4 the
       forward's 5.3e9 bytes of activations set the peak (18.2e9 with adamw and adamw-fused-backward alike). All
       three stay resident beside the seven LoRA models (about 4.5e9 bytes each): about 64e9 bytes on the device.
       ``adamw8bit`` needs bitsandbytes: without it the row is "skipped" with the library's reason.
Each model is built once (fp32 weights under autocast, as :func:`lowmembp.estimator.step.estimate` builds them), warmed
up right after its build, then the configurations take steps in turn (round-robin), so drifts of clock or temperature
hit them alike. A step is forward, loss, backward, the optimizer's step (the optimizer
:func:`lowmembp.estimator.step.make_optimizer` builds for the row's name: AdamW lr 1e-4, wd 0.1, torch's fused kernel;
bitsandbytes' AdamW8bit; or AdamW fused into the backward), ``zero_grad(set_to_none=True)`` — the step the estimate
measures, on the batch and loss the estimate builds. A configuration is built only while the part's time limit leaves
room for it and for the measured rounds of those built (the last warm-up step's time x their steps); one that is not
is recorded "error: not built".

A method that refuses the device or the model is recorded with the library's message, not as a failure:
"not applicable" (a ValueError of the method: it has no path for this model, e.g. Liger for timm), "refused" (its
RuntimeError: e.g. Liger's and CCE's CUDA-only kernels on the CPU) or "skipped" (an optional package missing:
an ImportError, e.g. bitsandbytes for adamw8bit).

Peak of one configuration's step with the others resident: ``max_memory_allocated`` after
``reset_peak_memory_stats`` minus what was allocated when the step began, plus the configuration's own resident
bytes (``memory_allocated`` after its warm-up minus before its build: weights, optimizer state, batch, buffers).
The median over its steps is reported. CPU dry run: tiny models, the CPU storage tracker of
:func:`lowmembp.measurement.peak.measure_step_peak` stands in for the allocator (flagged), times are no measurement.

estimates  :func:`lowmembp.estimator.step.estimate` of every configuration (CPU, fake tensors; run in parallel with the
GPU parts by benchmarks/gpu_run.py), with the row's optimizer. Methods the estimator cannot follow on fake tensors
(``lowmembp.plan.combos.NOT_ESTIMATED``: liger, cce) get "no estimate" with that reason.
"""
from __future__ import annotations

import os
import statistics
import time
import traceback
from dataclasses import dataclass, field

from lowmembp.methods.optim_levers import LEVERS
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS

STEP_COLUMNS = ["config", "model", "method", "optimizer", "lora_targets", "batch_size", "seq_len", "dtype", "status",
                "steps", "peak_bytes", "peak_mib", "resident_bytes", "step_ms_p20", "step_ms_p50", "step_ms_p80",
                "throughput", "throughput_unit", "measured_how", "note"]
ESTIMATE_COLUMNS = ["config", "method", "optimizer", "estimate_bytes", "saved_bytes", "seconds", "status", "note"]
ERROR_COLUMNS = ["config", "method", "optimizer", "estimate_bytes", "measured_bytes", "ratio", "measured_how", "note"]

FIG1_METHODS = ["lora", "lora+checkpointing", "lora+mesa-gelu-ln", "lora+lowmembp", "lora+liger"]
CAPTURED_METHODS = ["lora", "lora+checkpointing", "lora+mesa-gelu-ln", "lora+lowmembp"]
BOUND_METHODS = ["lora", "lora+checkpointing", "lora+mesa-gelu-ln", "lora+lowmembp"]
JOB_PARTS = ("fig1", "bound")  # the parts whose cells run through the training job
# the LoRA configuration: the four rows of the official LLaMA recipe's levers, then the peers
LLAMA_METHODS = ["lora", "lora+lowmembp", "lora+liger", "lora+checkpointing", "lora+cce", "velora", "lora+tiled-mlp"]
LLAMA_LORA = {"rank": 64, "alpha": 16, "dropout": 0.1}  # experiments/configs/llama-7b-alpaca-lora.yaml
# the full fine-tuning configuration: one row per optimizer lever of the library
# (AdamW and its two levers; the other packages' optimizers and CompAct: benchmarks/gpu_full_ft_levers.py)
LLAMA_FULL_METHOD, LLAMA_FULL_OPTIMIZERS = "baseline", [o for o in OPTIMIZERS if o not in LEVERS]
# VeLoRA's groups: a divisor of both input widths (LLaMA-7B: 4096 and 11008 = 64 x 172; peft's default 64), below
# the narrower; the dry run's widths (64 and 172) take 4
VELORA_GROUPS = {False: 64, True: 4}
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
    optimizer: str = DEFAULT_OPTIMIZER  # a name of lowmembp.methods.optimizers.OPTIMIZERS
    capture: str = "none"  # the training job's --capture
    ops: str = "ours"      # "official": the official CUDA ops swapped into the model after the job built it


def row_key(row) -> tuple[str, str, str]:
    """The key of a configuration or of a row of fig1.csv / llama.csv / estimates.csv: config, method, optimizer."""
    get = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
    return get("config"), get("method"), get("optimizer") or DEFAULT_OPTIMIZER


def llama_options(method: str, smoke: bool) -> dict:
    """The method options of a row of the LoRA configuration: LLaMA's LoRA (VeLoRA: no dropout, its groups), CCE's
    Triton kernel named (``impl="cce"``: the GPU measures the kernel; the CPU refuses it, rather than running its
    torch.compile path)."""
    names = [n.strip() for n in method.split("+")]
    opts = dict(LLAMA_LORA)
    if "velora" in names:
        del opts["dropout"]  # peft's VeLoRA layers take no LoRA dropout
        opts["num_groups"] = VELORA_GROUPS[smoke]
    if "cce" in names:
        opts["impl"] = "cce"
    return opts


def step_configs(smoke: bool) -> list[StepConfig]:
    out = []
    vit = dict(dtype="fp16", layers=2 if smoke else None, overrides=dict(VIT_SMOKE) if smoke else None)
    for targets, label in (("qkv", "qkv"), (None, "all")):  # Fig. 1's setting (lora_qv) first
        for m in FIG1_METHODS:
            out.append(StepConfig("fig1", f"fig1-{label}", "vit-b16", m, {"rank": 4, "targets": targets},
                                  batch_size=2 if smoke else 64,
                                  lora_targets="qkv, proj, fc1, fc2" if targets is None else targets, **vit))
    for m in CAPTURED_METHODS:
        out.append(StepConfig("fig1", "fig1-qkv-cuda-graphs", "vit-b16", m, {"rank": 4, "targets": "qkv"},
                              batch_size=2 if smoke else 64, lora_targets="qkv (cuda-graphs)", capture="cuda-graphs",
                              **vit))
    out.append(StepConfig("fig1", "fig1-qkv-official", "vit-b16", "lora+lowmembp", {"rank": 4, "targets": "qkv"},
                          batch_size=2 if smoke else 64, lora_targets="qkv (official ops)", ops="official", **vit))
    for m in BOUND_METHODS:
        out.append(StepConfig("bound", "vit-b16-bs256-qkv", "vit-b16", m, {"rank": 4, "targets": "qkv"},
                              batch_size=4 if smoke else 256, lora_targets="qkv", **vit))
    llama = dict(seq_len=16 if smoke else 640, dtype="bf16", layers=2 if smoke else 4)
    for m in LLAMA_METHODS:
        out.append(StepConfig("llama", "llama7b-4layers", "llama-7b", m, llama_options(m, smoke),
                              batch_size=2 if smoke else 4, overrides=dict(LLAMA_SMOKE) if smoke else None,
                              lora_targets="all linears", **llama))
    for opt in LLAMA_FULL_OPTIMIZERS:
        out.append(StepConfig("llama", "llama7b-4layers-full", "llama-7b", LLAMA_FULL_METHOD, {}, batch_size=1,
                              overrides=dict(LLAMA_SMOKE) if smoke else None, lora_targets="none (full fine-tuning)",
                              optimizer=opt, **llama))
    return out


def missing_methods(method: str) -> list[str]:
    import lowmembp
    known = lowmembp.list_methods()
    return [n for n in method.split("+") if n.strip() not in known]


# ------------------------------------------------------------------------------------------------- one model
def off_device(model, device) -> list[str]:
    """Names of the parameters and buffers of ``model`` that are not on ``device``'s type: tensors a method created
    when it was applied to a model already on the GPU and left on the CPU (where the step would fail with "Expected
    all tensors to be on the same device")."""
    import itertools

    import torch
    kind = torch.device(device).type
    return [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.device.type != kind]


def _stray_note(run, device) -> str:
    stray = getattr(run, "stray", None) or []
    return (f"the method left {len(stray)} tensors off {device} ({', '.join(stray[:3])}"
            f"{', ...' if len(stray) > 3 else ''}); ") if stray else ""


class StepRun:
    """One configuration: model, optimizer, batch and its step, built on ``device``."""

    def __init__(self, cfg: StepConfig, device: str):
        import torch
        import lowmembp
        from lowmembp.estimator.step import DTYPES, MODELS, _batch, _loss, build, make_optimizer
        from lowmembp.measurement.peak import prime_optimizer

        self.cfg, self.device, self.torch = cfg, device, torch
        spec = MODELS[cfg.model]
        cuda = device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        self.before = torch.cuda.memory_allocated() if cuda else 0
        model = build(spec, layers=cfg.layers, overrides=cfg.overrides, device=device)
        model = lowmembp.apply(model, cfg.method, **cfg.options)  # (liger changes this instance only)
        self.stray = off_device(model, device)  # applied after the model is on the device, as a user would
        model.train()
        self.model = model
        self.opt = make_optimizer(model, cfg.optimizer)  # the estimate's optimizer for that name
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
        self.step_s = 0.0  # the last warm-up step's seconds (what the part reserves for each measured step)
        self.peaks, self.times, self.how = [], [], ""

    def _sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def warm_up(self, n: int):
        for _ in range(n):
            self._sync()
            t = time.perf_counter()
            self.step()
            self._sync()
            self.step_s = time.perf_counter() - t
        if self.device == "cuda":
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
        if self.stray:
            r["note"] = "; ".join(x for x in (_stray_note(self, self.device).rstrip("; "), r.get("note")) if x)
        if not smoke:
            r.update(step_ms_p20=f"{q(0.2):.2f}", step_ms_p50=f"{p50 * 1e3:.2f}", step_ms_p80=f"{q(0.8):.2f}",
                     throughput=f"{units / p50:.1f}", throughput_unit="img/s" if cfg.part == "fig1" else "tokens/s")
        else:
            r["note"] = "; ".join(x for x in ("CPU dry run: no timing", r.get("note")) if x)
        return r


def _base_row(cfg: StepConfig) -> dict:
    return dict(config=cfg.config, model=cfg.model, method=cfg.method, optimizer=cfg.optimizer,
                lora_targets=cfg.lora_targets, batch_size=cfg.batch_size, seq_len=cfg.seq_len or "", dtype=cfg.dtype)


def refusal_status(cfg: StepConfig, e: BaseException) -> str:
    """The row status of a configuration whose build or warm-up raised ``e``: "oom"; "skipped" (an ImportError: an
    optional package missing, e.g. bitsandbytes for adamw8bit); "not applicable" (a ValueError of one of the row's
    methods, its message prefixed with the method's name: no path for this model); "refused" (such a RuntimeError:
    the method refuses this device, e.g. CUDA-only kernels on the CPU); else "error"."""
    msg = str(e)
    if "out of memory" in msg.lower():
        return "oom"
    if isinstance(e, ImportError):
        return "skipped"
    own = any(msg.startswith(f"{n.strip()}:") for n in cfg.method.split("+"))
    if own and isinstance(e, ValueError):
        return "not applicable"
    if own and isinstance(e, RuntimeError):
        return "refused"
    return "error"


def build_run(cfg: StepConfig, device: str, warmup: int):
    """``(run, None)``: ``cfg`` built and warmed up; or ``(None, row)``: the row saying why not (see
    :func:`refusal_status`; the note carries the exception's message)."""
    run = None
    try:
        run = StepRun(cfg, device)
        run.warm_up(warmup)
        return run, None
    except Exception as e:
        if os.environ.get("GPU_RUN_TRACEBACKS"):
            traceback.print_exc()
        return None, dict(_base_row(cfg), status=refusal_status(cfg, e),
                          note=f"{_stray_note(run, device)}{type(e).__name__}: {str(e)[:600]}")


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
    build_s = []
    for cfg in cfgs:
        label = f"{part} {cfg.config} {cfg.method} {cfg.optimizer}"
        missing = missing_methods(cfg.method)
        if missing:
            rows.append(dict(_base_row(cfg), status="method not available",
                             note=f"not in lowmembp.list_methods(): {', '.join(missing)}"))
            print(f"  {label}: method not available ({missing})", flush=True)
            continue
        # room for this build (as long as the longest so far but the first, which also paid the process's one-time
        # CUDA / cuBLAS / kernel start-up: 18.9 s of LLaMA's first build on the H200, 0.9-7.3 s the later ones) and
        # the measured rounds of every run, this one's step as long as the longest so far
        longest = max([r.step_s for r in runs] or [0.0])
        need = max(build_s[1:] or build_s or [0.0]) + steps * (sum(r.step_s for r in runs) + longest)
        if time.time() + need > deadline:
            rows.append(dict(_base_row(cfg), status="error",
                             note=f"not built: the part's time limit (kept for the {steps} measured rounds of the "
                                  f"{len(runs)} built)"))
            print(f"  {label}: not built (time limit)", flush=True)
            continue
        t = time.perf_counter()
        run, row = build_run(cfg, device, warmup)
        build_s.append(time.perf_counter() - t)
        if run is not None:
            runs.append(run)
            print(f"  {label}: built + {warmup} warm-up steps in {build_s[-1]:.1f} s, resident "
                  f"{run.resident / 2 ** 20:.0f} MiB, step {run.step_s * 1e3:.0f} ms", flush=True)
        else:
            rows.append(row)
            print(f"  {label}: {row['status']}: {row['note'][:200]}", flush=True)
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
        print(f"  {part} {r['config']:20s} {r['method']:18s} {r['optimizer']:20s} peak {r.get('peak_mib', '-'):>7s} "
              f"MiB  {r.get('throughput', '-')} {r.get('throughput_unit', '')}", flush=True)
    order = {row_key(c): i for i, c in enumerate(cfgs)}
    for r in sorted(rows, key=lambda r: order.get(row_key(r), len(order))):
        sink.write(r)
    facts = {}
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        facts = dict(max_memory_allocated=torch.cuda.max_memory_allocated(),
                     max_memory_reserved=torch.cuda.max_memory_reserved(),
                     memory_reserved=torch.cuda.memory_reserved(), memory_allocated=torch.cuda.memory_allocated(),
                     device_used=total - free, outside_allocator=total - free - torch.cuda.memory_reserved())
    return facts


# ------------------------------------------------------------------------------------- through the training job
JOB_TASK = {"vit-b16": "cifar100"}  # the paper task whose shapes a model's cells take (--synthetic-data)


def cell_name(cfg: StepConfig) -> str:
    """A file name for the configuration's job record: config and method (``+`` kept)."""
    return f"{cfg.config}__{cfg.method}"


def job_argv(cfg: StepConfig, smoke: bool) -> list[str]:
    """The training job's arguments of a fig1 / bound configuration (without --out): its paper task on generated
    data, the method and its options, the dtype, the capture; the dry run's tiny model on the CPU."""
    import json

    argv = ["--task", JOB_TASK[cfg.model], "--model", cfg.model, "--method", cfg.method, "--batch-size",
            str(cfg.batch_size), "--dtype", cfg.dtype, "--synthetic-data", "--seed", "0", "--steps", "100000",
            "--no-progress", "--optimizer", cfg.optimizer]
    for k, v in cfg.options.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)]
    if cfg.capture != "none":
        argv += ["--capture", cfg.capture]
    if cfg.layers is not None:
        argv += ["--layers", str(cfg.layers)]
    if cfg.overrides:
        argv += ["--synthetic-overrides", json.dumps(cfg.overrides)]
    if smoke:
        argv += ["--device", "cpu", "--threads", "1"]
    return argv


def _status_of(cfg: StepConfig, rec: dict) -> str:
    """A failed record's row status (:func:`refusal_status` of the exception its message names)."""
    msg = rec.get("message") or ""
    kind, _, text = msg.partition(": ")
    err = {"ValueError": ValueError, "RuntimeError": RuntimeError, "ImportError": ImportError,
           "ModuleNotFoundError": ImportError}.get(kind, Exception)(text)
    return "oom" if rec["status"] == "oom" else refusal_status(cfg, err)


def record_row(cfg: StepConfig, rec: dict, ratio: dict | None, smoke: bool, path: str) -> dict:
    """The fig1.csv / bound.csv row of ``cfg`` from its job record (the same columns as the step rows)."""
    r = _base_row(cfg)
    if rec["status"] != "ok":
        r.update(status=_status_of(cfg, rec), note=f"{(rec.get('message') or '')[:600]} ({path})")
        return r
    dev = rec["peak"]["device"] or {}
    cats = dev.get("by_category") or {}
    st = rec["step_time_s"]
    r.update(status="ok", steps=st["n"], peak_bytes=dev.get("bytes", ""),
             peak_mib=f"{dev.get('bytes', 0) / 2 ** 20:.0f}",
             resident_bytes=sum(int(cats.get(k, 0)) for k in ("parameters", "optimizer_state")),
             measured_how=f"the training job (experiments.interleave): {dev.get('how', '')}")
    notes = [f"record {path}"]
    if not smoke:
        r.update(step_ms_p20=f"{st['p20'] * 1e3:.2f}", step_ms_p50=f"{st['p50'] * 1e3:.2f}",
                 step_ms_p80=f"{st['p80'] * 1e3:.2f}", throughput=f"{rec['throughput']['samples_per_s']:.1f}",
                 throughput_unit="img/s")
        notes.insert(0, f"median step {st['p50'] * 1e3:.2f} ms, 95 % [{st['ci95_low'] * 1e3:.2f}, "
                        f"{st['ci95_high'] * 1e3:.2f}]")
        if ratio is not None:
            notes.insert(1, f"img/s vs its config's first row {1 / ratio['median']:.3f} "
                            f"[{1 / ratio['high']:.3f}, {1 / ratio['low']:.3f}]")
    else:
        notes.insert(0, "CPU dry run: no timing")
    r["note"] = "; ".join(notes)
    return r


def official_transform(ctx):
    """``fn(model)`` swapping the official CUDA ops into a model LowMemoryBP converted (the dry run: their stand-in),
    and a line saying what runs; ``(None, why)`` when they cannot be loaded."""
    from official_lomem import OfficialUnavailable, load_official, swap_into

    try:
        ops = load_official(ctx.third_party / "lomem", ctx.build_dir, stand_in=ctx.smoke)
    except (OfficialUnavailable, Exception) as e:  # the build's own failure: say why, the row is skipped
        return None, f"official ops unavailable: {type(e).__name__}: {str(e)[:300]}"
    return (lambda model: swap_into(model, ops)), f"{ops.source}; {ops.python}"


def run_job_part(ctx, part: str, sink, deadline: float, rounds: int | None = None) -> dict:
    """The configurations of ``part`` (fig1, bound) through the training job: each configuration group's cells built
    and stepped in turns (``experiments.interleave.run_cells``), one record each under ``<out>/<part>_runs/``, one row
    each into ``sink`` in :func:`step_configs`' order. Returns the allocator facts of the part."""
    import torch

    from experiments.interleave import run_cells

    smoke = ctx.smoke
    rounds = (2 if smoke else 20) if rounds is None else rounds
    cfgs = [c for c in step_configs(smoke) if c.part == part]
    runs_dir = ctx.out / f"{part}_runs"
    rows = {}
    groups: dict[str, list[StepConfig]] = {}
    for c in cfgs:
        groups.setdefault(c.config, []).append(c)
    for config, group in groups.items():
        if time.time() > deadline:
            for c in group:
                rows[row_key(c)] = dict(_base_row(c), status="error", note="not built: the part's time limit")
            continue
        todo, transform = [], {}
        for c in group:
            missing = missing_methods(c.method)
            if missing:
                rows[row_key(c)] = dict(_base_row(c), status="method not available",
                                        note=f"not in lowmembp.list_methods(): {', '.join(missing)}")
            elif c.capture != "none" and smoke:
                rows[row_key(c)] = dict(_base_row(c), status="skipped",
                                        note="CPU dry run: --capture needs CUDA (the job refuses it with exit 2)")
            else:
                todo.append(c)
        for c in [c for c in todo if c.ops == "official"]:
            fn, why = official_transform(ctx)
            if fn is None:
                rows[row_key(c)] = dict(_base_row(c), status="skipped", note=why)
                todo.remove(c)
            else:
                transform[cell_name(c)] = fn
                print(f"  {config}: official ops: {why}", flush=True)
        if not todo:
            continue
        print(f"  {part} {config}: {len(todo)} cells through the training job, {rounds} rounds", flush=True)
        records, ratios = run_cells({cell_name(c): job_argv(c, smoke) for c in todo}, rounds=rounds,
                                    warmup_rounds=1 if smoke else 2, out_dir=runs_dir, transform=transform,
                                    progress=lambda m: print(m, flush=True))
        for c in todo:
            name = cell_name(c)
            path = str((runs_dir / f"{name}.json").relative_to(ctx.out))
            rows[row_key(c)] = record_row(c, records[name], ratios.get(name), smoke, path)
            if c.ops == "official" and rows[row_key(c)]["status"] == "ok":
                rows[row_key(c)]["note"] += f"; {why}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for c in cfgs:
        r = rows[row_key(c)]
        sink.write(r)
        print(f"  {part} {r['config']:22s} {r['method']:18s} {r['status']:8s} peak {r.get('peak_mib', '-') or '-':>7s} "
              f"MiB  {r.get('throughput', '') or '-'} {r.get('throughput_unit', '')}", flush=True)
    facts = {}
    if torch.cuda.is_available() and not smoke:
        facts = dict(max_memory_allocated=torch.cuda.max_memory_allocated(),
                     max_memory_reserved=torch.cuda.max_memory_reserved())
    return facts


# ------------------------------------------------------------------------------------------------ estimates
def _estimate_one(cfg: StepConfig, cuda_dropout: bool = False) -> dict:
    """lowmembp's estimate of ``cfg``'s step; ``cuda_dropout``: dropout as CUDA runs it (a 1-byte mask, where the CPU
    dropout of the fake step keeps one of the input's dtype), for the rows measured on a GPU with dropout > 0."""
    import torch
    torch.set_num_threads(max(1, int(os.environ.get("GPU_RUN_EST_THREADS", "2"))))
    import torch.nn.functional as F

    from lowmembp.estimator.step import estimate
    from lowmembp.plan.combos import NOT_ESTIMATED
    from experiments.repro.official_qlora import cuda_dropout as cuda_like
    t = time.perf_counter()
    row = dict(config=cfg.config, method=cfg.method, optimizer=cfg.optimizer)
    unfollowed = [n.strip() for n in cfg.method.split("+") if n.strip() in NOT_ESTIMATED]
    if unfollowed:
        row.update(status="no estimate", seconds="0.0", note="; ".join(f"{n}: {NOT_ESTIMATED[n]}" for n in unfollowed))
        return row
    plain_dropout = F.dropout
    try:
        if cuda_dropout:
            F.dropout = cuda_like
        est = estimate(cfg.model, cfg.method, batch_size=cfg.batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype,
                       layers=cfg.layers, overrides=cfg.overrides, optimizer=cfg.optimizer, **cfg.options)
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
            sink.write(dict(config=c.config, method=c.method, optimizer=c.optimizer, status="method not available"))
    if workers <= 1:
        for c in cfgs:
            if time.time() > deadline:
                sink.write(dict(config=c.config, method=c.method, optimizer=c.optimizer, status="no estimate",
                                note="time limit"))
                continue
            r = _estimate_one(c, cuda_dropout=not ctx.smoke)
            sink.write(r)
            print(f"  estimate {' '.join(row_key(r))}: {r.get('estimate_bytes', r.get('note'))}", flush=True)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futs = {pool.submit(_estimate_one, c, not ctx.smoke): c for c in cfgs}  # GPU rows: CUDA's dropout
        done, pending = wait(futs, timeout=max(1.0, deadline - time.time()))
        for f in done:
            c = futs[f]
            r = f.result() if f.exception() is None else dict(config=c.config, method=c.method, optimizer=c.optimizer,
                                                              status="no estimate", note=repr(f.exception()))
            sink.write(r)
            print(f"  estimate {' '.join(row_key(r))}: {r.get('estimate_bytes', r.get('note'))}", flush=True)
        for f in pending:
            f.cancel()
            c = futs[f]
            sink.write(dict(config=c.config, method=c.method, optimizer=c.optimizer, status="no estimate",
                            note="time limit"))
        pool.shutdown(wait=False, cancel_futures=True)


def estimator_error(measured: list[dict], estimates: list[dict]) -> list[dict]:
    """Rows of estimator_error.csv: every measured configuration beside its estimate, ratio = measured / estimate."""
    est = {row_key(e): e for e in estimates}
    out = []
    for m in measured:
        e = est.get(row_key(m), {})
        row = dict(config=m["config"], method=m["method"], optimizer=row_key(m)[2],
                   estimate_bytes=e.get("estimate_bytes", ""),
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
            "ratios": {" ".join(row_key(r)): float(r["ratio"]) for r in errors if r.get("ratio")}}

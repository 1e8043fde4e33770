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
       then ``lora+lowmembp`` with the official CUDA ops swapped into the same ViT (``benchmarks/official_lomem.py``;
       the dry run: their stand-in), and last Fig. 1's setting with the step captured in a CUDA graph
       (``--capture cuda-graphs``: lora and the three levers; refused off CUDA, so the CPU dry run records them
       "skipped").
bound  (through the training job) the device-bound setting: ViT-B/16 at batch 256, LoRA r4 on qkv, fp16 — lora and
       the three levers, eager: a step several times the host's time, so the ratios compare with the paper's GPU.
llama  (through the training job) transformers LLaMA-7B width (hidden 4096, intermediate 11008, 32 heads, vocabulary
       32000), 4 layers, the weights in bf16 (as the job's alpaca task loads them) under bf16 autocast, two
       configurations:
       ``llama7b-4layers``: batch 4 x seq 640 (the official run's longest batch: source 512 + target 128), LoRA r64
       α16 with dropout 0.1 on all linears (experiments/configs/llama-7b-alpaca-lora.yaml, not NF4): lora,
       lora+lowmembp, lora+liger, lora+checkpointing, then the peers lora+cce (Cut Cross-Entropy's Triton kernel,
       ``impl="cce"``: refused off CUDA), velora (peft's VeLoRA, ``num_groups`` 64, which divides both input widths;
       LoRA dropout 0, as peft's VeLoRA has none) and lora+tiled-mlp (the library's default tiles of hidden_size
       tokens: the 2560 tokens make one tile, the MLP recomputed in the backward). Their estimates run dropout as
       CUDA does (a 1-byte mask; the CPU dropout of a fake step keeps one of the input's dtype); in the CPU dry run
       both sides use the CPU's.
       ``llama7b-4layers-full``: full fine-tuning (``baseline``: every weight trained, embeddings and head included,
       1.07e9 parameters) at batch 1 x 640, once per optimizer of ``lowmembp.methods.optimizers.OPTIMIZERS``
       (adamw, adamw8bit, adamw-fused-backward). Batch 1, so that the step's peak falls where the optimizer levers
       act: the estimate with bf16 weights (``estimate("llama-7b", "baseline", batch_size=1, seq_len=640, layers=4,
       weights="bf16", optimizer=...)``) puts it at 8.58e9 bytes with adamw, 6.47e9 with adamw8bit and 7.24e9 with
       adamw-fused-backward. ``adamw8bit`` needs bitsandbytes: without it the job refuses the row (exit 2) and it is
       "skipped" with the job's reason.
Every configuration's cells are the training job's (:func:`job_argv`), built and stepped by
``experiments.interleave`` (:func:`run_job_part`); the estimates count the weights in the rows' dtype
(``StepConfig.weights``).

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
import time
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
JOB_PARTS = ("fig1", "bound", "llama", "full_ft")  # the parts whose cells run through the training job
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
    weights: str = "fp32"  # the dtype the model's weights are stored in (the estimate's ``weights``): the job's
    #                        alpaca task loads LLaMA in its --dtype, so the llama rows' are bf16
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
    out.append(StepConfig("fig1", "fig1-qkv-official", "vit-b16", "lora+lowmembp", {"rank": 4, "targets": "qkv"},
                          batch_size=2 if smoke else 64, lora_targets="qkv (official ops)", ops="official", **vit))
    # the captured configuration last: a capture that fails can leave the process's CUDA state unusable
    for m in CAPTURED_METHODS:
        out.append(StepConfig("fig1", "fig1-qkv-cuda-graphs", "vit-b16", m, {"rank": 4, "targets": "qkv"},
                              batch_size=2 if smoke else 64, lora_targets="qkv (cuda-graphs)", capture="cuda-graphs",
                              **vit))
    for m in BOUND_METHODS:
        out.append(StepConfig("bound", "vit-b16-bs256-qkv", "vit-b16", m, {"rank": 4, "targets": "qkv"},
                              batch_size=4 if smoke else 256, lora_targets="qkv", **vit))
    llama = dict(seq_len=16 if smoke else 640, dtype="bf16", layers=2 if smoke else 4, weights="bf16")
    for m in LLAMA_METHODS:
        out.append(StepConfig("llama", "llama7b-4layers", "llama-7b", m, llama_options(m, smoke),
                              batch_size=2 if smoke else 4, overrides=dict(LLAMA_SMOKE) if smoke else None,
                              lora_targets="all linears", **llama))
    for opt in LLAMA_FULL_OPTIMIZERS:
        out.append(StepConfig("llama", "llama7b-4layers-full", "llama-7b", LLAMA_FULL_METHOD, {}, batch_size=1,
                              overrides=dict(LLAMA_SMOKE) if smoke else None, lora_targets="none (full fine-tuning)",
                              optimizer=opt, **llama))
    from gpu_full_ft_levers import full_ft_lever_configs  # (it builds on this module's StepConfig)

    return out + full_ft_lever_configs(smoke)


def missing_methods(method: str) -> list[str]:
    import lowmembp
    known = lowmembp.list_methods()
    return [n for n in method.split("+") if n.strip() not in known]


# ------------------------------------------------------------------------------------------------- the rows
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


# ------------------------------------------------------------------------------------- through the training job
JOB_TASK = {"vit-b16": "cifar100", "llama-7b": "alpaca"}  # the paper task whose shapes a model's cells take


def cell_name(cfg: StepConfig) -> str:
    """A file name for the configuration's job record: config, method (``+`` kept) and optimizer where it is not the
    default."""
    return f"{cfg.config}__{cfg.method}" + ("" if cfg.optimizer == DEFAULT_OPTIMIZER else f"__{cfg.optimizer}")


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
    if cfg.seq_len:
        argv += ["--max-len", str(cfg.seq_len)]
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
        tokens = cfg.part == "llama"
        thr = rec["throughput"]["tokens_per_s" if tokens else "samples_per_s"]
        r.update(step_ms_p20=f"{st['p20'] * 1e3:.2f}", step_ms_p50=f"{st['p50'] * 1e3:.2f}",
                 step_ms_p80=f"{st['p80'] * 1e3:.2f}", throughput=f"{thr:.1f}",
                 throughput_unit="tokens/s" if tokens else "img/s")
        notes.insert(0, f"median step {st['p50'] * 1e3:.2f} ms, 95 % [{st['ci95_low'] * 1e3:.2f}, "
                        f"{st['ci95_high'] * 1e3:.2f}]")
        if ratio is not None:
            notes.insert(1, f"speed vs its config's first row {1 / ratio['median']:.3f} "
                            f"[{1 / ratio['high']:.3f}, {1 / ratio['low']:.3f}]")
    else:
        notes.insert(0, "CPU dry run: no timing")
    r["note"] = "; ".join(notes)
    return r


def job_refuses(cfg: StepConfig, smoke: bool) -> dict | None:
    """The row of a configuration whose arguments the training job refuses (exit 2: e.g. ``--optimizer adamw8bit``
    without bitsandbytes, "skipped" with the job's message), or None."""
    from experiments.args import ArgError, parse_args

    try:
        parse_args(job_argv(cfg, smoke) + ["--out", os.devnull])
    except ArgError as err:
        skipped = "pip install" in str(err)  # an optional package missing
        cuda_only = "needs a CUDA device" in str(err)  # a lever with no CPU path (the dry run): its own refusal
        status = "skipped" if skipped else "refused" if cuda_only else "error"
        return dict(_base_row(cfg), status=status, note=f"the training job: {err}")
    return None


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
                refused = job_refuses(c, smoke)
                if refused:
                    rows[row_key(c)] = refused
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
        import gc

        gc.collect()  # the group's models (their step closures hold cycles) before the next group's build
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
                       weights=cfg.weights,
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

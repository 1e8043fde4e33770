"""The training job: one cell of the sweep (model × task × method × batch size × seed) → one JSON record.

    python -m experiments.train --task tweets-sentiment --model minilm-l6 --method lowmembp --batch-size 16 \
        --seed 0 --steps 60 --out results/runs/x.json
    python -m experiments.train --config experiments/configs/vit-b16-cifar100-lora.yaml --method lora+lowmembp \
        --batch-size 64 --seed 0 --out results/runs/y.json
    python -m experiments.train --list        # models, tasks, methods and their options

Exit status: 0 when a record was written — status ``ok``, ``oom`` (the cell does not fit: a CUDA
``OutOfMemoryError``, a CPU ``MemoryError``/allocation failure, or a measured peak over ``--max-memory-mb``) or
``error`` (any other failure of the training, with its message); 2 for a bad argument or missing data/weights,
at once, with a message listing what is valid or what to fetch.

What is measured (one record, schema ``experiments/record.schema.json``):
- step 0: activation bytes saved for backward by op kind (``lowmembp.memory.SavedTensorAccountant`` on the forward);
- step 1: peak memory of one whole steady training step (``lowmembp.peak.measure_step_peak``: CUDA allocator peak,
  on CPU torch's MemTracker);
- every later step after ``--timing-warmup`` steps: its wall time (CUDA synchronised), reported as p20/p50/p80;
  throughput = samples (tokens) of those steps / their total time;
- final loss: mean training loss of the last min(10, steps) steps; metric on the task's fixed test split.

Bases: ``--save-model PATH`` writes the trained weights (safetensors, atomically) and ``--init PATH`` starts a run
from them; with ``--init`` the record's options also hold the file's sha256, its metadata and
``init_metric_before`` — the base's metric on this run's test split, before any training (``experiments.weights``).
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
import traceback

from experiments.args import ArgError, listing, parse_args

OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


class MemoryBudgetExceeded(MemoryError):
    """The measured peak is over ``--max-memory-mb``: the run is recorded as ``oom``."""


def is_oom(err: BaseException) -> bool:
    import torch

    if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in OOM_WORDS)


def _batches(items, batch_size, seed, collate):
    """Endless batches: a new permutation of ``items`` (drawn with ``seed``) each epoch, last partial batch dropped."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if len(items) < batch_size:
        raise ValueError(f"the training pool has {len(items)} examples, fewer than one batch of {batch_size}")
    while True:
        order = rng.permutation(len(items))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield collate([items[i] for i in order[start:start + batch_size]])


def _to(batch, device):
    return {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}


def _schedule(step, total, warmup):
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _peak_fn():
    """lowmembp.peak.measure_step_peak, or a CUDA-only fallback while that module is missing."""
    try:
        from lowmembp.peak import measure_step_peak
        return measure_step_peak
    except ImportError:
        def fallback(model, optimizer, step, warmup=0, external=()):
            import torch
            dev = next(model.parameters()).device
            if dev.type != "cuda":
                step()
                return None
            torch.cuda.reset_peak_memory_stats(dev)
            step()
            return {"bytes": int(torch.cuda.max_memory_allocated(dev)), "how": "cuda max_memory_allocated"}
        return fallback


def train(cfg, task, state: dict) -> None:
    """Train and evaluate; fills ``state`` as it goes (so a failure still reports what was reached)."""
    import numpy as np
    import torch

    import lowmembp
    from lowmembp.memory import SavedTensorAccountant
    from lowmembp.timing import summarize as summarize_times

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    state["device"] = device
    if device.type == "cuda" and cfg.max_memory_mb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.max_memory_mb * 2**20 / total), device)
    _seed_everything(cfg.seed)
    setup = task.build(cfg.model, cfg)
    state["seq_len"] = setup.seq_len
    state["info"] = setup.info
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    eval_bs = cfg.eval_batch_size or 2 * cfg.batch_size

    def evaluate(net) -> float:
        net.eval()
        batches = (_to(setup.collate(setup.test[i:i + eval_bs]), device) for i in range(0, len(setup.test), eval_bs))
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            return float(setup.evaluate(net, batches))

    if cfg.init:
        from experiments.weights import load_weights

        state["info"].update(load_weights(setup.model, cfg.init))
        state["info"]["init_metric_before"] = evaluate(setup.model.to(device))  # the base, on this run's test split
    model = lowmembp.apply(setup.model, cfg.method, **cfg.method_options).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError(f"method {cfg.method!r} left no trainable parameter")
    per_step = cfg.batch_size * cfg.grad_accum
    steps = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * len(setup.train) / per_step))
    warmup = cfg.warmup_steps or 0
    if cfg.warmup_epochs is not None:
        warmup = math.ceil(cfg.warmup_epochs * len(setup.train) / per_step)
    state["steps_planned"] = steps
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, steps, warmup))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
    batches = _batches(setup.train, cfg.batch_size, cfg.seed, setup.collate)
    losses, times, samples, tokens = [], [], [], []
    measure_peak = _peak_fn()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def one_step(step: int, accountant=None) -> float:
        model.train()
        total_loss, n_tok = 0.0, 0
        for micro in range(cfg.grad_accum):
            batch = _to(next(batches), device)
            t = setup.tokens(batch)
            n_tok = None if t is None else n_tok + t
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                if accountant is not None and micro == 0:
                    with accountant:
                        loss = setup.loss(model, batch)
                else:
                    loss = setup.loss(model, batch)
            if not torch.isfinite(loss.detach()):
                raise FloatingPointError(f"training loss is {float(loss.detach())} at step {step} (lr {cfg.lr:g}): diverged")
            scaler.scale(loss / cfg.grad_accum).backward()
            total_loss += float(loss.detach()) / cfg.grad_accum
            del loss, batch
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        state["last_tokens"] = n_tok
        return total_loss

    from tqdm import tqdm

    bar = tqdm(range(steps), desc=f"{cfg.model}/{cfg.task}/{cfg.method}", disable=cfg.no_progress,
               file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    for step in bar:
        if step == 0:
            accountant = SavedTensorAccountant(model)
            loss = one_step(step, accountant)
            rep = accountant.report()
            state["activation_bytes"] = {"total": rep["total"], "by_kind": rep["by_kind"]}
        elif step == 1:
            box = {}
            try:
                peak = measure_peak(model, optimizer, lambda: box.setdefault("loss", one_step(step)), warmup=0)
            except Exception as err:  # the tracker failed, not necessarily the training: train on, say so
                if is_oom(err) or isinstance(err, FloatingPointError):
                    raise
                print(f"warning: peak-memory measurement failed ({type(err).__name__}: {err}); "
                      "peak_memory is null", file=sys.stderr)
                state["info"]["peak_memory_error"] = f"{type(err).__name__}: {err}"
                optimizer.zero_grad(set_to_none=True)
                peak = None
            loss = box["loss"] if "loss" in box else one_step(step)
            state["peak_memory"] = peak
            if peak is not None and cfg.max_memory_mb is not None and peak["bytes"] > cfg.max_memory_mb * 2**20:
                raise MemoryBudgetExceeded(
                    f"out of memory: measured peak {peak['bytes'] / 2**20:.1f} MiB ({peak['how']}) exceeds "
                    f"--max-memory-mb {cfg.max_memory_mb:g}")
        else:
            sync()
            t0 = time.perf_counter()
            loss = one_step(step)
            sync()
            if step >= cfg.timing_warmup:
                times.append(time.perf_counter() - t0)
                samples.append(per_step)
                tokens.append(state["last_tokens"])
        losses.append(loss)
        state["steps"] = step + 1
        if times:
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{sum(samples) / sum(times):.1f}", refresh=False)
        else:
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    bar.close()
    tail = losses[-min(10, len(losses)):]
    state["final_loss"] = float(np.mean(tail)) if tail else None
    if times:
        how = "cuda-synchronised perf_counter per step" if device.type == "cuda" else "perf_counter per step"
        state["step_time_s"] = summarize_times(times, how)
        tok = None if any(t is None for t in tokens) else sum(tokens) / sum(times)
        state["throughput"] = {"samples_per_s": sum(samples) / sum(times), "tokens_per_s": tok}
    value = evaluate(model)
    state["metric"] = {"name": setup.metric, "value": value, "split": f"test ({len(setup.test)})"}
    if cfg.save_model:
        from experiments.weights import save_weights

        save_weights(model, cfg.save_model, {
            "task": cfg.task, "model": cfg.model, "method": cfg.method, "train_split": cfg.train_split,
            "steps": steps, "batch_size": cfg.batch_size, "seed": cfg.seed, "lr": cfg.lr,
            "final_loss": state["final_loss"], "metric": f"{setup.metric} {value:.6g}",
            "metric_split": f"test ({len(setup.test)})"})


def make_record(cfg, state: dict, status: str, message: str | None) -> dict:
    from experiments.record import environment

    options = dict(cfg.method_options)
    options.update(lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps, train_split=cfg.train_split,
                   save_model=cfg.save_model,
                   grad_accum=cfg.grad_accum, limit=cfg.limit, eval_limit=cfg.eval_limit, max_len=cfg.max_len,
                   max_memory_mb=cfg.max_memory_mb, config=cfg.config)
    options.update(state.get("info", {}))
    import torch

    device = state.get("device") or torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return {
        "schema_version": 1, "model": cfg.model, "method": cfg.method, "task": cfg.task,
        "batch_size": cfg.batch_size, "seq_len": state.get("seq_len"), "dtype": cfg.dtype, "seed": cfg.seed,
        "steps": state.get("steps", 0), "epochs": cfg.epochs, "options": options, "status": status,
        "message": message, "peak_memory": state.get("peak_memory"),
        "activation_bytes": state.get("activation_bytes"), "step_time_s": state.get("step_time_s"),
        "throughput": state.get("throughput"), "final_loss": state.get("final_loss"), "metric": state.get("metric"),
        "env": environment(device), "started_at": state["started_at"], "finished_at": state["finished_at"],
    }


def summary(rec: dict, out: str) -> str:
    parts = [f"[{rec['status']}] {rec['model']}/{rec['task']}/{rec['method']} bs={rec['batch_size']} "
             f"seed={rec['seed']} dtype={rec['dtype']} steps={rec['steps']}"]
    if rec["final_loss"] is not None:
        parts.append(f"loss={rec['final_loss']:.4f}")
    if rec["metric"]:
        parts.append(f"{rec['metric']['name']}={rec['metric']['value']:.4f}")
    if rec["step_time_s"]:
        parts.append(f"step p50={rec['step_time_s']['p50'] * 1e3:.1f}ms")
    if rec["throughput"]:
        parts.append(f"{rec['throughput']['samples_per_s']:.1f} samples/s")
    if rec["peak_memory"]:
        parts.append(f"peak={rec['peak_memory']['bytes'] / 2**20:.1f}MiB")
    if rec["activation_bytes"]:
        parts.append(f"saved={rec['activation_bytes']['total'] / 2**20:.2f}MiB")
    if rec["message"]:
        parts.append(f"message={rec['message'][:300]!r}")
    return " ".join(parts) + f" -> {out}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--download" not in argv:  # no hub at run time unless asked (read by huggingface_hub at import)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        cfg, task = parse_args(argv)
    except ArgError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if task is None:  # --list
        print(listing())
        return 0
    from experiments.record import now, write_atomic

    state = {"started_at": now()}
    status, message = "ok", None
    try:
        train(cfg, task, state)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # every training failure becomes a record
        if is_oom(err):
            status, message = "oom", f"{type(err).__name__}: {err}"
        else:
            status, message = "error", f"{type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass
    state["finished_at"] = now()
    rec = make_record(cfg, state, status, message)
    write_atomic(rec, cfg.out)
    print(summary(rec, cfg.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

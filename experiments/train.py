"""The training job: one cell of the sweep (model × task × method × batch size × seed) → one JSON record.

    python -m experiments.train --task tweets-sentiment --model minilm-l6 --method lowmembp --batch-size 16 \
        --seed 0 --steps 60 --out results/runs/x.json
    python -m experiments.train --config experiments/configs/vit-b16-cifar100-lora.yaml --method lora+lowmembp \
        --batch-size 64 --seed 0 --out results/runs/y.json
    python -m experiments.train --list        # models, tasks, methods and their options

The optimizer (``--optimizer``, recorded in the record's ``run``): ``adamw`` (default), ``adamw8bit`` or
``adamw-fused-backward`` (:mod:`lowmembp.methods.optimizers`; the loop is the same for all three: with the step in
the backward, ``step()`` and ``zero_grad()`` find nothing left to do); or one of the full-fine-tuning levers of
other packages (:mod:`lowmembp.methods.optim_levers`: GaLore, APOLLO, Adafactor, torchao, paged AdamW).

Exit status: 2 for a bad argument (any of them: ranges, an unwritable ``--out`` / ``--save-model``, ``--device cuda``
without CUDA, missing data or weights), at once, before any work, with a message saying what is valid or what to
fetch, and no record. Otherwise the run has started and it always ends with a record: status ``ok`` (exit 0),
``oom`` (the cell does not fit: a CUDA ``OutOfMemoryError``, a CPU ``MemoryError``/allocation failure, or a
measured peak over ``--max-memory-mb``) or ``error`` (any other failure, with its message), both exit 1 with the
status and the record's path on stderr (the sweep's ``run_cell.py`` counts a cell with a record as done).

What is measured (``experiments.probes``, on the schedule ``Schedule(saved_bytes_at=0, peak_at=1,
time_from=--timing-warmup)``; the record's layout: ``experiments.record``):
- step 0: activation bytes saved for backward by op kind (``lowmembp.measurement.saved.SavedTensorAccountant`` on the
forward);
- step 1: peak memory of one whole steady training step (``lowmembp.measurement.peak.measure_step_peak``: CUDA allocator
peak,
  on CPU torch's MemTracker);
- every later step from ``--timing-warmup`` on: its wall time (CUDA synchronised), reported as p20/p50/p80;
  throughput = samples (tokens) of those steps / their total time;
- final loss: mean training loss of the last min(10, steps) steps; metric on the task's fixed test split;
- with ``--eval-every N``: the metric also after every N-th step, the record's ``curve`` (the last point is the final
  metric; scoring runs between steps, outside the timed steps, and draws no random numbers, so the run trains exactly
  as without it).

Determinism: the same cell, seed and ``--threads`` on the same machine gives the same record (loss and metric to
the last digit on the CPU): the thread count is set (``torch.set_num_threads``), every generator is seeded from
``--seed``. Different thread counts split the CPU's reductions differently and so differ in the last digits, which
training amplifies. (``torch.use_deterministic_algorithms`` is not needed for this on the CPU and is left off: it is
process-wide and fills every new tensor, which would change the step times measured.)

Bases: ``--save-model PATH`` writes the trained weights (safetensors, atomically) and ``--init PATH`` starts a run
from them; the record's ``base`` keeps the file's path, sha256, metadata and ``metric_before`` — the base's metric
on this run's test split, before any training (``experiments.weights``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
import traceback

from experiments.args import ArgError, listing, parse_args
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER

OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")
CAPTURE_WARMUP = 3  # --capture cuda-graphs: warm-up steps on a side stream before the capture (PyTorch's recipe)


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


def _lr_factor(step, total, warmup):
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_deterministic(seed: int, threads: int) -> None:
    """Seed every generator the run draws from and fix what else decides the CPU's arithmetic (see module doc)."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(cfg):
    import torch

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if getattr(cfg, "distributed", None) and device.type == "cuda":  # torchrun: one GPU per local rank
        from experiments.distributed import env_world

        device = torch.device("cuda", env_world()[2])
    return device


def planned_steps(cfg, pool: int) -> tuple[int, int]:
    """(optimizer steps, warm-up steps) from ``--steps``/``--epochs`` and ``--warmup-steps``/``--warmup-epochs``."""
    per_step = cfg.batch_size * cfg.grad_accum
    steps = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * pool / per_step))
    warmup = cfg.warmup_steps or 0
    if cfg.warmup_epochs is not None:
        warmup = math.ceil(cfg.warmup_epochs * pool / per_step)
    return steps, warmup


class Run:
    """One run's parts, built from the configuration: the task's setup, the converted model on its device, the
    optimizer with its schedule, the batches; :meth:`step` is one optimizer step, :meth:`evaluate` the metric."""

    def __init__(self, cfg, task, out: dict, ctx=None):
        import torch

        import lowmembp
        from experiments.distributed import Context, block_modules

        self.cfg = cfg
        self._training_mode = False  # whether the model is in training mode (evaluate takes it out)
        self.dist = ctx = ctx or Context()
        self.device = device = resolve_device(cfg)
        if device.type == "cuda" and cfg.max_memory_mb:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.max_memory_mb * 2**20 / total), device)
        make_deterministic(cfg.seed, cfg.threads)
        if getattr(cfg, "synthetic_data", False):
            from experiments.tasks import synthetic

            self.setup = setup = synthetic.build(task, cfg.model, cfg, device)
        else:
            self.setup = setup = task.build(cfg.model, cfg)
        out["run"]["seq_len"] = setup.seq_len
        out["task_facts"] = dict(setup.info)
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        if cfg.init:
            from experiments.weights import load_weights

            out["base"] = load_weights(setup.model, cfg.init)
            out["base"]["metric_before"] = self.evaluate(setup.model.to(device))  # the base, on this test split
        blocks = block_modules(setup.model) if ctx.mode == "fsdp" else []
        self.model = lowmembp.apply(setup.model, cfg.method, **cfg.method_options).to(device)
        self.model = ctx.wrap(self.model, blocks, device)  # DDP / FSDP2 (experiments.distributed); else itself
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError(f"method {cfg.method!r} left no trainable parameter")
        self.steps, warmup = planned_steps(cfg, len(setup.train))
        out["run"]["steps_planned"] = self.steps
        from lowmembp.methods.optimizers import make_optimizer

        self.capture = getattr(cfg, "capture", None) or "none"
        # a captured step: torch's fused AdamW (its step on the device, steps skipped on the device when fp16's scaler
        # finds an inf) with the learning rate a device tensor, which the schedule refills between replays
        opt_kw = dict(lr=torch.tensor(float(cfg.lr), device=device), fused=True) if self.capture != "none" else \
            dict(lr=cfg.lr)
        self.optimizer = make_optimizer(params, cfg.optimizer, weight_decay=cfg.weight_decay,
                                        model=self.model, **opt_kw)  # GaLore / APOLLO: the layout's linears
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda s: _lr_factor(s, self.steps, warmup))
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
        if self.scaler.is_enabled():
            # fp16: the scaler skips the update of a step whose gradients overflow (its first steps, at scale 2^16),
            # so the optimizer's state might not exist yet at the peak's step 1; make it now (one step on zero
            # gradients), so that step 1 is a steady step
            from lowmembp.measurement.peak import prime_optimizer

            prime_optimizer(self.optimizer)
            out.setdefault("notes", []).append(
                "fp16: the optimizer's state was made before step 0 (one step on zero gradients), so that the peak "
                "of step 1 is a steady step's")
        self.batches = _batches(setup.train, cfg.batch_size, cfg.seed, setup.collate)
        self.captured = None
        if self.capture != "none":
            from lowmembp.measurement.capture import CapturedStep

            self.captured = CapturedStep(self._static_step, mode=self.capture, warmup=CAPTURE_WARMUP,
                                         zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True))

    def _static_step(self, batch):
        """One step as a capture records it: forward, scaled backward, the scaler's step and update (no host
        synchronisation: the fused AdamW takes the scaler's inf flag on the device); the loss stays on the device."""
        with self.autocast():
            loss = self.setup.loss(self.model, batch)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    def captured_step(self, step: int):
        """One step through :attr:`captured` (the first call also warms up and captures: ``CAPTURE_WARMUP`` extra
        steps on its batch)."""
        from experiments.probes import StepResult

        if not self._training_mode:
            self.model.train()
            self._training_mode = True
        batch = _to(self.dist.rows(next(self.batches), self.cfg.batch_size), self.device)
        n_tok = self.setup.tokens(batch)
        loss = float(self.captured(batch))  # the one synchronisation of the step
        if self.capture == "reduce-overhead":
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step} (lr {self.cfg.lr:g}): diverged")
        return StepResult(loss=loss, samples=self.cfg.batch_size, tokens=n_tok)

    def autocast(self):
        import torch

        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)

    def evaluate(self, net=None) -> float:
        net = self.model if net is None else net
        setup, bs = self.setup, self.cfg.eval_batch_size or 2 * self.cfg.batch_size
        net.eval()
        self._training_mode = False
        batches = (_to(setup.collate(setup.test[i:i + bs]), self.device) for i in range(0, len(setup.test), bs))
        with self.autocast():
            return float(setup.evaluate(net, batches))

    def step(self, step: int, forward):
        """One optimizer step over ``grad_accum`` micro-batches; ``forward`` wraps the first micro-batch's forward.
        With ``--capture``, the steps after the memory probes' run captured (:meth:`captured_step`)."""
        import torch

        from experiments.probes import StepResult

        cfg, setup = self.cfg, self.setup
        if self.captured is not None and step > self.schedule.saved_bytes_at and step > self.schedule.peak_at:
            return self.captured_step(step)
        if not self._training_mode:  # after an evaluation only: train() visits every module, a cost that grows with
            self.model.train()  # their number (a method's extra modules would pay it on every step)
            self._training_mode = True
        losses, n_tok = [], 0
        for micro in range(cfg.grad_accum):
            batch = _to(self.dist.rows(next(self.batches), cfg.batch_size), self.device)  # a rank's rows
            t = setup.tokens(batch)
            n_tok = None if t is None or n_tok is None else n_tok + t
            with self.autocast(), (forward if micro == 0 else contextlib.nullcontext()):
                loss = setup.loss(self.model, batch)
            self.scaler.scale(loss / cfg.grad_accum).backward()
            losses.append(loss.detach())
            del loss, batch
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        # the losses read back once, after the whole step is queued (on a GPU a read in the middle would hold the
        # host until the forward had run, and the device idle while the host then queued the backward)
        values = torch.stack(losses).tolist() if len(losses) > 1 else [float(losses[0])]
        total_loss = 0.0
        for v in values:
            if not math.isfinite(v):
                raise FloatingPointError(f"training loss is {v} at step {step} (lr {cfg.lr:g}): diverged")
            total_loss += v / cfg.grad_accum
        total_loss, n_tok = self.dist.reduce_step(total_loss, n_tok)  # over ranks: the global batch's
        return StepResult(loss=total_loss, samples=cfg.batch_size * cfg.grad_accum, tokens=n_tok)

    def probes(self):
        """The measurements and when they run (see the module doc)."""
        from experiments.probes import PeakProbe, SavedBytesProbe, Schedule, StepTimer

        cfg = self.cfg
        # captured: steps 0 and 1 (the memory probes) run eagerly, step 2 warms up and captures: timed from step 3 on
        time_from = cfg.timing_warmup if self.captured is None else max(cfg.timing_warmup, 3)
        schedule = self.schedule = Schedule(saved_bytes_at=0, peak_at=1, time_from=time_from)
        budget = None if cfg.max_memory_mb is None else cfg.max_memory_mb * 2**20
        from experiments.distributed import peak_measure

        measure = peak_measure(self.dist, self.device)
        if measure is None and getattr(cfg, "synthetic_data", False):
            # the generated batch is made once, before the step: count it, as a batch made inside the step counts
            from functools import partial

            from lowmembp.measurement.peak import measure_step_peak

            measure = partial(measure_step_peak, external=tuple(self.setup.collate([]).values()))
        return [SavedBytesProbe(self.model, schedule.saved_bytes_at),
                PeakProbe(self.model, self.optimizer, schedule.peak_at, budget,
                          is_fatal=lambda e: is_oom(e) or isinstance(e, FloatingPointError),
                          measure=measure),
                StepTimer(self.device, schedule)]

    def save(self, path: str, out: dict) -> None:
        from experiments.distributed import weights_of
        from experiments.weights import save_weights

        cfg = self.cfg
        model = weights_of(self.model, self.dist)  # FSDP: gathered on every rank; only rank 0 writes
        if not self.dist.writes:
            return
        save_weights(model, path, {
            "task": cfg.task, "model": cfg.model, "method": cfg.method, "train_split": cfg.train_split,
            "steps": self.steps, "batch_size": cfg.batch_size, "seed": cfg.seed, "lr": cfg.lr,
            "final_loss": out["final_loss"], "metric": f"{out['metric']['name']} {out['metric']['value']:.6g}",
            "metric_split": out["metric"]["split"]})


def train(cfg, task, out: dict, ctx=None) -> None:
    """Train and evaluate; fills ``out`` (record sections) as it goes, so a failure still reports what was reached.
    ``ctx``: this process's place in a torchrun job (``experiments.distributed.Context``; None: one process)."""
    import numpy as np
    from tqdm import tqdm

    from experiments.distributed import Context, section
    from experiments.probes import PeakProbe, StepTimer, run_step

    ctx = ctx or Context()
    run = Run(cfg, task, out, ctx)
    probes = run.probes()
    timer = next(p for p in probes if isinstance(p, StepTimer))
    losses = []
    every = getattr(cfg, "eval_every", None)
    curve = {"every": every, "points": []} if every else None
    since = 0  # losses[since:] are the steps after the last curve point
    bar = tqdm(range(run.steps), desc=f"{cfg.model}/{cfg.task}/{cfg.method}",
               disable=cfg.no_progress or not ctx.writes, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    try:
        for step in bar:
            result = run_step(step, lambda forward: run.step(step, forward), probes)
            losses.append(result.loss)
            out["run"]["steps"] = step + 1
            speed = timer.samples_per_s()
            bar.set_postfix(loss=f"{result.loss:.4f}", **({"samples_s": f"{speed:.1f}"} if speed else {}),
                            refresh=False)
            if curve is not None and (step + 1) % every == 0 and step + 1 < run.steps:
                curve["points"].append({"step": step + 1, "metric": run.evaluate(),
                                        "train_loss": float(np.mean(losses[since:]))})
                since = len(losses)
                out["curve"] = curve  # a run that fails later still reports its curve so far
    finally:
        bar.close()
        for probe in probes:  # what was measured counts also when a later step fails
            probe.report(out)
    peak = next(p for p in probes if isinstance(p, PeakProbe)).result
    if ctx.active:  # every rank's peak (a collective: after the loop, which every rank finished)
        out["distributed"] = section(ctx, cfg.batch_size, peak and peak["bytes"], peak["how"] if peak else "")
    tail = losses[-10:]
    out["final_loss"] = float(np.mean(tail)) if tail else None
    if run.captured is not None:
        import torch

        what = (f"warms up ({CAPTURE_WARMUP} extra steps on its batch) and captures" if run.capture == "cuda-graphs"
                else "compiles")
        reserved = (f"; reserved after the run {torch.cuda.memory_reserved(run.device)} bytes (max "
                    f"{torch.cuda.max_memory_reserved(run.device)}: the graph's private pool included)"
                    if run.device.type == "cuda" else "")
        out.setdefault("notes", []).append(
            f"--capture {run.capture}: steps 0-1 eager (saved bytes, peak: peak.device is the eager step's), step 2 "
            f"{what}, timed from step {run.schedule.time_from}{reserved}")
    if getattr(cfg, "synthetic_data", False):
        out.setdefault("notes", []).append("synthetic data: no metric (generated inputs are not evaluated)")
        out["metric"] = None
    else:
        out["metric"] = {"name": run.setup.metric, "value": run.evaluate(), "split": f"test ({len(run.setup.test)})"}
    if curve is not None and out["metric"] is not None:
        curve["points"].append({"step": run.steps, "metric": out["metric"]["value"],
                                "train_loss": float(np.mean(losses[since:])) if losses[since:] else None})
        out["curve"] = curve
    if cfg.save_model:
        run.save(cfg.save_model, out)


def identity(cfg) -> dict:
    out = {"task": cfg.task, "model": cfg.model, "method": cfg.method, "batch_size": cfg.batch_size,
           "dtype": cfg.dtype, "seed": cfg.seed, "steps": 0, "epochs": cfg.epochs,
           "optimizer": getattr(cfg, "optimizer", None) or DEFAULT_OPTIMIZER}
    if (getattr(cfg, "capture", None) or "none") != "none":
        out["capture"] = cfg.capture
    if getattr(cfg, "synthetic_data", False):
        out["synthetic_data"] = True
    return out


def new_sections(cfg) -> dict:
    """The record's sections known before the run starts; ``train`` fills in the rest."""
    from experiments.record import HyperParameters

    hyper = {f.name: getattr(cfg, f.name, None) for f in dataclasses.fields(HyperParameters)}
    return {"run": identity(cfg), "method_options": dict(cfg.method_options), "hyperparameters": hyper}


def finish(cfg, sections: dict, status: str, message: str | None, started: str) -> dict:
    """The record of this run as a dict, checked against the layout; if the sections do not fit it (a bug), an
    error record that says so, with the identity — a run that started always ends with a record."""
    from experiments.provenance import capture_environment
    from experiments.record import SCHEMA_VERSION, Record, error_record, now

    try:
        device = resolve_device(cfg)
    except Exception:  # pragma: no cover - torch itself broken
        device = None
    try:
        env = dataclasses.asdict(capture_environment(device))
    except Exception as err:  # what the run measured matters more than the device's name
        env = {"device": f"unknown (the environment capture failed: {type(err).__name__}: {err})"}
    d = {**sections, "schema_version": SCHEMA_VERSION, "status": status, "message": message, "started_at": started,
         "finished_at": now(), "environment": env}
    try:
        return Record.from_dict(d).to_dict()
    except Exception as err:
        traceback.print_exc(file=sys.stderr)
        why = f"the job could not assemble its record ({type(err).__name__}: {err})"
        return error_record(sections.get("run") or identity(cfg), f"{why}; run status {status}: {message}",
                            started, environment=env)


def summary(rec: dict, out: str) -> str:
    run, dev = rec["run"], rec["peak"]["device"]
    opt = "" if run["optimizer"] == DEFAULT_OPTIMIZER else f" optimizer={run['optimizer']}"
    extra = (f" capture={run['capture']}" if run.get("capture") else "") + \
        (" synthetic-data" if run.get("synthetic_data") else "")
    parts = [f"[{rec['status']}] {run['model']}/{run['task']}/{run['method']}{opt}{extra} bs={run['batch_size']} "
             f"seed={run['seed']} dtype={run['dtype']} steps={run['steps']}"]
    if rec["final_loss"] is not None:
        parts.append(f"loss={rec['final_loss']:.4f}")
    if rec["metric"]:
        parts.append(f"{rec['metric']['name']}={rec['metric']['value']:.4f}")
    if rec["step_time_s"]:
        st = rec["step_time_s"]
        ci = f" [{st['ci95_low'] * 1e3:.1f}, {st['ci95_high'] * 1e3:.1f}]" if st.get("ci95_low") is not None else ""
        parts.append(f"step p50={st['p50'] * 1e3:.1f}ms{ci}")
    if rec["throughput"]:
        parts.append(f"{rec['throughput']['samples_per_s']:.1f} samples/s")
    if dev:
        parts.append(f"peak={dev['bytes'] / 2**20:.1f}MiB")
    if rec["saved_bytes"]:
        parts.append(f"saved={rec['saved_bytes']['total'] / 2**20:.2f}MiB")
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
    from experiments.record import now, write

    from experiments.distributed import start, stop

    started = now()
    sections = new_sections(cfg)
    status, message = "ok", None
    ctx = start(cfg.distributed, resolve_device(cfg).type)  # torchrun: join the group; else one process
    try:
        train(cfg, task, sections, *([ctx] if ctx.active else []))
    except KeyboardInterrupt:
        raise
    except Exception as err:  # every training failure becomes a record
        status = "oom" if is_oom(err) else "error"
        message = f"{type(err).__name__}: {err}"
        if status == "error":
            traceback.print_exc(file=sys.stderr)
        with contextlib.suppress(Exception):
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if ctx.active and status != "ok" and not ctx.writes:
        print(f"error: rank {ctx.rank} of {ctx.world}: {message}", file=sys.stderr)
        return 1  # torchrun stops the group; rank 0 cannot report a failure it does not know
    stop(ctx)
    if not ctx.writes:
        return 0
    rec = finish(cfg, sections, status, message, started)
    write(rec, cfg.out)
    print(summary(rec, cfg.out))
    if rec["status"] != "ok":
        why = str(rec.get("message") or "").strip().splitlines()[:1]
        print(f"error: the run ended with status {rec['status']!r}{': ' + why[0] if why else ''}; "
              f"its record: {cfg.out}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

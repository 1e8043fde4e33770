"""Command line and config file of the training job; every bad argument is caught here, before any work.

Method options are not fixed flags: whatever the chosen methods declare in the registry
(``lowmembp.methods.registry.method_options``) is accepted as ``--name value`` (``--k 16``, ``--rank 4``), read as the
method declares (``registry.read_option``: its ``kinds``, e.g. tokentune's ``k`` a count ``16`` or a fraction ``0.3``,
else the type of its default) and checked by the method's own ``check`` before any work; any other option is an
error that lists what the methods take. Options may also be written into the method spec (``--method
tokentune@k=4``, see ``lowmembp.methods.registry``): they are part of the cell's name, so ``--k`` beside them is an
error and a config file's value gives way to them.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from lowmembp.measurement.capture import CAPTURE_MODES
from lowmembp.methods.optim_levers import LEVERS, missing_package
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER, steps_in_backward
from lowmembp.methods.optimizers import check_optimizer as check_optimizer_spec
from lowmembp.methods.registry import (check_options, method_options, list_methods, option_kinds, parse, plain_spec,
                                       read_option, spec_options)

DTYPES = ("fp32", "bf16", "fp16")


class ArgError(ValueError):
    """A bad argument: the job exits at once with status 2 and this message."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.train", allow_abbrev=False,
        description="Train one cell (model × task × method × batch size × seed) and write one JSON record.",
        epilog="Method options (e.g. --k 16, --rank 4, --every 2) follow the method's registry entry; "
               "`--list` prints models, tasks, methods and their options.")
    a = p.add_argument
    a("--config", help="YAML or JSON file of the same settings (keys as the long flags, '-' or '_'; method options "
                       "under 'options:' or at top level); the command line overrides it")
    a("--model", help="model name (default: the task's first model)")
    a("--task", help="task name")
    a("--method", help="method spec, names joined with '+', e.g. lora+lowmembp")
    a("--batch-size", type=int)
    a("--seed", type=int)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="optimizer steps (default: the task's)")
    g.add_argument("--epochs", type=float, help="epochs over the training pool (instead of --steps)")
    a("--lr", type=float, help="peak learning rate (default: the task's)")
    a("--lr-base", type=float, help="instead of --lr: lr = lr_base × batch_size / 512 (the paper's ViT rule)")
    a("--weight-decay", type=float)
    a("--warmup-steps", type=int, help="linear warm-up steps, then cosine decay to 0")
    a("--warmup-epochs", type=float, help="instead of --warmup-steps")
    a("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    a("--optimizer",
      help="adamw (default: fp32 states), adamw8bit (bitsandbytes' 8-bit states) or adamw-fused-backward (each "
           "parameter stepped inside the backward, its gradient freed at once; not with --grad-accum > 1, fp16 "
           "or --distributed); or a full-fine-tuning lever of another package: galore-adamw[-layerwise], "
           "apollo-adamw (options in the name: galore-adamw@rank=64,update_proj_gap=200), adafactor, "
           "adamw-cpu-offload, adamw8bit-torchao, adamw4bit-torchao, adamw-fp8-torchao, paged-adamw, paged-adamw8bit "
           "(lowmembp.methods.optimizers, lowmembp.methods.optim_levers)")
    a("--dtype", choices=DTYPES, help="fp32, or bf16/fp16 autocast (fp16 with a GradScaler)")
    a("--max-len", type=int, help="maximum tokens per text sample")
    a("--limit", type=int, help="cap the training pool at N examples (for fast tests)")
    a("--train-split", help="the task's training partition: 'train' (default) or, where the task has one, "
                            "'pretrain' (tweets-lm: the negative and neutral tweets, to pre-train a base)")
    a("--init", help="start from these weights (a safetensors file written by --save-model), loaded into the "
                     "task's model before the method is applied; the record keeps its path, sha256 and metrics")
    a("--save-model", help="after training, write the model's weights here (safetensors, atomically)")
    a("--eval-limit", type=int, help="score at most N test examples (default: the task's)")
    a("--eval-batch-size", type=int, help="default: 2 × batch size")
    a("--eval-every", type=int, help="also score the test split every N optimizer steps: the record's `curve` (the "
                                     "learning curve; off by default)")
    a("--data-dir", help="root of downloaded data and weights for the paper tasks (default $LOWMEMBP_DATA_DIR "
                         "or ./data)")
    a("--download", action="store_true", default=None,
      help="paper tasks: allow fetching missing data/weights from the hub (off by default: no run-time downloads)")
    a("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    a("--capture", choices=CAPTURE_MODES,
      help="none (default: eager steps); cuda-graphs: the training step (forward, backward, optimizer step) captured "
           "once in a CUDA graph and replayed (static shapes; AdamW fused with a tensor learning rate); "
           "reduce-overhead: the step compiled with torch.compile(mode='reduce-overhead'). CUDA only; the way to take "
           "the host out of small, fast steps (lowmembp.measurement.capture)")
    a("--synthetic-data", action="store_true", default=None,
      help="paper tasks: random weights and one generated batch of the paper's shapes instead of the downloads, for "
           "memory and speed (no metric: the job does not evaluate; experiments.tasks.synthetic)")
    a("--layers", type=int, help="with --synthetic-data: keep the model's first N blocks (the paper's width)")
    a("--synthetic-overrides",
      help="with --synthetic-data: JSON object of model config changes (e.g. '{\"embed_dim\": 48}' for a tiny test)")
    a("--threads", type=int, help="CPU threads of torch (torch.set_num_threads; default $OMP_NUM_THREADS, else 1): "
                                  "part of the cell, since results on the CPU differ in the last digits between "
                                  "thread counts")
    a("--timing-warmup", type=int, help="steps left out of the step-time statistics (default 2)")
    a("--max-memory-mb", type=float,
      help="memory budget: on CUDA the allocator is capped (torch.cuda.set_per_process_memory_fraction), so a "
           "bigger need raises a real OOM; on CPU a run whose measured peak exceeds it is recorded as 'oom'")
    a("--distributed", choices=("ddp", "fsdp"),
      help="under torchrun (`torchrun --nproc-per-node N -m experiments.train ...`): DistributedDataParallel or "
           "FSDP2 (fully_shard per block, then the root), the methods applied before wrapping; --batch-size is the "
           "global batch, split evenly over the N processes; rank 0 writes the record (experiments.distributed)")
    a("--no-progress", action="store_true", default=None, help="no progress bar")
    a("--out", help="where to write the JSON record")
    a("--list", action="store_true", help="print the models, tasks, methods and method options, then exit")
    return p


FIXED_DEFAULTS = dict(seed=0, grad_accum=1, dtype="fp32", timing_warmup=2, weight_decay=0.0, download=False,
                      no_progress=False, max_len=None, limit=None, eval_limit=None, warmup_steps=0,
                      train_split="train", init=None, save_model=None, distributed=None, optimizer=DEFAULT_OPTIMIZER,
                      capture="none", synthetic_data=False, layers=None, synthetic_overrides=None)
"""Settings no task overrides; a task's own (``DEFAULTS``, ``METHOD_DEFAULTS``: ``tasks.base.defaults_for``) go
over these, a config file over those, the command line over everything."""
MAX_SEED = 2**32 - 1  # numpy's generators take seeds in [0, 2**32)


def _load_config(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ArgError(f"--config {path}: cannot read it ({err})") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:  # yaml.YAMLError, json.JSONDecodeError
        raise ArgError(f"--config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'} "
                       f"({err})") from None
    if not isinstance(data, dict):
        raise ArgError(f"config {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _convert(name: str, raw: Any, default: Any, kinds: tuple[type, ...] | None = None) -> Any:
    """A method option given as text (command line) or a YAML value, read as its method declares
    (``registry.read_option``: ``kinds``, else the type of ``default``); ArgError naming the flag."""
    try:
        return read_option(name, raw, default, kinds)
    except ValueError as err:
        raise ArgError(f"method option --{name.replace('_', '-')}: {err}") from None


def method_values(spec: str, given: dict[str, Any], *, cli: set[str] = frozenset()) -> dict[str, Any]:
    """The options of ``spec`` as the method gets them: ``given`` (text or YAML values, all taken by ``spec``) read
    by :func:`_convert`, the options written into the spec over them, then the methods' own checks. ArgError for an
    option in ``cli`` that the spec also fixes, a value that does not read, or one the method refuses."""
    takes, kinds = method_options(spec), option_kinds(spec)
    try:
        fixed = spec_options(spec)
    except ValueError as err:
        raise ArgError(str(err)) from None
    both = sorted(set(fixed) & set(cli))
    if both:
        raise ArgError(f"option --{both[0].replace('_', '-')} is fixed by the method spec {spec!r} "
                       f"({both[0]}={fixed[both[0]]!r}); give it once (drop --{both[0].replace('_', '-')} or the "
                       f"'@{both[0]}=...' part)")
    for key in sorted(set(fixed) & set(given)):
        print(f"note: config option {key}={given[key]!r} gives way to the method spec {spec!r}", file=sys.stderr)
    values = {k: _convert(k, v, takes[k], kinds.get(k)) for k, v in given.items() if k not in fixed}
    values.update(fixed)
    try:
        check_options(spec, values)
    except ValueError as err:
        raise ArgError(f"bad method option: {err}") from None
    return values


def _split_extra(extra: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or len(tok) < 3:
            raise ArgError(f"unexpected argument {tok!r}")
        if "=" in tok:
            key, value = tok[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise ArgError(f"method option {tok} needs a value")
            key, value = tok[2:], extra[i + 1]
            i += 2
        out[key.replace("-", "_")] = value
    return out


def listing() -> str:
    from experiments import tasks

    lines = ["tasks (models; default settings, then per method):"]
    for name in tasks.names():
        task = tasks.get(name)
        shown = ", ".join(f"{k} {v}" for k, v in task.DEFAULTS.items() if v is not None)
        per = "; ".join(f"{m}: " + ", ".join(f"{k} {v}" for k, v in d.items())
                        for m, d in getattr(task, "METHOD_DEFAULTS", {}).items())
        lines.append(f"  {name}: {', '.join(task.MODELS)} [{shown}{'; ' + per if per else ''}]")
    lines.append("methods (options with defaults; also written into the name: --method tokentune@k=4):")
    for name, desc in list_methods().items():
        opts, kinds = method_options(name), option_kinds(name)
        shown = ", ".join(f"--{k.replace('_', '-')} {v}"
                          + (f" ({' or '.join(t.__name__ for t in kinds[k])})" if k in kinds else "")
                          for k, v in opts.items()) or "no options"
        lines.append(f"  {name}: {desc} [{shown}]")
    return "\n".join(lines)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _number(key: str, value, kind=float) -> float:
    if isinstance(value, str):  # a config file's "1e-2" (YAML reads it as text)
        try:
            value = kind(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not isinstance(value, int)):
        raise ArgError(f"{_flag(key)} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ArgError(f"{_flag(key)} must be finite, got {value!r}")
    return value


POSITIVE_INTS = ("batch_size", "steps", "grad_accum", "max_len", "limit", "eval_limit", "eval_batch_size", "threads",
                 "eval_every", "layers")
NON_NEGATIVE_INTS = ("warmup_steps", "timing_warmup")
POSITIVE_NUMBERS = ("lr", "lr_base", "epochs", "max_memory_mb")
NON_NEGATIVE_NUMBERS = ("weight_decay", "warmup_epochs")


def check_values(values: dict) -> None:
    """Ranges and types of the numeric settings (given ones; None means unset); ArgError naming the flag."""
    for key in POSITIVE_INTS + NON_NEGATIVE_INTS:
        if values.get(key) is not None:
            v = values[key] = _number(key, values[key], int)
            if v < (1 if key in POSITIVE_INTS else 0):
                raise ArgError(f"{_flag(key)} must be a {'positive' if key in POSITIVE_INTS else 'non-negative'} "
                               f"integer, got {v!r}")
    for key in POSITIVE_NUMBERS + NON_NEGATIVE_NUMBERS:
        if values.get(key) is not None:
            v = values[key] = _number(key, values[key])
            if v < 0 or (v == 0 and key in POSITIVE_NUMBERS):
                raise ArgError(f"{_flag(key)} must be {'positive' if key in POSITIVE_NUMBERS else '>= 0'}, "
                               f"got {v!r}")
    if values.get("seed") is not None:
        seed = values["seed"] = _number("seed", values["seed"], int)
        if not 0 <= seed <= MAX_SEED:
            raise ArgError(f"--seed must be an integer in [0, {MAX_SEED}], got {seed}")
    if values.get("dtype") is not None and values["dtype"] not in DTYPES:
        raise ArgError(f"--dtype must be one of {', '.join(DTYPES)}, got {values['dtype']!r}")


def default_threads() -> int:
    """$OMP_NUM_THREADS when it is a positive integer (the pipeline sets it per job), else 1."""
    import os

    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return 1
    return n if n >= 1 else 1


def check_device(device) -> None:
    """``cpu``, ``cuda`` or ``cuda:N`` that this machine has; None means cuda when present."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ArgError(f"--device {device!r}: not a device name ({err}); use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ArgError(f"--device {device!r}: this job trains on cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgError(f"--device {device}: CUDA is not available on this machine (torch "
                           f"{torch.__version__}, "
                           f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}); "
                           "use --device cpu or leave --device out")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArgError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_destination(key: str, path) -> None:
    """A file the job will write must be writable now, not after the training (lowmembp.atomic.check_writable)."""
    if path is None and key != "out":
        return
    from lowmembp.atomic import DestinationError, check_writable

    try:
        check_writable(path)
    except DestinationError as err:
        raise ArgError(f"{_flag(key)}: {err}") from None


def check_optimizer(values: dict) -> None:
    """The optimizer must be one of :data:`OPTIMIZERS` and fit the run: the step inside the backward cannot
    accumulate micro-batches, unscale fp16's scaled gradients first or wait for data-parallel reductions; 8-bit
    states need bitsandbytes (and are not sharded by FSDP2 here)."""
    name, flag = values.get("optimizer"), "--optimizer"
    try:
        base = check_optimizer_spec(name)
    except ValueError as err:
        raise ArgError(f"{flag} {str(err).removeprefix('optimizer ')}") from None
    if base in LEVERS:
        _check_lever(values, name, base, flag)
        return
    if name == "adamw-fused-backward":
        why = [f"--grad-accum {values['grad_accum']} (each backward steps at once: no micro-batches to accumulate)"
               if (values.get("grad_accum") or 1) > 1 else "",
               "--dtype fp16 (the GradScaler cannot unscale gradients the backward has already used; use bf16)"
               if values.get("dtype") == "fp16" else "",
               f"--distributed {values['distributed']} (each parameter would step before the gradients are "
               "reduced over ranks)" if values.get("distributed") else ""]
        why = [w for w in why if w]
        if why:
            raise ArgError(f"{flag} adamw-fused-backward does not work with " + "; ".join(why))
    if name == "adamw8bit":
        if values.get("distributed") == "fsdp":
            raise ArgError(f"{flag} adamw8bit with --distributed fsdp is not supported (bitsandbytes' 8-bit states "
                           "of FSDP2's sharded parameters are untested here); use --distributed ddp or adamw")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ArgError(f"{flag} adamw8bit needs bitsandbytes: pip install 'bitsandbytes>=0.45,<0.51'") from None


def _check_lever(values: dict, spec: str, name: str, flag: str) -> None:
    """A full-fine-tuning lever of another package (lowmembp.methods.optim_levers): its package installed, a device it
    runs on, and (stepping inside the backward) adamw-fused-backward's limits."""
    why = missing_package(name)
    if why:
        raise ArgError(f"{flag} {name} needs {LEVERS[name].package}: {why}")
    import torch

    device = values.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if LEVERS[name].needs_accelerator and str(device).startswith("cpu"):
        raise ArgError(f"{flag} {name} needs a CUDA device (torchao's CPUOffloadOptimizer moves the states of "
                       "GPU parameters to the host); on the CPU use adamw")
    if steps_in_backward(spec):
        bad = [f"--grad-accum {values['grad_accum']}" if (values.get("grad_accum") or 1) > 1 else "",
               "--dtype fp16" if values.get("dtype") == "fp16" else "",
               f"--distributed {values['distributed']}" if values.get("distributed") else ""]
        bad = [b for b in bad if b]
        if bad:
            raise ArgError(f"{flag} {name} steps each parameter inside the backward and does not work with "
                           + "; ".join(bad))
    elif values.get("distributed") == "fsdp" and name != "adafactor":
        raise ArgError(f"{flag} {name} with --distributed fsdp is not supported here; use --distributed ddp")
def check_synthetic(values: dict, task) -> None:
    """``--synthetic-data`` only for a paper task (the offline tasks ship their data), never with an evaluation;
    ``--layers`` / ``--synthetic-overrides`` only with it (read into ``values``)."""
    from experiments.tasks import synthetic

    raw = values.get("synthetic_overrides")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as err:
            raise ArgError(f"--synthetic-overrides must be a JSON object, got {raw!r} ({err})") from None
    if raw is not None and not isinstance(raw, dict):
        raise ArgError(f"--synthetic-overrides must be a JSON object (a mapping), got {raw!r}")
    values["synthetic_overrides"] = raw
    if not values.get("synthetic_data"):
        given = [f for f, k in (("--layers", "layers"), ("--synthetic-overrides", "synthetic_overrides"))
                 if values.get(k) is not None]
        if given:
            raise ArgError(f"{', '.join(given)} only with --synthetic-data (a real task's model is the downloaded one)")
        return
    values["synthetic_data"] = True
    if synthetic.kind(task.NAME) is None:
        raise ArgError(f"--synthetic-data is for the paper tasks (cifar10/100, glue-*, alpaca); task {task.NAME} "
                       "ships its own data: leave the flag out")
    if values.get("eval_every"):
        raise ArgError("--eval-every with --synthetic-data: generated inputs have no metric; leave one out")
    from lowmembp.estimator.step import MODELS

    if values["model"] not in MODELS:
        raise ArgError(f"--synthetic-data: no random-weight build of model {values['model']!r}; models: "
                       f"{', '.join(MODELS)}")


def check_capture_args(values: dict) -> None:
    """``--capture`` other than none: a CUDA device (exit 2 on a CPU), one micro-batch per step, one process, AdamW."""
    mode = values.get("capture") or "none"
    if mode not in CAPTURE_MODES:
        raise ArgError(f"--capture must be one of {', '.join(CAPTURE_MODES)}, got {mode!r}")
    if mode == "none":
        return
    import torch

    device = values.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != "cuda":
        raise ArgError(f"--capture {mode} needs a CUDA device (CUDA graphs replay on a GPU); this run trains on "
                       f"{device}: leave --capture out (or --capture none) on a CPU")
    why = [f"--grad-accum {values['grad_accum']} (a captured step is one micro-batch)"
           if (values.get("grad_accum") or 1) > 1 else "",
           f"--distributed {values['distributed']}" if values.get("distributed") else "",
           f"--optimizer {values['optimizer']} (a captured step uses torch's fused AdamW: --optimizer adamw)"
           if values.get("optimizer") != DEFAULT_OPTIMIZER else ""]
    why = [w for w in why if w]
    if why:
        raise ArgError(f"--capture {mode} does not work with " + "; ".join(why))


def parse_args(argv: list[str] | None = None):
    """Parse and validate; returns (cfg Namespace, task module). Raises ArgError on any bad argument."""
    from experiments import tasks

    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if ns.list:
        return ns, None
    config = _load_config(ns.config) if ns.config else {}
    config = {k.replace("-", "_"): v for k, v in config.items()}
    options_cfg = config.pop("options", None) or {}
    known = {a.dest for a in parser._actions} - {"help", "config", "list"}

    values: dict[str, Any] = {}
    for key, value in config.items():
        if key in known:
            values[key] = value
        else:
            options_cfg[key] = value  # a method option at top level (checked below)
    for key in known:
        cli = getattr(ns, key)
        if cli is not None:
            values[key] = cli
    # the command line wins over the config also across alternatives (steps/epochs, lr/lr_base, warm-up)
    for a, b in (("steps", "epochs"), ("lr", "lr_base"), ("warmup_steps", "warmup_epochs")):
        if getattr(ns, a) is not None:
            values.pop(b, None)
        elif getattr(ns, b) is not None:
            values.pop(a, None)
        elif values.get(a) is not None and values.get(b) is not None:
            raise ArgError(f"config gives both {a} and {b}; give one")

    for need in ("task", "method", "batch_size", "out"):
        if values.get(need) is None:
            raise ArgError(f"--{need.replace('_', '-')} is required")
    try:
        task = tasks.get(values["task"])
    except ValueError as err:
        raise ArgError(str(err)) from None
    model = values.get("model") or task.MODELS[0]
    if model not in task.MODELS:
        valid = tasks.all_models()
        if model in valid:
            raise ArgError(f"model {model!r} does not train on task {task.NAME!r}; it trains on "
                           f"{', '.join(valid[model])}; {task.NAME} takes {', '.join(task.MODELS)}")
        raise ArgError(f"unknown model {model!r}; valid models: {', '.join(sorted(valid))}")
    values["model"] = model
    try:
        parse(values["method"])
    except ValueError as err:
        raise ArgError(str(err)) from None
    check_values(values)  # before the data check: a bad number fails at once

    splits = getattr(task, "TRAIN_SPLITS", ("train",))
    if values.get("train_split") is not None and values["train_split"] not in splits:
        raise ArgError(f"--train-split {values['train_split']!r}: task {task.NAME} has {', '.join(splits)}")
    if values.get("init") is not None and not Path(values["init"]).is_file():
        raise ArgError(f"--init {values['init']}: no such file; make the base first (the pipeline's `bases:` "
                       "entries, or a run with --save-model PATH)")

    # method options: config first, command line over it; all must be taken by the chosen methods
    takes = method_options(values["method"])
    given = {}
    for key, value in options_cfg.items():  # a config serves several methods: options the chosen ones skip are unused
        key = key.replace("-", "_")
        if key in takes:
            given[key] = value
        else:
            print(f"note: config option {key!r} is not used by method {values['method']!r}", file=sys.stderr)
    cli = _split_extra(extra)
    bad = sorted(set(cli) - set(takes))
    if bad:
        shown = ", ".join(f"--{k.replace('_', '-')}" for k in takes) or "no options"
        raise ArgError(f"option(s) {', '.join('--' + b.replace('_', '-') for b in bad)} not taken by method "
                       f"{values['method']!r}; it takes: {shown}. (Training flags: see --help.)")
    given.update(cli)
    method_opts = method_values(values["method"], given, cli=set(cli))

    from experiments.tasks.base import defaults_for

    merged = dict(FIXED_DEFAULTS)
    merged.update({k: v for k, v in defaults_for(task, plain_spec(values["method"])).items() if k in known})
    if values.get("epochs") is not None:
        merged.pop("steps", None)
    if values.get("lr_base") is not None:
        merged.pop("lr", None)
    if values.get("warmup_epochs") is not None:
        merged.pop("warmup_steps", None)
    merged.update(values)
    for key in known:
        merged.setdefault(key, None)
    if merged["lr_base"] is not None:
        merged["lr"] = float(merged["lr_base"]) * merged["batch_size"] / 512
    if merged["lr"] is None:
        raise ArgError(f"task {task.NAME} declares no default learning rate: give --lr or --lr-base")
    if merged["threads"] is None:
        merged["threads"] = default_threads()
    check_values(merged)
    if merged["limit"] is not None and merged["limit"] < merged["batch_size"]:
        raise ArgError(f"--limit {merged['limit']} is smaller than one batch ({merged['batch_size']}): give a "
                       "larger --limit or a smaller --batch-size")
    check_device(merged["device"])
    from experiments.distributed import check as check_distributed

    why = check_distributed(merged["distributed"], merged["batch_size"])
    if why:
        raise ArgError(why)
    check_optimizer(merged)
    check_synthetic(merged, task)
    check_capture_args(merged)
    for key in ("out", "save_model"):
        check_destination(key, merged[key])
    if merged["save_model"] is not None and Path(merged["save_model"]).resolve() == Path(merged["out"]).resolve():
        raise ArgError("--save-model and --out name the same file; give the weights their own file")
    cfg = argparse.Namespace(**merged)
    cfg.method_options = method_opts
    cfg.config = ns.config
    try:
        if not cfg.synthetic_data:
            task.check(cfg)  # data / weights present? (paper tasks stop here when they are not)
    except Exception as err:
        from experiments.tasks.base import MissingData

        if isinstance(err, MissingData):
            raise ArgError(f"task {task.NAME} with model {model}: {err}. For memory and speed only, --synthetic-data "
                           "runs it on random weights and generated inputs of the paper's shapes (no metric)") from None
        raise
    return cfg, task

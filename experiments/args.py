"""Command line and config file of the training job; every bad argument is caught here, before any work.

Method options are not fixed flags: whatever the chosen methods declare in the registry
(``lowmembp.methods.registry.method_options``) is accepted as ``--name value`` (``--k 16``, ``--rank 4``), converted
to the type of its default; any other option is an error that lists what the methods take.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from lowmembp.methods.registry import method_options, methods, parse

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
    a("--data-dir", help="root of downloaded data and weights for the paper tasks (default $LOWMEMBP_DATA_DIR "
                         "or ./data)")
    a("--download", action="store_true", default=None,
      help="paper tasks: allow fetching missing data/weights from the hub (off by default: no run-time downloads)")
    a("--device", help="cuda or cpu (default: cuda when present)")
    a("--timing-warmup", type=int, help="steps left out of the step-time statistics (default 2)")
    a("--max-memory-mb", type=float,
      help="memory budget: on CUDA the allocator is capped (torch.cuda.set_per_process_memory_fraction), so a "
           "bigger need raises a real OOM; on CPU a run whose measured peak exceeds it is recorded as 'oom'")
    a("--no-progress", action="store_true", default=None, help="no progress bar")
    a("--out", help="where to write the JSON record")
    a("--list", action="store_true", help="print the models, tasks, methods and method options, then exit")
    return p


FIXED_DEFAULTS = dict(seed=0, grad_accum=1, dtype="fp32", timing_warmup=2, weight_decay=0.0, download=False,
                      no_progress=False, max_len=None, limit=None, eval_limit=None, warmup_steps=0,
                      train_split="train", init=None, save_model=None)


def _load_config(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ArgError(f"config {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _convert(name: str, raw: Any, default: Any) -> Any:
    """Convert a method option given as text (command line) or a YAML value to the type of its default."""
    if not isinstance(raw, str):
        return list(raw) if isinstance(default, (list, tuple)) and isinstance(raw, (list, tuple)) else raw
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, (list, tuple)):
            items = [s.strip() for s in raw.split(",") if s.strip()]
            kind = type(default[0]) if default else str
            return [kind(s) for s in items]
        if default is None:
            for kind in (int, float):
                try:
                    return kind(raw)
                except ValueError:
                    pass
            if raw.lower() in ("none", "null"):
                return None
            if "," in raw:
                return [s.strip() for s in raw.split(",") if s.strip()]
        return raw
    except ValueError as err:
        raise ArgError(f"method option --{name.replace('_', '-')}: cannot read {raw!r} "
                       f"as {type(default).__name__} ({err})") from err


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

    lines = ["tasks (models):"]
    for name in tasks.names():
        lines.append(f"  {name}: {', '.join(tasks.get(name).MODELS)}")
    lines.append("methods (options with defaults):")
    for name, desc in methods().items():
        opts = method_options(name)
        shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in opts.items()) or "no options"
        lines.append(f"  {name}: {desc} [{shown}]")
    return "\n".join(lines)


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
    if not isinstance(values["batch_size"], int) or values["batch_size"] < 1:
        raise ArgError(f"--batch-size must be a positive integer, got {values['batch_size']!r}")
    for key in ("steps", "grad_accum", "max_len", "limit", "eval_limit", "eval_batch_size"):
        if values.get(key) is not None and (not isinstance(values[key], int) or values[key] < 1):
            raise ArgError(f"--{key.replace('_', '-')} must be a positive integer, got {values[key]!r}")
    if values.get("epochs") is not None and not values["epochs"] > 0:
        raise ArgError(f"--epochs must be positive, got {values['epochs']!r}")
    if values.get("dtype") is not None and values["dtype"] not in DTYPES:
        raise ArgError(f"--dtype must be one of {', '.join(DTYPES)}, got {values['dtype']!r}")
    for key in ("lr", "lr_base"):
        if values.get(key) is not None:
            try:
                ok = math.isfinite(float(values[key])) and float(values[key]) > 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ArgError(f"--{key.replace('_', '-')} must be a positive number, got {values[key]!r}")

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
    method_opts = {k: _convert(k, v, takes[k]) for k, v in given.items()}

    merged = dict(FIXED_DEFAULTS)
    merged.update({k: v for k, v in task.DEFAULTS.items() if k in known})
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
    if values.get("lr") is None and values.get("lr_base") is None and "lora_lr" in task.DEFAULTS and \
            "lora" in [m.strip() for m in values["method"].split("+")]:
        merged["lr"] = task.DEFAULTS["lora_lr"]  # adapters need a larger step than full fine-tuning
    if merged["lr"] is None:
        merged["lr"] = 1e-4
    cfg = argparse.Namespace(**merged)
    cfg.method_options = method_opts
    cfg.config = ns.config
    try:
        task.check(cfg)  # data / weights present? (paper tasks stop here when they are not)
    except Exception as err:
        from experiments.tasks.base import MissingData

        if isinstance(err, MissingData):
            raise ArgError(f"task {task.NAME} with model {model}: {err}") from None
        raise
    return cfg, task

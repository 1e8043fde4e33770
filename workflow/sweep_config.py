"""The sweep config (config/config.yaml, config/paper/*.yaml): defaults, cells, each cell's command line, and the check
of every entry against the training job's own registries, run when the Snakefile is parsed.

    fill_defaults(config); check(config)       # ConfigError naming every bad entry and what is valid
    cells(config)                              # (task, model, method, bs, seed, optimizer) -> (sweep name, sweep)
    cell_argv(sw, task, model, method, bs, seed, base=None, optimizer="adamw"), base_argv(config["bases"][name])
    record_path(results, task, model, method, bs, seed, optimizer)     # where a cell's record goes (CELL)

A cell is one training run: task, model, method spec, batch size, seed and optimizer (a sweep's ``optimizers:``, a
list of :data:`lowmembp.methods.optimizers.OPTIMIZERS`, default ``[adamw]``). Its files are named by :data:`CELL`,
``<task>/<model>/<method>[/<optimizer>]/bs<B>/seed<S>``: the optimizer's segment only when it is not the default
(AdamW), so a sweep that does not list ``optimizers`` writes the paths it always did, and
``runs/t/m/lora/adamw8bit/bs8/seed0.json`` sits beside ``runs/t/m/lora/bs8/seed0.json``.

What :func:`check` asks the job (``experiments``, ``lowmembp``), so that ``snakemake -n`` fails at once instead of a
job failing hours later: tasks (``experiments.tasks``) and the task's models; method specs
(``lowmembp.methods.registry.parse``, exclusions included; one method written two ways, e.g. ``tokentune@k=4`` and
``tokentune@k=4.0``, is refused: it would run as two cells); ``method_options`` keys (``registry.method_options``) and
values (converted as the job converts them); ``train_args`` (the job's own argparse parser, without running; flags
the pipeline sets from the sweep's keys are refused there); ``train_config`` files; bases (task, model, method; a base
must be trained by a method that leaves the model's weights as they are: the registry's ``changes_weights``);
``init``; the reproductions and notebooks (workflow/catalogue.py). Data and weights of the paper tasks are not
checked here (the job checks them when it starts and says what to fetch).
"""
from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, check_optimizer

ROOT = Path(__file__).resolve().parents[1]
# A cell's files, under results/runs/ (records), logs/train/, benchmarks/train/: {opt} is "" for the default
# optimizer, "/<optimizer>" for another (OPT_SEGMENT, the Snakefiles' wildcard constraint; opt_segment, optimizer_of).
CELL = "{task}/{model}/{method}{opt}/bs{bs}/seed{seed}"
OPT_SEGMENT = "(/[a-z0-9][a-z0-9-]*(@[a-z_]+=[A-Za-z0-9._-]+(,[a-z_]+=[A-Za-z0-9._-]+)*)?)?"  # galore-adamw@rank=16
# a record's path back to its cell (aggregate.py reads a damaged record's cell from it)
CELL_PATH = re.compile(r"(?:^|/)runs/(?P<task>[^/]+)/(?P<model>[^/]+)/(?P<method>[^/]+)"
                       r"(?:/(?P<optimizer>[a-z0-9][a-z0-9-]*(?:@[a-z_]+=[A-Za-z0-9._-]+(?:,[a-z_]+=[A-Za-z0-9._-]+)*)?))?"
                       r"/bs(?P<batch_size>\d+)/seed(?P<seed>\d+)\.json$")
SWEEP_DEFAULTS = {"seeds": [0], "optimizers": [DEFAULT_OPTIMIZER], "steps": None, "dtype": "fp32",
                  "train_config": None, "train_args": [], "method_options": {}, "resources": {}, "init": None,
                  "synthetic_data": False}
BASE_DEFAULTS = {"method": "baseline", "seed": 0, "train_args": []}
# Methods whose trained model does not have the plain model's weights, so what --save-model writes (the state dict)
# would not load (--init, strictly) into a fresh model: lora / lora-fa / velora add adapters, lowmembp /
# lowmembp-norm fold the norms' γ/β into the next linears. Every other method leaves names and values as they are.
# tests/workflow/test_config_check.py checks this list against every registered method on a tiny ViT and LLaMA.
# Set by the pipeline from the sweep's own keys; in train_args they would contradict them.
PIPELINE_FLAGS = {"--model": "tasks", "--task": "tasks", "--method": "methods", "--batch-size": "batch_sizes",
                  "--seed": "seeds", "--dtype": "dtype", "--config": "train_config", "--init": "init / bases",
                  "--out": "(the record's path)", "--save-model": "bases", "--optimizer": "optimizers",
                  "--synthetic-data": "synthetic_data"}


class ConfigError(ValueError):
    """A sweep config the training job would refuse; the message lists every bad entry and what is valid."""


def fill_defaults(config: dict) -> dict:
    config.setdefault("bases", {})
    for sw in config["sweeps"].values():
        for k, v in SWEEP_DEFAULTS.items():
            sw.setdefault(k, v)
    for b in config["bases"].values():
        for k, v in BASE_DEFAULTS.items():
            b.setdefault(k, v)
    return config


def options_for(sw: dict, method: str) -> dict:
    """Options of every component of a composed method name (and of the full name), later ones win; a spec with
    options in it (``tokentune@k=4``) takes its components' options except those it fixes itself."""
    from lowmembp.methods.registry import plain_spec, spec_parts

    parts = spec_parts(method)
    fixed = {k for _, o in parts for k in o}
    opts = {}
    mo = sw.get("method_options") or {}
    for part in dict.fromkeys([n for n, _ in parts] + [plain_spec(method), method]):
        opts.update(mo.get(part) or {})
    return {k: v for k, v in opts.items() if k not in fixed}


def spec_has_options(method: str) -> bool:
    """Does the method spec carry options in its names (``tokentune@k=4``)?"""
    from lowmembp.methods.registry import spec_parts

    return any(opts for _, opts in spec_parts(method))


def _run_settings(sw: dict, method: str) -> tuple:
    keys = ("steps", "dtype", "train_config", "train_args", "resources", "init", "synthetic_data")
    return tuple(repr(sw.get(k)) for k in keys) + (repr(sorted(options_for(sw, method).items())),)


def opt_segment(optimizer: str) -> str:
    """The ``{opt}`` part of :data:`CELL`: nothing for the default optimizer, ``/<optimizer>`` otherwise."""
    return "" if optimizer == DEFAULT_OPTIMIZER else f"/{optimizer}"


def optimizer_of(segment: str | None) -> str:
    """The optimizer an ``{opt}`` segment (or :data:`CELL_PATH`'s ``optimizer`` group) names."""
    return (segment or "").lstrip("/") or DEFAULT_OPTIMIZER


def record_path(results: str, task: str, model: str, method: str, bs, seed, optimizer: str = DEFAULT_OPTIMIZER) -> str:
    """``<results>/runs/<CELL>.json``: where the pipeline writes the record of a cell."""
    return f"{results}/runs/" + CELL.format(task=task, model=model, method=method, opt=opt_segment(optimizer),
                                            bs=int(bs), seed=int(seed)) + ".json"


def cells(config: dict) -> dict:
    """(task, model, method, bs, seed, optimizer) -> (sweep name, sweep spec); a cell listed by two sweeps must
    agree."""
    out = {}
    for name, sw in config["sweeps"].items():
        for tm, method, bs, seed, opt in itertools.product(sw["tasks"], sw["methods"], sw["batch_sizes"],
                                                           sw["seeds"], sw["optimizers"]):
            key = (tm["task"], tm["model"], method, int(bs), int(seed), opt)
            if key in out and _run_settings(out[key][1], method) != _run_settings(sw, method):
                raise ConfigError(
                    f"cell {key} is listed by sweeps {out[key][0]!r} and {name!r} with different settings "
                    "(steps, dtype, train_config, train_args, method options or resources); make them agree "
                    "or drop it from one sweep")
            out.setdefault(key, (name, sw))
    return out


def cell_argv(sw: dict, task: str, model: str, method: str, bs, seed, base: str | None = None,
              optimizer: str = DEFAULT_OPTIMIZER) -> list[str]:
    """The training job's arguments for one cell (experiments/train.py), without --out."""
    args = ["--model", model, "--task", task, "--method", method, "--batch-size", str(bs), "--seed", str(seed),
            "--dtype", sw["dtype"]]
    if optimizer != DEFAULT_OPTIMIZER:
        args += ["--optimizer", optimizer]
    if sw.get("synthetic_data"):
        args += ["--synthetic-data"]
    if sw.get("steps"):
        args += ["--steps", str(sw["steps"])]
    if sw.get("train_config"):
        args += ["--config", str(sw["train_config"])]
    for opt, val in options_for(sw, method).items():
        args += [f"--{opt.replace('_', '-')}", _text(val)]
    args += [str(a) for a in sw.get("train_args") or []]
    if base:
        args += ["--init", base]
    return args


def base_argv(b: dict) -> list[str]:
    """The training job's arguments for one base (its --save-model and --out are added by the rule)."""
    args = ["--model", b["model"], "--task", b["task"], "--method", b.get("method", "baseline"),
            "--batch-size", str(b["batch_size"]), "--seed", str(b.get("seed", 0)), "--steps", str(b["steps"])]
    return args + [str(a) for a in b.get("train_args") or []]


def _text(val) -> str:
    if isinstance(val, bool):
        return "true" if val else "false"
    if isinstance(val, (list, tuple)):
        return ",".join(map(str, val))
    return str(val)


def join(args: list[str]) -> str:
    return shlex.join(args)


# ----------------------------------------------------------------------------------------------------- the check
class _Job:
    """The training job's registries, imported once."""

    def __init__(self):
        from experiments import args as job_args
        from experiments import tasks
        from lowmembp.methods import registry

        self.args, self.tasks, self.registry = job_args, tasks, registry
        self.task_names = tasks.names()
        self._models = {}

    def models(self, task: str) -> tuple:
        if task not in self._models:
            self._models[task] = tuple(self.tasks.get(task).MODELS)
        return self._models[task]

    def method_error(self, spec: str) -> str | None:
        try:
            self.registry.parse(spec)
        except ValueError as err:
            return str(err)
        return None


def _check_task(job: _Job, where: str, task: str, model: str, problems: list[str]) -> None:
    if task not in job.task_names:
        problems.append(f"{where}: unknown task {task!r}; the training job knows {', '.join(job.task_names)}")
        return
    if model not in job.models(task):
        problems.append(f"{where}: model {model!r} does not train on task {task!r}; {task} takes "
                        f"{', '.join(job.models(task))}")


def _check_options(job: _Job, where: str, spec: str, opts: dict, problems: list[str]) -> None:
    """Every option is taken by ``spec`` and reads as the job reads it."""
    takes = job.registry.method_options(spec)
    for opt, val in (opts or {}).items():
        if opt not in takes:
            shown = ", ".join(takes) or "no options"
            problems.append(f"{where}: option {opt!r} is not taken by method {spec!r}; it takes: {shown}")
            continue
    try:  # read and checked as the job does (the method's declared kinds and its own check)
        job.args.method_values(spec, {k: _text(v) for k, v in (opts or {}).items() if k in takes})
    except ValueError as err:
        problems.append(f"{where}: {err}")


def _check_argv(job: _Job, where: str, argv: list[str], method: str, problems: list[str], checked=()) -> None:
    """Parse a cell's arguments with the job's parser (nothing runs); the rest must be options of the method
    (those in ``checked`` came from ``method_options`` and were checked there)."""
    parser = job.args.build_parser()
    errors = []

    def error(message):  # argparse would print the usage and exit
        errors.append(message)
        raise ValueError(message)

    parser.error = error
    try:
        ns, extra = parser.parse_known_args(argv)
    except (ValueError, SystemExit):
        problems.append(f"{where}: the training job refuses its arguments ({errors[0] if errors else 'see --help'}): "
                        f"{join(argv)}")
        return
    try:  # the optimizer against the run's other flags, as the job checks it (a --config file's values aside)
        job.args.check_optimizer({"optimizer": DEFAULT_OPTIMIZER, **{k: v for k, v in vars(ns).items()
                                                                      if v is not None}})
    except ValueError as err:
        problems.append(f"{where}: {err}")
    if job.method_error(method):
        return  # reported once, as a bad method
    try:
        given = job.args._split_extra(extra)
    except ValueError as err:
        problems.append(f"{where}: {err} in {join(extra)}")
        return
    takes = job.registry.method_options(method)
    for opt in [k for k in given if k not in checked and k not in takes]:
        problems.append(f"{where}: --{opt.replace('_', '-')} is neither a flag of the training job (see `python -m "
                        f"experiments.train --help`) nor an option taken by method {method!r} (it takes: "
                        f"{', '.join(takes) or 'no options'})")
    _check_options(job, where, method, {k: v for k, v in given.items() if k not in checked and k in takes},
                   problems)


def _trains(job: _Job, sw: dict, spec: str) -> tuple | None:
    """What ``spec`` trains in sweep ``sw``: its methods in the registry's order, each with its options (written in
    the spec, or the sweep's ``method_options``) read as the job reads them, so ``tokentune@k=4`` and
    ``tokentune@k=4.0``, or ``lora+tokentune`` and ``tokentune+lora``, are the same. None when an option does not
    read (reported by the option checks)."""
    parts = dict(job.registry.spec_parts(spec))
    extra = {k: _text(v) for k, v in options_for(sw, spec).items()}
    out = []
    for m in job.registry.parse(spec):
        opts = dict(parts.get(m.name, {}))
        opts.update({k: v for k, v in extra.items() if k in m.options and k not in opts})
        try:
            values = job.args.method_values(m.name, opts)
        except ValueError:
            return None
        out.append((m.name, tuple(sorted(values.items()))))
    return tuple(out)


def _check_train_args(where: str, train_args: list, problems: list[str]) -> None:
    for a in train_args or []:
        flag = str(a).split("=", 1)[0]
        if flag in PIPELINE_FLAGS:
            problems.append(f"{where}: train_args {flag} is set by the pipeline from {PIPELINE_FLAGS[flag]}; "
                            "use that key instead")


def check(config: dict, root: Path = ROOT) -> None:
    """Raise :class:`ConfigError` listing every entry of ``config`` (defaults filled) the job would refuse."""
    from catalogue import NOTEBOOKS, REPRO

    job = _Job()
    problems: list[str] = []
    bases = config.get("bases") or {}
    for name, b in bases.items():
        where = f"bases.{name}"
        _check_task(job, where, b["task"], b["model"], problems)
        _check_train_args(where, b.get("train_args"), problems)
        err = job.method_error(b["method"])
        if err:
            problems.append(f"{where}: {err}")
        elif any(m.changes_weights for m in job.registry.parse(b["method"])):
            changing = job.registry.list_methods_changing_weights()
            keep = [m for m in job.registry.list_methods() if m not in changing]
            problems.append(f"{where}: method {b['method']!r} "
                            f"changes the model's weights ({', '.join(changing)}: "
                            f"adapters, or norms folded into the next layers), so the saved base would not load into "
                            f"a fresh model; train a base with {', '.join(keep)} (e.g. baseline)")
        elif b["task"] in job.task_names and b["model"] in job.models(b["task"]):
            _check_argv(job, where, base_argv(b), b["method"], problems)
    written: dict[tuple, tuple[str, str]] = {}  # what a method trains -> (sweep, spec as first written)
    for name, sw in config["sweeps"].items():
        where = f"sweeps.{name}"
        for tm in sw["tasks"]:
            _check_task(job, f"{where}.tasks", tm["task"], tm["model"], problems)
            if sw.get("synthetic_data") and tm["task"] in job.task_names:
                from experiments.tasks import synthetic

                if synthetic.kind(tm["task"]) is None:
                    problems.append(f"{where}: synthetic_data is for the paper tasks (cifar10/100, glue-*, alpaca); "
                                    f"task {tm['task']!r} ships its own data: drop synthetic_data")
        optimizers = sw["optimizers"]
        listed = optimizers if isinstance(optimizers, list) else []
        if not listed or any(not _is_optimizer(o) for o in listed) or len(set(map(str, listed))) != len(listed):
            problems.append(f"{where}.optimizers: must be a list of distinct names of {', '.join(OPTIMIZERS)} "
                            f"(lowmembp.methods.optimizers), got {optimizers!r}")
        bad_methods = set()
        for m in sw["methods"]:
            err = job.method_error(m)
            if err:
                bad_methods.add(m)
                problems.append(f"{where}.methods: {err}")
                continue
            key = _trains(job, sw, m)
            first = written.setdefault(key, (name, m)) if key is not None else (name, m)
            if first[1] != m:
                problems.append(f"{where}.methods: {m!r} trains the same as {first[1]!r} (sweeps.{first[0]}): the "
                                "same methods with the same options, written another way, would run as separate "
                                "cells with separate records; write it one way")
        for key, opts in (sw.get("method_options") or {}).items():
            err = job.method_error(key)
            if err:
                problems.append(f"{where}.method_options: key {key!r} is not a method: {err}")
            else:
                _check_options(job, f"{where}.method_options.{key}", key, opts, problems)
        _check_train_args(f"{where}.train_args", sw.get("train_args"), problems)
        if sw.get("train_config") and not (Path(root) / sw["train_config"]).is_file() \
                and not Path(sw["train_config"]).is_file():
            problems.append(f"{where}.train_config: no such file {sw['train_config']!r} (relative to {root})")
        if sw.get("init") is not None and sw["init"] not in bases:
            problems.append(f"{where}: init {sw['init']!r} is not under `bases:` (bases: {', '.join(bases) or 'none'})")
        known_tasks = [tm for tm in sw["tasks"] if tm["task"] in job.task_names
                       and tm["model"] in job.models(tm["task"])]
        good_opts = [o for o in listed if _is_optimizer(o)]
        for tm, m, o in itertools.product(known_tasks[:1], [m for m in sw["methods"] if m not in bad_methods],
                                          good_opts):
            argv = cell_argv(sw, tm["task"], tm["model"], m, sw["batch_sizes"][0], sw["seeds"][0], optimizer=o)
            at = f"{where} (method {m}" + ("" if o == DEFAULT_OPTIMIZER else f", optimizer {o}") + ")"
            _check_argv(job, at, argv, m, problems, checked=set(options_for(sw, m)))
    repro = config.get("repro") or {}
    for kind, given, known in (("repro.names", repro.get("names") or [], list(REPRO)),
                               ("repro.options", list(repro.get("options") or {}), list(REPRO)),
                               ("notebooks", config.get("notebooks") or [], list(NOTEBOOKS))):
        bad = [g for g in given if g not in known]
        if bad:
            problems.append(f"{kind}: {', '.join(map(repr, bad))} not known; valid: {', '.join(known)}")
    if problems:
        raise ConfigError("the sweep config has entries the training job would refuse:\n  - "
                          + "\n  - ".join(dict.fromkeys(problems)))


def _is_optimizer(name) -> bool:
    """A name of OPTIMIZERS, GaLore / APOLLO options written in (``galore-adamw@rank=16``)."""
    try:
        check_optimizer(str(name))
    except ValueError:
        return False
    return True

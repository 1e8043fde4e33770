# Cells of the sweep and the paths the pipeline writes. Every rule file reads these helpers.
import itertools
import shlex
import sys
from pathlib import Path

R = config["results"].rstrip("/")
PY = config.get("python") or sys.executable
SCRIPTS = Path(workflow.basedir) / "workflow" / "scripts"
RECORD = f"{R}/runs/{{task}}/{{model}}/{{method}}/bs{{bs}}/seed{{seed}}.json"

wildcard_constraints:
    task="[^/]+",
    model="[^/]+",
    method="[^/]+",
    bs="[0-9]+",
    seed="[0-9]+",
    name="[a-z0-9_-]+",
    base="[A-Za-z0-9_.-]+",


SWEEP_DEFAULTS = {"seeds": [0], "steps": None, "dtype": "fp32", "train_config": None, "train_args": [],
                  "method_options": {}, "resources": {}, "init": None}
BASE = f"{R}/bases/{{base}}.safetensors"
config.setdefault("bases", {})
for _name, _sw in config["sweeps"].items():
    if _sw.get("init") is not None and _sw["init"] not in config["bases"]:
        raise ValueError(f"sweep {_name!r}: init {_sw['init']!r} is not under `bases:` "
                         f"(bases: {', '.join(config['bases']) or 'none'})")
for _sw in config["sweeps"].values():
    for _k, _v in SWEEP_DEFAULTS.items():
        _sw.setdefault(_k, _v)
config.setdefault("repro", {})
config["repro"].setdefault("names", ["block-breakdown", "fig1", "mesa-table", "tokentune-memory"])
config["repro"].setdefault("options", {})
config.setdefault("notebooks", ["memory", "speed", "accuracy", "paper_comparison"])


def _cells():
    """(task, model, method, bs, seed) -> (sweep name, sweep spec); a cell listed by two sweeps must agree."""
    cells = {}
    for name, sw in config["sweeps"].items():
        for tm, method, bs, seed in itertools.product(
            sw["tasks"], sw["methods"], sw["batch_sizes"], sw["seeds"]
        ):
            key = (tm["task"], tm["model"], method, int(bs), int(seed))
            if key in cells and _run_settings(cells[key][1], method) != _run_settings(sw, method):
                raise ValueError(
                    f"cell {key} is listed by sweeps {cells[key][0]!r} and {name!r} with different settings "
                    "(steps, dtype, train_config, train_args, method options or resources); make them agree "
                    "or drop it from one sweep"
                )
            cells.setdefault(key, (name, sw))
    return cells


def _options_for(sw, method):
    """Options of every component of a composed method name (and of the full name), later ones win."""
    opts = {}
    mo = sw.get("method_options", {})
    for part in method.split("+") + [method]:
        opts.update(mo.get(part, {}))
    return opts


def _run_settings(sw, method):
    keys = ("steps", "dtype", "train_config", "train_args", "resources", "init")
    return tuple(repr(sw.get(k)) for k in keys) + (repr(sorted(_options_for(sw, method).items())),)


CELLS = _cells()


def cell(wc):
    key = (wc.task, wc.model, wc.method, int(wc.bs), int(wc.seed))
    if key not in CELLS:
        raise ValueError(f"{key} is not a cell of any sweep in the config")
    return CELLS[key][1]


def record_paths():
    return [
        RECORD.format(task=t, model=m, method=x, bs=b, seed=s) for (t, m, x, b, s) in sorted(CELLS)
    ]


def train_args(wc):
    """The training job's command line for one cell (experiments/train.py)."""
    sw = cell(wc)
    args = ["--model", wc.model, "--task", wc.task, "--method", wc.method,
            "--batch-size", wc.bs, "--seed", wc.seed, "--dtype", sw["dtype"]]
    if sw.get("steps"):
        args += ["--steps", str(sw["steps"])]
    if sw.get("train_config"):
        args += ["--config", sw["train_config"]]
    for opt, val in _options_for(sw, wc.method).items():
        args += [f"--{opt.replace('_', '-')}", str(val)]
    args += list(sw.get("train_args", []))
    if sw.get("init"):
        args += ["--init", BASE.format(base=sw["init"])]
    return shlex.join(args)


def init_input(wc):
    """The base weights a cell starts from (an input of its job), or nothing."""
    name = cell(wc).get("init")
    return [BASE.format(base=name)] if name else []


def base_args(wc):
    """The training job's command line for one base (its weights and record are added by the rule)."""
    if wc.base not in config["bases"]:
        raise ValueError(f"{wc.base!r} is not under `bases:` in the config")
    b = config["bases"][wc.base]
    args = ["--model", b["model"], "--task", b["task"], "--method", b.get("method", "baseline"),
            "--batch-size", str(b["batch_size"]), "--seed", str(b.get("seed", 0)), "--steps", str(b["steps"])]
    return shlex.join(args + list(b.get("train_args", [])))


def res(key, default):
    return lambda wc: cell(wc).get("resources", {}).get(key, default)


def slurm_extra(wc):
    r = cell(wc).get("resources", {})
    extra = r.get("slurm_extra", "")
    return extra


def repro_names():
    return list(config["repro"]["names"])


TABLES = ["memory", "speed", "accuracy", "block_breakdown", "fig1", "mesa_table", "tokentune_memory"]
REPRO_TABLES = {
    "block-breakdown": "block_breakdown",
    "fig1": "fig1",
    "mesa-table": "mesa_table",
    "tokentune-memory": "tokentune_memory",
}
REPRO_FIGURES = REPRO_TABLES
REPRO_NAME = {v: k for k, v in REPRO_TABLES.items()}
REPRO_TITLES = {
    "block_breakdown": "Activation memory of one block by op kind: baseline vs LowMemoryBP (paper theory beside ours)",
    "fig1": "LowMemoryBP Fig. 1: peak memory of ViT-B/16, batch 64, LoRA rank 4, fp16 autocast",
    "mesa_table": "Mesa README: training memory at batch 128, AMP (DeiT-Ti/S/B, Swin-T)",
    "tokentune_memory": "TokenTune: BERT-large memory against batch size (baseline, LoRA, TokenTune k=16, both)",
}
RUN_FIGURES = ["memory_vs_batch", "step_time_ratio", "accuracy"]


def table_names():
    names = ["memory", "speed", "accuracy"] if CELLS else []
    return names + [REPRO_TABLES[n] for n in repro_names()]


def figure_names():
    names = list(RUN_FIGURES) if CELLS else []
    return names + [REPRO_FIGURES[n] for n in repro_names()]


def all_targets():
    out = []
    if CELLS:
        out += [f"{R}/runs.csv"]
    out += expand(f"{R}/tables/{{t}}.{{ext}}", t=table_names(), ext=["md", "csv"])
    out += expand(f"{R}/tables/{{t}}.html", t=table_names())
    out += expand(f"{R}/figures/{{f}}.png", f=figure_names())
    out += expand(f"{R}/notebooks/{{nb}}.ipynb", nb=config["notebooks"])
    return out

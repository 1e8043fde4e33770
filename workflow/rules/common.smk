# Cells of the sweep and the paths the pipeline writes. Every rule file reads these helpers. What the pipeline makes
# (tables, figures, reproductions, notebooks) is listed once, in workflow/catalogue.py; the sweep's cells, command
# lines and the check of the config against the training job are in workflow/sweep_config.py.
import os
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))
import catalogue as cat  # noqa: E402
import sweep_config  # noqa: E402

R = config["results"].rstrip("/")
PY = config.get("python") or sys.executable
# experiments/ (the training job, tasks, records) runs from this checkout, not from the installed wheel: this process
# and the training jobs (PY_JOB) find it first on their path
sys.path.insert(1, str(Path(workflow.basedir)))
PY_JOB = f"PYTHONPATH={shlex.quote(str(workflow.basedir))}${{PYTHONPATH:+:$PYTHONPATH}} {shlex.quote(PY)}"
SCRIPTS = Path(workflow.basedir) / "workflow" / "scripts"
# a cell's record: runs/<task>/<model>/<method>[/<optimizer>]/bs<B>/seed<S>.json (sweep_config.CELL: the optimizer's
# segment only when it is not the default, AdamW)
RECORD = f"{R}/runs/{sweep_config.CELL}.json"
BASE = f"{R}/bases/{{base}}.safetensors"

wildcard_constraints:
    task="[^/]+",
    model="[^/]+",
    method="[^/]+",
    bs="[0-9]+",
    seed="[0-9]+",
    opt=sweep_config.OPT_SEGMENT,
    name="[a-z0-9_-]+",
    base="[A-Za-z0-9_.-]+",


sweep_config.fill_defaults(config)
config.setdefault("repro", {})
config["repro"].setdefault("names", [r.name for r in cat.REPRODUCTIONS])
config["repro"].setdefault("options", {})
config.setdefault("notebooks", list(cat.NOTEBOOKS))
try:  # every entry against the training job's registries: a bad config stops here, before any job
    sweep_config.check(config, Path(workflow.basedir))
    CELLS = sweep_config.cells(config)
except sweep_config.ConfigError as err:
    raise WorkflowError(str(err)) from None


def cell(wc):
    key = (wc.task, wc.model, wc.method, int(wc.bs), int(wc.seed), sweep_config.optimizer_of(wc.opt))
    if key not in CELLS:
        raise ValueError(f"{key} is not a cell of any sweep in the config")
    return CELLS[key][1]


def record_paths():
    return [sweep_config.record_path(R, *key) for key in sorted(CELLS)]


def base_paths():
    return [p for name in config["bases"] for p in (BASE.format(base=name), f"{R}/bases/{name}.json")]


def train_args(wc):
    """The training job's command line for one cell (experiments/train.py)."""
    sw = cell(wc)
    base = BASE.format(base=sw["init"]) if sw.get("init") else None
    return sweep_config.join(sweep_config.cell_argv(sw, wc.task, wc.model, wc.method, wc.bs, wc.seed, base,
                                                    sweep_config.optimizer_of(wc.opt)))


def init_input(wc):
    """The base weights a cell starts from (an input of its job), or nothing."""
    name = cell(wc).get("init")
    return [BASE.format(base=name)] if name else []


def base_args(wc):
    """The training job's command line for one base (its weights and record are added by the rule)."""
    if wc.base not in config["bases"]:
        raise ValueError(f"{wc.base!r} is not under `bases:` in the config")
    return sweep_config.join(sweep_config.base_argv(config["bases"][wc.base]))


def res(key, default):
    return lambda wc: cell(wc).get("resources", {}).get(key, default)


def gpu_count():
    """GPUs this machine has for the training jobs (torch.cuda.device_count(), which honours CUDA_VISIBLE_DEVICES); 0
    without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# On a machine with CUDA every training cell claims a GPU (`gpu: 1` unless its sweep's resources say otherwise) and
# the run's `gpu` resource is the number of GPUs, as if `--resources gpu=N` had been given (a --resources gpu on the
# command line or in a profile wins): one cell per GPU at a time, while the CPU-only jobs (reproductions on fake
# tensors, tables) run beside them. Without CUDA nothing changes: cells claim no GPU. A cluster executor (SLURM)
# submits jobs that ask for their GPUs themselves: this local limit is not set there.
_nodes = workflow.global_resources.get("_nodes")
N_GPUS = gpu_count() if getattr(_nodes, "value", _nodes) is None else 0  # (Snakemake 8: plain values)
if N_GPUS and "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", N_GPUS)
GPU_PER_CELL = 1 if N_GPUS else 0


def slurm_extra(wc):
    return cell(wc).get("resources", {}).get("slurm_extra", "")


def reproductions():
    """The catalogue entries of the reproductions this config runs."""
    return [cat.REPRO[n] for n in config["repro"]["names"]]


def repro_of_stem(stem):
    return cat.REPRO_BY_STEM[stem]


def repro_table_inputs(wc):
    """The reproduction's CSV first (what the script reads as input[0]); for fig1 also the GPU run's fig1.csv where
    one is there (its GPU step-time column), so that a new GPU run remakes the table."""
    gpu = Path(workflow.basedir) / "results" / "gpu" / "fig1.csv"
    extra = [str(gpu)] if wc.table == "fig1" and gpu.is_file() else []
    return [cat.repro_csv(R, repro_of_stem(wc.table).name)] + extra


def table_stems():
    names = [t.name for t in cat.RUN_TABLES] if CELLS else []
    return names + [r.stem for r in reproductions()]


def figure_stems():
    names = [f.name for f in cat.RUN_FIGURES] if CELLS else []
    if any(sweep_config.spec_has_options(method) for (_, _, method, *_) in CELLS):
        names += [f.name for f in cat.OPTION_FIGURES]
    return names + [r.stem for r in reproductions()]


def table_files(ext):
    return [cat.table_paths(R, t)[ext] for t in table_stems()]


_damaged_checked = []


def set_aside_damaged_records():
    """Before a real run, move every record (and base record) that does not read back (truncated, empty, not a record)
    to <record>.damaged, so that the run remakes its cell; a dry run only says which it would remake. Done once, while
    the DAG is built (an input function), when Snakemake knows whether this is a dry run."""
    if _damaged_checked:
        return
    _damaged_checked.append(True)
    if not workflow.is_main_process or workflow.executor_plugin is None:
        return  # a job re-parsing the Snakefile (cluster), a report or a lint: leave the files alone
    from experiments.record import RecordError, load

    dry = workflow.dryrun or workflow.touch
    for path in record_paths() + [f"{R}/bases/{name}.json" for name in config["bases"]]:
        if not os.path.exists(path):
            continue
        try:
            load(path)
        except RecordError as err:
            if dry:
                logger.warning(f"damaged record, a real run remakes it: {err}")
            else:
                Path(path).rename(f"{path}.damaged")
                if path.endswith(".json") and "/bases/" in path:
                    Path(path).with_suffix(".safetensors").unlink(missing_ok=True)
                logger.warning(f"damaged record set aside as {path}.damaged, its cell is remade: {err}")


def checked_record_paths(wc):
    set_aside_damaged_records()  # also when runs.csv is asked for alone
    return record_paths()


def all_targets(wc=None):
    set_aside_damaged_records()
    out = record_paths() + base_paths()  # targets themselves, so a deleted record or base is remade
    if CELLS:
        out += [f"{R}/runs.csv"]
    for ext in cat.TABLE_FORMATS:
        out += table_files(ext)
    out += [cat.figure_path(R, f) for f in figure_stems()]
    out += [cat.notebook_path(R, nb) for nb in config["notebooks"]]
    return out

"""The optimizer as part of a sweep cell's identity (workflow/sweep_config.py CELL): a sweep's ``optimizers:`` makes one
cell per optimizer, the default (AdamW) keeps the path without an optimizer segment, another adds one; the dry run
plans distinct records and passes --optimizer; aggregate.py reads both back (also from a damaged record's path);
plots.py draws one line per (method, optimizer)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow"))
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))

import sweep_config  # noqa: E402

SWEEP = {"tasks": [{"task": "mnist5k", "model": "vit-mnist"}], "methods": ["baseline", "lora"],
         "optimizers": ["adamw", "adamw-fused-backward"], "batch_sizes": [8], "steps": 2,
         "train_args": ["--eval-limit", "16"]}


def _config(**changes) -> dict:
    return sweep_config.fill_defaults({"sweeps": {"opt": dict(copy.deepcopy(SWEEP), **changes)}})


def test_cells_paths_and_command_lines_per_optimizer():
    config = _config()
    sweep_config.check(config, ROOT)
    cells = sweep_config.cells(config)
    assert sorted(cells) == sorted((("mnist5k", "vit-mnist", m, 8, 0, o) for m in SWEEP["methods"]
                                    for o in SWEEP["optimizers"]))
    paths = {key: sweep_config.record_path("results", *key) for key in cells}
    assert len(set(paths.values())) == len(cells)
    # the default optimizer: the path of a sweep without `optimizers`; another: one more segment
    assert paths[("mnist5k", "vit-mnist", "lora", 8, 0, "adamw")] == \
        "results/runs/mnist5k/vit-mnist/lora/bs8/seed0.json"
    assert paths[("mnist5k", "vit-mnist", "lora", 8, 0, "adamw-fused-backward")] == \
        "results/runs/mnist5k/vit-mnist/lora/adamw-fused-backward/bs8/seed0.json"
    plain = sweep_config.fill_defaults({"sweeps": {"p": {k: v for k, v in copy.deepcopy(SWEEP).items()
                                                         if k != "optimizers"}}})
    assert [k[-1] for k in sweep_config.cells(plain)] == ["adamw", "adamw"]
    # each path reads back as its cell
    for key, path in paths.items():
        m = sweep_config.CELL_PATH.search(path)
        got = (m["task"], m["model"], m["method"], int(m["batch_size"]), int(m["seed"]),
               sweep_config.optimizer_of(m["optimizer"]))
        assert got == key
    sw = config["sweeps"]["opt"]
    argv = sweep_config.cell_argv(sw, "mnist5k", "vit-mnist", "lora", 8, 0, optimizer="adamw-fused-backward")
    assert argv[argv.index("--optimizer") + 1] == "adamw-fused-backward"
    assert "--optimizer" not in sweep_config.cell_argv(sw, "mnist5k", "vit-mnist", "lora", 8, 0)


@pytest.mark.parametrize("changes, needle", [
    ({"optimizers": ["adam"]}, "optimizers: must be a list of distinct names of adamw, adamw8bit"),
    ({"optimizers": ["adamw", "adamw"]}, "got ['adamw', 'adamw']"),
    ({"train_args": ["--optimizer", "adamw8bit"]}, "--optimizer is set by the pipeline from optimizers"),
    ({"train_args": ["--grad-accum", "2"]}, "adamw-fused-backward does not work with --grad-accum 2"),
])
def test_the_config_check_refuses_bad_optimizers(changes, needle):
    with pytest.raises(sweep_config.ConfigError) as err:
        sweep_config.check(_config(**changes), ROOT)
    assert needle in str(err.value)


@pytest.mark.slow
def test_dry_run_plans_one_record_per_optimizer(tmp_path):
    """Snakemake's own plan of a two-optimizer sweep: distinct records, --optimizer on the non-default cells."""
    from test_workflow import planned_jobs, snakemake

    cfg = tmp_path / "opt.yaml"
    cfg.write_text(yaml.safe_dump({"results": "res", "sweeps": {"opt": SWEEP}, "repro": {"names": []},
                                   "notebooks": []}))
    p = snakemake("-n", "-p", "--configfile", str(cfg), cwd=tmp_path, timeout=300)
    out = p.stdout + p.stderr
    assert planned_jobs(out)["train"] == 4
    lines = [ln for ln in out.splitlines() if "run_cell.py" in ln]
    planned = {ln.split("--out ")[1].split()[0]: ("--optimizer adamw-fused-backward" in ln) for ln in lines}
    assert planned == {f"res/runs/mnist5k/vit-mnist/{m}/{seg}bs8/seed0.json": bool(seg)
                       for m in ("baseline", "lora") for seg in ("", "adamw-fused-backward/")}


def _record(path: Path, method: str, optimizer: str, peak: int) -> Path:
    from experiments.record import error_record, write

    rec = error_record({"task": "mnist5k", "model": "vit-mnist", "method": method, "optimizer": optimizer,
                        "batch_size": 8, "seed": 0, "dtype": "fp32", "steps": 3}, None, "2026-01-01T00:00:00+00:00",
                       status="ok", peak={"device": {"bytes": peak, "how": "test"}})
    return write(rec, path)


def test_aggregate_reads_both_optimizers_and_a_damaged_records_optimizer_from_its_path(tmp_path):
    import aggregate

    root = str(tmp_path / "results")
    paths = [_record(Path(sweep_config.record_path(root, "mnist5k", "vit-mnist", "lora", 8, 0, o)), "lora", o, peak)
             for o, peak in (("adamw", 3 << 20), ("adamw-fused-backward", 2 << 20), ("adamw8bit", 1 << 20))]
    paths[2].write_text("{")  # damaged: its cell, optimizer included, comes from the path
    df = aggregate.aggregate(paths)
    assert list(df["optimizer"]) == ["adamw", "adamw-fused-backward", "adamw8bit"]
    assert list(df["status"]) == ["ok", "ok", "invalid"]
    assert list(df["peak_bytes"][:2]) == [3 << 20, 2 << 20]


def test_memory_figure_draws_one_line_per_method_and_optimizer():
    import plots

    rows = [dict(task="t", model="m", method=m, optimizer=o, batch_size=bs, seed=0, status="ok", steps=5,
                 peak_bytes=(10 + bs + i) * 2**20, activation_bytes=bs * 2**19, device="cpu (test)", dtype="fp32")
            for i, (m, o) in enumerate([("baseline", "adamw"), ("baseline", "adamw8bit"), ("lora", "adamw")])
            for bs in (8, 16)]
    fig = plots.memory_vs_batch(pd.DataFrame(rows))
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels == ["baseline", "baseline (adamw8bit)", "lora"]
    ys = [list(ln.get_ydata()) for ln in fig.axes[0].get_lines()]
    assert ys == [[18, 26], [19, 27], [20, 28]]  # each line its own cells, not a mix of optimizers

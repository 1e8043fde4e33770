"""The Snakemake pipeline: lint, dry runs of every config, the crash/OOM/interrupt handling of one cell, and a tiny
config of the whole pipeline end to end (train -> records -> runs.csv -> tables, figures, notebooks, report)."""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytestmark = pytest.mark.pipeline  # the full suite only: Snakemake dry runs and a tiny pipeline run (~250 s on 2 cores)

ROOT = Path(__file__).resolve().parents[2]
PAPER_CONFIGS = sorted((ROOT / "config" / "paper").glob("*.yaml"))
ALL_CONFIGS = sorted((ROOT / "config").rglob("*.yaml"))
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
sys.path.insert(0, str(ROOT / "workflow"))


def snakemake(*args, cwd: Path, timeout=600, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(cwd),
           *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                       preexec_fn=lambda: os.umask(0o022))  # a usual umask: files must come out 0644
    if check and p.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-6000:]}")
    return p


def planned_jobs(output: str) -> dict[str, int]:
    """Rule -> number of jobs, from the 'Job stats' table of a dry run."""
    stats = output.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", stats, re.M)}


def expected_cells(cfg: dict) -> set:
    cells = set()
    for sw in cfg["sweeps"].values():
        for tm, m, b, s, o in itertools.product(sw["tasks"], sw["methods"], sw["batch_sizes"], sw.get("seeds", [0]),
                                                sw.get("optimizers", ["adamw"])):
            cells.add((tm["task"], tm["model"], m, b, s, o))
    return cells


def test_lint_clean(tmp_path):
    p = snakemake("--lint", cwd=tmp_path, check=False, timeout=300)
    assert "Congratulations" in p.stdout + p.stderr, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda p: p.stem)
def test_dry_run_plans_every_cell(config, tmp_path):
    """Every config under config/ passes the check against the job's registries and plans every cell."""
    from catalogue import REPRODUCTIONS

    cfg = yaml.safe_load(config.read_text())
    p = snakemake("-n", "--configfile", str(config), cwd=tmp_path, timeout=300)
    jobs = planned_jobs(p.stdout + p.stderr)
    assert jobs.get("train", 0) == len(expected_cells(cfg))
    assert jobs.get("base", 0) == len(cfg.get("bases", {}))
    names = cfg.get("repro", {}).get("names", [r.name for r in REPRODUCTIONS])
    assert jobs.get("repro", 0) == len(names)
    from catalogue import NOTEBOOKS

    assert jobs.get("notebook", 0) == len(cfg.get("notebooks", NOTEBOOKS))
    assert jobs.get("aggregate", 0) == (1 if cfg["sweeps"] else 0)  # config/repro.yaml: reproductions only
    assert any("--configfile" in line or "Config file(s)" in line for line in (p.stdout + p.stderr).splitlines())


def test_paper_configs_ask_for_one_gpu_per_run():
    assert PAPER_CONFIGS, "no paper configs under config/paper/"
    for config in PAPER_CONFIGS:
        for name, sw in yaml.safe_load(config.read_text())["sweeps"].items():
            assert sw["resources"]["gpu"] == 1, (config.name, name)


def test_bad_config_is_rejected_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"sweeps": {"x": {"tasks": [{"task": "mnist5k", "model": "vit-mnist"}],
                                                    "methods": ["baseline"], "batch_sizes": [0]}}}))
    p = snakemake("-n", "--configfile", str(bad), cwd=tmp_path, check=False)
    assert p.returncode != 0 and "batch_sizes" in p.stdout + p.stderr


def test_unknown_base_is_rejected_with_the_known_ones(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "sweeps": {"x": {"tasks": [{"task": "tweets-lm", "model": "llama-tiny"}], "methods": ["lora"],
                         "batch_sizes": [4], "init": "nope"}},
        "bases": {"b1": {"task": "tweets-lm", "model": "llama-tiny", "batch_size": 4, "steps": 3}}}))
    p = snakemake("-n", "--configfile", str(bad), cwd=tmp_path, check=False)
    assert p.returncode != 0 and "init 'nope' is not under `bases:` (bases: b1)" in p.stdout + p.stderr


def test_conflicting_cells_are_rejected(tmp_path):
    sweep = {"tasks": [{"task": "mnist5k", "model": "vit-mnist"}], "methods": ["baseline"], "batch_sizes": [8]}
    bad = tmp_path / "conflict.yaml"
    bad.write_text(yaml.safe_dump({"sweeps": {"a": dict(sweep, steps=3), "b": dict(sweep, steps=5)}}))
    p = snakemake("-n", "--configfile", str(bad), cwd=tmp_path, check=False)
    assert p.returncode != 0 and "different settings" in p.stdout + p.stderr


# --- one cell: a crash is recorded, a usage error or an interrupt is not -------------------------------------

def _fake_python(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "fake_python"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return str(exe)


def _run_cell(tmp_path, body):
    out, log = tmp_path / "rec.json", tmp_path / "cell.log"
    args = [sys.executable, str(ROOT / "workflow" / "scripts" / "run_cell.py"), "--out", str(out), "--log", str(log),
            "--python", _fake_python(tmp_path, body), "--", "--model", "vit-mnist", "--task", "mnist5k",
            "--method", "lora+lowmembp", "--batch-size", "7", "--seed", "3", "--steps", "5", "--dtype", "bf16"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=60, preexec_fn=lambda: os.umask(0o022))
    return p, out


def test_crash_without_record_becomes_an_error_record(tmp_path):
    from experiments.record import load

    p, out = _run_cell(tmp_path, "echo 'Segmentation fault in some kernel' >&2; exit 139")
    assert p.returncode == 0
    rec = load(out)  # the record layout's own reader: a valid record
    assert rec.status == "error" and "Segmentation fault" in rec.message and "exit code 139" in rec.message
    assert (rec.run.method, rec.run.batch_size, rec.run.seed, rec.run.dtype) == ("lora+lowmembp", 7, 3, "bf16")
    assert out.stat().st_mode & 0o777 == 0o644  # umask 022: readable by the group, as any file the user writes


def test_a_job_that_exits_1_with_its_record_is_a_done_cell(tmp_path):
    """The training job exits 1 for an oom / error cell after writing its record: the cell is done, the sweep goes
    on, the record is the job's own."""
    p, out = _run_cell(tmp_path, 'for last; do :; done; echo \'{"status": "oom"}\' > "$last"; exit 1')
    assert p.returncode == 0 and out.read_text() == '{"status": "oom"}\n'


def test_usage_error_and_interrupt_leave_no_record(tmp_path):
    p, out = _run_cell(tmp_path, "echo 'unknown method' >&2; exit 2")
    assert p.returncode == 2 and not out.exists()
    p, out = _run_cell(tmp_path, "kill -TERM $$")
    assert p.returncode != 0 and not out.exists()
    assert not list(tmp_path.glob(".rec.json*")), "a temporary file was left behind"


# --- the whole pipeline on a tiny config ------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tmp_path):
    config = ROOT / "config" / "tiny.yaml"
    cfg = yaml.safe_load(config.read_text())
    snakemake("--cores", "2", "--configfile", str(config), cwd=tmp_path, timeout=900)
    res = tmp_path / "results"
    records = sorted((res / "runs").rglob("*.json"))
    assert len(records) == len(expected_cells(cfg))
    runs = pd.read_csv(res / "runs.csv")
    assert len(runs) == len(records) and set(runs["status"]) <= {"ok", "oom", "error"}
    ok = runs[runs["status"] == "ok"]
    assert len(ok) and (ok["peak_bytes"] > 0).all() and (ok["activation_bytes"] > 0).all()
    for name in ["memory", "speed", "accuracy"]:
        assert (res / "tables" / f"{name}.html").read_text().startswith("<html>")
        t = pd.read_csv(res / "tables" / f"{name}.csv")
        prefix = {"memory": "peak", "speed": "time", "accuracy": "metric"}[name]
        assert {f"{prefix}_ratio_paper", f"{prefix}_ratio_ours", f"{prefix}_ratio_ours/paper"} <= set(t.columns)
        assert (res / "tables" / f"{name}.md").read_text().startswith("# ")
    mem = pd.read_csv(res / "tables" / "memory.csv")
    low = mem[mem["method"] == "lowmembp"]
    assert low["peak_ratio_paper"].isna().all()  # a CPU stand-in shows no paper value (paper_claims.yaml)
    for png in res.glob("figures/*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from catalogue import RUN_FIGURES

    assert len(list(res.glob("figures/*.png"))) == len(RUN_FIGURES) + len(cfg["repro"]["names"]) + 1  # + headline
    from catalogue import NOTEBOOKS

    assert len(list(res.glob("notebooks/*.ipynb"))) == len(NOTEBOOKS)
    # results, tables and bases are readable by the user's group (umask 022 here): no 0600 files
    private = [f"{oct(f.stat().st_mode & 0o777)} {f.relative_to(res)}" for f in res.rglob("*")
               if f.is_file() and f.stat().st_mode & 0o044 != 0o044]
    assert not private, private
    # the base: made once by its own rule, then every cell of the sweep that names it starts from it
    base = res / "bases" / "tiny-base.safetensors"
    assert base.is_file() and json.loads((res / "bases" / "tiny-base.json").read_text())["status"] == "ok"
    lm = ok[ok["task"] == "tweets-lm"]
    assert len(lm) == 1 and lm["base_path"].iloc[0] == "results/bases/tiny-base.safetensors"
    acc = pd.read_csv(res / "tables" / "accuracy.csv")
    assert acc.loc[acc["task"] == "tweets-lm", "metric_before"].iloc[0] == pytest.approx(
        lm["base_metric_before"].iloc[0])
    assert acc.loc[acc["task"] == "mnist5k", "metric_before"].isna().all()
    # nothing left to do; a changed setting reruns only what it touches
    p = snakemake("-n", "--configfile", str(config), cwd=tmp_path)
    assert "Nothing to be done" in p.stdout + p.stderr
    changed = tmp_path / "changed.yaml"
    cfg2 = yaml.safe_load(config.read_text())
    cfg2["sweeps"]["tiny"]["steps"] += 1
    changed.write_text(yaml.safe_dump(cfg2))
    p = snakemake("-n", "--configfile", str(changed), cwd=tmp_path)
    tiny_cells = len(cfg["sweeps"]["tiny"]["methods"]) * len(cfg["sweeps"]["tiny"].get("optimizers", ["adamw"]))
    assert planned_jobs(p.stdout + p.stderr).get("train") == tiny_cells  # a changed parameter reruns its cells
    assert "repro" not in planned_jobs(p.stdout + p.stderr)  # and not what does not depend on them
    assert "base" not in planned_jobs(p.stdout + p.stderr)
    cfg_b = yaml.safe_load(config.read_text())
    cfg_b["bases"]["tiny-base"]["steps"] += 1
    changed.write_text(yaml.safe_dump(cfg_b))
    p = snakemake("-n", "--configfile", str(changed), cwd=tmp_path)
    jobs = planned_jobs(p.stdout + p.stderr)  # a changed base is remade, and the cells that start from it rerun
    assert jobs.get("base") == 1 and jobs.get("train") == len(cfg["sweeps"]["tiny-lm"]["methods"])
    # a cell added to the sweep is run alone (the others are kept), and so is a missing record asked for
    cfg3 = yaml.safe_load(config.read_text())
    cfg3["sweeps"]["tiny"]["seeds"] = cfg3["sweeps"]["tiny"].get("seeds", [0]) + [7]
    more = tmp_path / "more.yaml"
    more.write_text(yaml.safe_dump(cfg3))
    p = snakemake("-n", "--configfile", str(more), cwd=tmp_path)
    tiny = cfg3["sweeps"]["tiny"]  # one new cell per method and optimizer
    assert planned_jobs(p.stdout + p.stderr).get("train") == len(tiny["methods"]) * len(tiny.get("optimizers", [0]))
    records[0].unlink()  # a deleted record is remade by a plain rerun (records are targets of `all`)
    p = snakemake("-n", "--configfile", str(config), cwd=tmp_path)
    assert planned_jobs(p.stdout + p.stderr).get("train") == 1
    # the report
    snakemake("--configfile", str(config), "--cores", "1", cwd=tmp_path)
    snakemake("--configfile", str(config), "--report", str(tmp_path / "report.html"), cwd=tmp_path)
    assert (tmp_path / "report.html").stat().st_size > 10_000


def test_tables_put_paper_ours_and_ratio_side_by_side(tmp_path):
    """Synthetic rows (a test input, not a result): ratios use the right reference and the paper's claim."""
    import paper_claims
    import sweep_layouts
    import table_maths
    import tables

    rows = []
    for method, peak, act, t in [("baseline", 100, 40, 1.0), ("lowmembp", 80, 24, 1.05), ("lora", 90, 40, 0.9),
                                 ("lora+lowmembp", 63, 20, 0.9), ("tokentune", 50, 10, 0.7)]:
        for seed, acc in [(0, 0.8), (1, 0.9)]:
            rows.append(dict(task="cifar100", model="vit-b16", method=method, batch_size=8, seed=seed, status="ok",
                             peak_bytes=peak * 2**20, activation_bytes=act * 2**20, step_time_p50=t,
                             samples_per_s=8 / t, metric_name="accuracy", metric_value=acc, device="cpu"))
    rows.append(dict(rows[0], seed=2, status="oom", peak_bytes=None, metric_value=None))
    runs = pd.DataFrame(rows)
    claims = paper_claims.load_claims()
    mem = table_maths.memory_table(runs, claims).set_index("method")
    assert mem.loc["lowmembp", "peak_ratio_ours"] == pytest.approx(0.8)
    assert mem.loc["lowmembp", "peak_ratio_paper"] == pytest.approx(0.73)
    assert mem.loc["lowmembp", "peak_ratio_ours/paper"] == pytest.approx(0.8 / 0.73)
    assert mem.loc["lora+lowmembp", "peak_ratio_ours"] == pytest.approx(0.7)  # against lora, not baseline
    assert mem.loc["lora+lowmembp", "act_ratio_ours"] == pytest.approx(0.5)
    assert mem.loc["baseline", "status"] == "ok/oom" and mem.loc["baseline", "peak_MiB"] == pytest.approx(100)
    assert pd.isna(mem.loc["tokentune", "peak_ratio_paper"])
    acc = table_maths.accuracy_table(runs, claims).set_index("method")
    assert acc.loc["lowmembp", "metric_std"] == pytest.approx(7.07, abs=0.1)  # accuracy in %
    assert acc.loc["lowmembp", "metric_ratio_ours"] == pytest.approx(1.0) and acc.loc["lowmembp", "seeds"] == 2
    spd = table_maths.speed_table(runs, claims).set_index("method")
    assert spd.loc["lowmembp", "time_ratio_ours"] == pytest.approx(1.05)
    mem_df = table_maths.memory_table(runs, claims)
    tables.write(mem_df, tmp_path / "m.md", tmp_path / "m.csv", sweep_layouts.run_layout("memory", mem_df, runs))
    md = (tmp_path / "m.md").read_text()
    assert "| lowmembp" in md and "LowMemoryBP, the paper's stated summary" in md  # the paper's source: a footnote
    assert "peak_ratio_ours/paper" in (tmp_path / "m.csv").read_text()  # the CSV keeps every column


def test_stopping_the_wrapper_stops_the_job(tmp_path):
    import signal
    import time

    out, log = tmp_path / "rec.json", tmp_path / "cell.log"
    marker = tmp_path / "child_alive"
    exe = _fake_python(tmp_path, f"trap 'rm -f {marker}; exit 143' TERM; touch {marker}; sleep 30 & wait")
    p = subprocess.Popen([sys.executable, str(ROOT / "workflow" / "scripts" / "run_cell.py"), "--out", str(out),
                          "--log", str(log), "--python", exe, "--", "--model", "m"])
    for _ in range(100):
        if marker.exists():
            break
        time.sleep(0.05)
    assert marker.exists()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) != 0
    assert not marker.exists(), "the training job kept running after its wrapper was stopped"
    assert not out.exists()


def test_accuracy_figure_uses_the_trained_cells_not_the_short_memory_cells():
    """Memory/speed cells (few steps) and accuracy cells (many) share a task: the accuracy figure takes the batch
    size with the most seeds, then the longest training, never the 5-step cells."""
    from plots import accuracy_batch_size

    rows = [dict(batch_size=8, seed=0, steps=5, method=m) for m in ("a", "b", "c")]
    rows += [dict(batch_size=16, seed=0, steps=60, method=m) for m in ("a", "b")]
    assert accuracy_batch_size(pd.DataFrame(rows)) == 16
    rows += [dict(batch_size=32, seed=s, steps=20, method="a") for s in (0, 1)]
    assert accuracy_batch_size(pd.DataFrame(rows)) == 32  # more seeds wins: the spread needs them


# --- one catalogue ------------------------------------------------------------------------------------------------

def test_the_catalogue_is_what_the_library_and_the_scripts_make():
    """workflow/catalogue.py lists the reproductions, tables, figures and notebooks; each is made by its script."""
    import catalogue
    import plots
    import plots_repro
    import table_maths
    from experiments.repro import REPROS

    assert [r.name for r in catalogue.REPRODUCTIONS] == list(REPROS)
    assert [t.name for t in catalogue.RUN_TABLES] == list(table_maths.RUN_TABLES)
    assert [f.name for f in catalogue.RUN_FIGURES if f.script == "plots.py"] == list(plots.FIGURES)
    assert set(plots_repro.TITLES) == set(catalogue.REPRO_BY_STEM)
    assert set(catalogue.NOTEBOOKS) == {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    for entry in (*catalogue.RUN_TABLES, *catalogue.RUN_FIGURES):
        assert (ROOT / "workflow" / "scripts" / entry.script).is_file()


def test_no_second_list_of_reproductions_and_no_second_atomic_writer():
    """The reproductions are named once (the catalogue; experiments.repro is the library's own registry), and the
    pipeline's files are written by lowmembp.atomic, not by copies of it."""
    sources = [ROOT / "Snakefile", *(ROOT / "workflow").rglob("*.smk"), *(ROOT / "workflow").rglob("*.py"),
               ROOT / "workflow" / "schemas" / "config.schema.yaml"]
    for f in sources:
        text = f.read_text()
        if f.name != "catalogue.py":
            assert not re.search(r"['\"](mesa-table|tokentune-memory)['\"]", text), f"{f}: names a reproduction"
        assert "mkstemp" not in text and "os.replace" not in text, f"{f}: its own atomic write"

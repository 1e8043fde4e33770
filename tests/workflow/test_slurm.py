"""The SLURM profile on a real one-node SLURM cluster: tests/slurm_cluster.sh brings up munged + slurmctld + slurmd
(root; Debian's packages, installed if missing), the tiny pipeline runs through workflow/profiles/slurm with the
README's command line, and its runs.csv must equal a local run's (same cells, statuses and every field that does not
depend on timing or on when and where it ran). The tweets-lm cell asks for one GPU (an overlay config): the fake GPU
of the node must be granted to that job and to no other. Skipped, with the reason, where no cluster can be started
(not root, no SLURM and no apt-get, or a machine with its own /etc/slurm/slurm.conf)."""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "workflow" / "profiles" / "slurm"
sys.path.insert(0, str(ROOT / "workflow"))
import sweep_config  # noqa: E402

TINY = ROOT / "config" / "tiny.yaml"
PARTITION = "gpu"  # a partition of tests/slurm_cluster.sh's cluster that is not its default
GPU_SWEEP = "tiny-lm"  # its one cell asks for gpu: 1
TIMEOUT = 1800  # seconds per snakemake run; on an idle 2-core machine the whole test takes a few minutes
# runs.csv columns that depend on timing, on when / where / from which commit a run ran, or on the process's memory
# as the OS counts it (RSS). Everything else (cells, status, losses, metrics, exact tensor bytes, settings, versions,
# and base_sha256: the base's file is the same bytes for the same weights, experiments/weights.py) must be equal.
NOT_COMPARED = re.compile(r"^step_time_(p\d+|ci95_low|ci95_high)$|_per_s$|^(started|finished)_at$|^hostname$"
                          r"|^host_peak_bytes$|^git_")


def _run(cmd, timeout=60, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node cluster in a private folder; stopped (jobs cancelled, daemons killed) even when the test fails."""
    if os.geteuid() != 0:
        pytest.skip("needs root: tests/slurm_cluster.sh starts its own munged, slurmctld and slurmd")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install slurmctld slurmd slurm-client munge")
    pytest.importorskip("snakemake_executor_plugin_slurm",
                        reason="pip install 'lowmembp[slurm]' (the profile's plugin)")
    d = tmp_path_factory.mktemp("slurm")
    script = ROOT / "tests" / "slurm_cluster.sh"
    p = _run(["bash", str(script), "start", str(d)], timeout=600)
    try:
        if p.returncode == 3:
            pytest.skip(p.stderr.strip())
        assert p.returncode == 0, f"the cluster did not come up:\n{p.stdout}\n{p.stderr}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_"))}  # none of the user's
        yield dict(env, SLURM_CONF=str(d / "slurm.conf"), PATH=os.environ["PATH"] + ":/usr/sbin")
    finally:
        _run(["bash", str(script), "stop", str(d)], timeout=120)


def _snakemake(args, cwd: Path, env: dict) -> subprocess.Popen:
    env = dict(env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    log = open(cwd / "snakemake.log", "w")
    return subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=lambda: os.umask(0o022))


def _wait(proc: subprocess.Popen, cwd: Path, what: str) -> str:
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(60)
        rc = "timeout"
    out = (cwd / "snakemake.log").read_text()
    assert rc == 0, f"{what} failed ({rc}):\n{out[-8000:]}"
    return out


def _jobs(env) -> list[dict]:
    """Every job the cluster knows (MinJobAge keeps finished ones), as scontrol's key=value fields."""
    out = _run(["scontrol", "--details", "--oneliner", "show", "job"], env=env).stdout
    jobs = []
    for line in out.splitlines():
        if "JobId=" in line:
            jobs.append(dict(re.findall(r"(\S+?)=(\S*)", line)))
    return jobs


def test_tiny_pipeline_through_the_slurm_profile_equals_a_local_run(cluster, tmp_path):
    env = cluster
    prof = yaml.safe_load((PROFILE / "config.yaml").read_text())
    cfg = yaml.safe_load(TINY.read_text())
    assert GPU_SWEEP in cfg["sweeps"] and len(cfg["sweeps"][GPU_SWEEP]["methods"]) == 1
    gpu_cfg = tmp_path / "gpu.yaml"  # merged into tiny.yaml by Snakemake: one cell asks for one GPU
    gpu_cfg.write_text(yaml.safe_dump({"sweeps": {GPU_SWEEP: {"resources": {"gpu": 1}}}}))
    cfgs = [str(TINY), str(gpu_cfg)]

    # the plugin polls with squeue: the cluster must keep finished jobs 3 x its first-check delay
    conf = _run(["scontrol", "show", "config"], env=env).stdout
    min_job_age = int(re.search(r"^MinJobAge\s*=\s*(\d+)", conf, re.M).group(1))
    assert prof["slurm-status-command"] == "squeue"
    assert min_job_age >= 3 * prof["slurm-init-seconds-before-status-checks"]

    local, remote = tmp_path / "local", tmp_path / "slurm"
    local.mkdir(), remote.mkdir()
    t0 = time.time()
    # the README's command (docs/pipeline.md, "Paper sweeps on a GPU machine or a SLURM cluster") with the test's paths
    # (a results folder of its own, the tiny config and the GPU overlay); SBATCH_ACCOUNT is left out: this cluster
    # has no accounts. The local run (only runs.csv) runs meanwhile: the SLURM run is mostly waiting.
    slurm = _snakemake(["--profile", str(PROFILE), "--configfile", *cfgs, "--directory", str(remote)], remote,
                       dict(env, SBATCH_PARTITION=PARTITION))
    plain = _snakemake(["--cores", "1", "--configfile", *cfgs, "--directory", str(local), "results/runs.csv"],
                       local, os.environ)
    try:
        out = _wait(slurm, remote, "snakemake --profile workflow/profiles/slurm")
        _wait(plain, local, "the local run")
    finally:
        for p in (slurm, plain):
            if p.poll() is None:
                p.terminate()
    print(f"slurm and local runs took {time.time() - t0:.0f} s")
    assert re.search(r"\d+ of \d+ steps \(100%\) done", out), out[-3000:]

    # runs.csv: same cells, same statuses, same deterministic fields
    a = pd.read_csv(local / "results" / "runs.csv")
    b = pd.read_csv(remote / "results" / "runs.csv")
    key = ["task", "model", "method", "batch_size", "seed", "optimizer"]
    assert sorted(a.columns) == sorted(b.columns)
    a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
    assert len(a) == len(sweep_config.cells(sweep_config.fill_defaults(copy.deepcopy(cfg))))  # one row per cell
    assert a[key + ["status"]].equals(b[key + ["status"]])
    assert (a["status"] == "ok").all(), a[["method", "status", "message"]]
    compared = [c for c in a.columns if not NOT_COMPARED.search(c)]
    assert {"final_loss", "metric_value", "peak_bytes", "activation_bytes"} <= set(compared)
    diff = {c: (a[c].tolist(), b[c].tolist()) for c in compared if not a[c].equals(b[c])}
    assert not diff, f"runs.csv differs between the local and the SLURM run: {diff}"

    # every job: in the partition asked for, completed, sized by the profile / the sweep (minutes); only the
    # tweets-lm training job asked for a GPU, and SLURM granted it the node's (fake) GPU
    jobs = [j for j in _jobs(env) if j.get("WorkDir") == str(remote)]
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    assert sorted(j["JobId"] for j in jobs) == sorted(submitted) and jobs
    assert {j["Partition"] for j in jobs} == {PARTITION}
    assert {j["JobState"] for j in jobs} == {"COMPLETED"}, [(j["JobId"], j["JobState"]) for j in jobs]
    by_rule = {}
    for j in jobs:
        by_rule.setdefault(re.match(r"rule_([a-z_]+?)(?:_wildcards_|$)", j["Comment"]).group(1), []).append(j)
    assert {"train", "base", "aggregate", "notebook"} <= set(by_rule), sorted(by_rule)
    gpu_jobs = [j for j in jobs if j.get("JOB_GRES", "(null)") != "(null)"]
    assert [j["Comment"] for j in gpu_jobs] == [c for c in (j["Comment"] for j in by_rule["train"])
                                                if "tweets-lm" in c], gpu_jobs
    assert gpu_jobs[0]["JOB_GRES"] == "gpu:1" and gpu_jobs[0]["TresPerJob"] == "gres:gpu:1"
    for j in by_rule["train"]:  # the sweep's runtime (schema default 30 min), one node
        assert j["TimeLimit"] == "00:30:00" and j["NumNodes"] == "1", j
    for j in by_rule["aggregate"] + by_rule["notebook"]:  # the profile's default-resources
        assert j["TimeLimit"] == "01:00:00" and j["MinMemoryNode"] == f"{prof['default-resources']['mem_mb']}M", j


def _dry_run_resources(tmp_path: Path, env: dict, *configs: str) -> dict[str, list[dict]]:
    """rule -> the resources of each of its jobs, as `snakemake -n --profile workflow/profiles/slurm` plans them."""
    p = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--profile", str(PROFILE), "--configfile", *configs,
                        "--directory", str(tmp_path)], cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    jobs: dict[str, list[dict]] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", p.stdout + p.stderr):
        m = re.match(r"(?:local)?rule (\w+):", block)
        r = re.search(r"^\s+resources: (.*)$", block, re.M)
        if m and r:
            jobs.setdefault(m.group(1), []).append(dict(kv.split("=", 1) for kv in r.group(1).split(", ")))
    return jobs


def test_profile_passes_partition_and_account_and_sizes_jobs_from_the_config(tmp_path):
    """No cluster needed: the profile's default-resources keep their sizes when SBATCH_PARTITION / SBATCH_ACCOUNT are
    set (even a partition named like a Python builtin and a numeric account stay strings), a cell's `gpu: N`,
    `runtime` and `mem_mb` become its job's request on one node, and every other rule gets the profile's defaults."""
    pytest.importorskip("snakemake_executor_plugin_slurm",
                        reason="pip install 'lowmembp[slurm]' (the profile's plugin)")
    prof = yaml.safe_load((PROFILE / "config.yaml").read_text())["default-resources"]
    over = tmp_path / "gpus.yaml"
    over.write_text(yaml.safe_dump({"sweeps": {GPU_SWEEP: {"resources": {"gpu": 2, "runtime": 7, "mem_mb": 1234}}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBATCH_")}
    jobs = _dry_run_resources(tmp_path, dict(env, SBATCH_PARTITION="all", SBATCH_ACCOUNT="0123"), str(TINY), str(over))
    assert {"train", "base", "aggregate", "notebook"} <= set(jobs)
    for rule, rjobs in jobs.items():
        for res in rjobs:
            assert res["slurm_partition"] == "all" and res["slurm_account"] == "0123", (rule, res)
            if rule == "train":
                assert res["nodes"] == "1", res
            elif rule != "all":
                assert (res["runtime"], res["mem_mb"]) == (str(prof["runtime"]), str(prof["mem_mb"])), (rule, res)
    lm = [r for r in jobs["train"] if r["gpu"] == "2"]
    assert len(lm) == 1 and (lm[0]["runtime"], lm[0]["mem_mb"]) == ("7", "1234")
    assert all(r["gpu"] == "0" and r["runtime"] == "30" for r in jobs["train"] if r is not lm[0])
    # without the variables: no partition or account (the plugin then uses the cluster's default partition)
    jobs = _dry_run_resources(tmp_path, env, str(TINY))
    assert not any("slurm_partition" in r or "slurm_account" in r for rj in jobs.values() for r in rj)

"""Fault injection on a tiny pipeline: stop snakemake mid-run (SIGINT), kill one training job (SIGKILL), damage a
record; after each, rerun exactly as the README says (`snakemake --cores all`) and compare the final runs.csv with an
undisturbed run of the same config: same cells, same statuses, same deterministic fields."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml

pytestmark = pytest.mark.pipeline  # the full suite only: interrupted and failing pipeline runs (~350 s)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "results": "results", "threads_per_run": 1,
    "sweeps": {"faults": {
        "tasks": [{"task": "mnist5k", "model": "vit-mnist"}], "methods": ["baseline", "lowmembp"],
        "batch_sizes": [8], "steps": 3,
        "train_args": ["--eval-limit", "32", "--limit", "128", "--timing-warmup", "1"]}},
    "repro": {"names": []}, "notebooks": [],
    # no planner capacity table: minutes of work that needs no record (under --cores 1 it could run before the cells)
    "capacity": {"models": {}},
}
# What two runs of the same cell must agree on (times, hosts and step times are not deterministic).
SAME = ["task", "model", "method", "batch_size", "seed", "status", "steps", "activation_bytes", "final_loss",
        "metric_name", "metric_value"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def default_sigint() -> None:
    """A child's SIGINT as a shell would start it: its default action. pytest-xdist's workers ignore SIGINT (their
    controller handles Ctrl-C), and an ignored signal stays ignored in a child: Python then installs no
    KeyboardInterrupt handler and ``sh`` cannot trap it, so what these tests send would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def command(workdir: Path, config: Path, *extra: str) -> list[str]:
    """The README's command (`snakemake --cores all`), pointed at this test's folder and config."""
    return [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
            "--configfile", str(config), "--cores", "all", *extra]


def run(workdir: Path, config: Path) -> str:
    p = subprocess.run(command(workdir, config), capture_output=True, text=True, timeout=600, env=ENV)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "IncompleteFilesException" not in out
    return out


def start(workdir: Path, config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command(workdir, config, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV, start_new_session=True, preexec_fn=default_sigint)


@dataclass
class TrainingJob:
    pid: int
    record: Path  # its --out


def training_jobs(workdir: Path, under: int | None = None) -> list[TrainingJob]:
    """The training processes (python -m experiments.train) running in ``workdir``; with ``under``, only those started
    by that process (a snakemake), not ones left over from an earlier run."""
    jobs = []
    for proc in psutil.process_iter():
        try:
            cmd = proc.cmdline()
            if "experiments.train" not in cmd or Path(proc.cwd()) != workdir or "--out" not in cmd:
                continue
            if under is not None and under not in {p.pid for p in proc.parents()}:
                continue
            jobs.append(TrainingJob(proc.pid, workdir / cmd[cmd.index("--out") + 1]))
        except (psutil.Error, OSError, IndexError):
            continue
    return jobs


def unfinished_training_job(workdir: Path, sm: subprocess.Popen) -> TrainingJob:
    """A training job of ``sm`` that has not written its record yet (still working, not exiting)."""
    return wait_for(lambda: [j for j in training_jobs(workdir, under=sm.pid) if not j.record.exists()],
                    "a training job without its record")[0]


def wait_for(condition, what: str, timeout: float = 240):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def records(workdir: Path) -> list[Path]:
    return sorted((workdir / "results" / "runs").rglob("*.json"))


def compared(runs_csv: Path) -> pd.DataFrame:
    df = pd.read_csv(runs_csv)
    return df[SAME].sort_values(["task", "model", "method", "batch_size", "seed"]).reset_index(drop=True)


@pytest.mark.slow
def test_interrupt_kill_and_damage_then_plain_reruns_end_as_an_undisturbed_run(tmp_path):
    if not Path("/proc/self/cwd").exists():
        pytest.skip("needs /proc to find the training processes")
    config = tmp_path / "faults.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    cells = len(CONFIG["sweeps"]["faults"]["methods"])
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    calm.mkdir()
    hit.mkdir()
    run(calm, config)
    reference = compared(calm / "results" / "runs.csv")
    assert len(reference) == cells and set(reference["status"]) == {"ok"}

    # 1. SIGINT to snakemake alone (as `kill -INT`, not a terminal's Ctrl-C) while its second training job works (one
    # job at a time, after the first record): the job is stopped with it, not waited for, and leaves no record
    sm = start(hit, config, "--cores", "1")
    first = wait_for(lambda: records(hit), "the first record")
    interrupted = unfinished_training_job(hit, sm)
    sm.send_signal(signal.SIGINT)
    out, _ = sm.communicate(timeout=120)  # (reads its output: a full pipe would stall it)
    assert sm.returncode != 0, out[-4000:]
    assert not training_jobs(hit), "a training job outlived the interrupted snakemake"
    assert not interrupted.record.exists(), "the interrupted job went on to write its record"
    assert records(hit) == first
    assert not list((hit / "results").rglob("*.tmp")), "an interrupted run left a temporary file"
    from experiments.record import load

    for rec in records(hit):
        load(rec)  # whole, or not there

    # 2. the plain rerun continues (no IncompleteFilesException); one of its training jobs is SIGKILLed
    sm = start(hit, config)
    victim = unfinished_training_job(hit, sm)
    os.kill(victim.pid, signal.SIGKILL)
    out, _ = sm.communicate(timeout=600)
    assert sm.returncode == 0, out[-4000:]
    assert "IncompleteFilesException" not in out
    killed = [r for r in records(hit) if load(r).status == "error"]
    assert killed == [victim.record] and "killed by signal 9" in load(victim.record).message  # by the crash guard
    assert len(records(hit)) == cells

    # 3. a record damaged, the killed cell's record deleted (README: a rerun remakes a missing record)
    killed[0].unlink()
    damaged = next(r for r in records(hit) if r != killed[0])
    damaged.write_text(damaged.read_text()[:40])
    dry = subprocess.run(command(hit, config, "-n"), capture_output=True, text=True, timeout=300, env=ENV)
    assert "damaged record" in dry.stdout + dry.stderr and damaged.read_text()  # a dry run changes nothing
    run(hit, config)
    assert Path(f"{damaged}.damaged").is_file()  # set aside, then remade
    load(damaged)
    assert "Nothing to be done" in run(hit, config)

    pd.testing.assert_frame_equal(compared(hit / "results" / "runs.csv"), reference)
    for name in ("memory", "speed", "accuracy"):  # the tables were remade with the runs
        assert (hit / "results" / "tables" / f"{name}.html").stat().st_mtime >= \
            (hit / "results" / "runs.csv").stat().st_mtime


PARENT = """
import subprocess, sys
sys.path.insert(0, {workflow!r})
import interrupts

assert interrupts.install()
def shell(name, **kw):  # a job that says when it got SIGINT
    trap = "trap 'touch {tmp}/" + name + "; exit 130' INT; echo ready; sleep 20 & wait"  # ends anyway
    return subprocess.Popen(["sh", "-c", trap], stdout=subprocess.PIPE, text=True, **kw)
job, own_group = shell("job"), shell("own_group", start_new_session=True)
job.stdout.readline(), own_group.stdout.readline()
try:
    print("ready", flush=True)
    job.wait()
except KeyboardInterrupt:  # raised as by Python's own handler, after passing the signal on
    print("job exit", job.wait(), flush=True)
    own_group.kill()
    sys.exit(3)
"""


def test_sigint_to_snakemake_alone_reaches_its_jobs_in_its_group(tmp_path):
    """workflow/interrupts.py, without Snakemake: a SIGINT to the parent alone reaches its child in its process group
    (a job shell) and not one in a group of its own (a training job, which run_cell.py signals itself)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(workflow=str(ROOT / "workflow"), tmp=tmp_path)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True,  # no terminal
                              preexec_fn=default_sigint)
    assert parent.stdout.readline().strip() == "ready"
    parent.send_signal(signal.SIGINT)
    try:
        out, _ = parent.communicate(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):  # its group: what is left of the parent and its job
            os.killpg(parent.pid, signal.SIGKILL)
    assert parent.returncode == 3 and "job exit 130" in out
    assert (tmp_path / "job").exists() and not (tmp_path / "own_group").exists()


def test_a_terminal_ctrl_c_is_not_passed_on_a_second_time():
    """In a terminal's foreground group a SIGINT is taken for a Ctrl-C, which reached the jobs already."""
    import pty

    check = (f"import sys; sys.path.insert(0, {str(ROOT / 'workflow')!r}); import interrupts; "
             "print('terminal' if interrupts.interrupted_by_terminal() else 'none')")
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own with the pty as its controlling terminal, in its foreground group
        os.execv(sys.executable, [sys.executable, "-c", check])
    out = b""
    with contextlib.suppress(OSError):  # EIO once the child has gone
        while chunk := os.read(fd, 1024):
            out += chunk
    os.close(fd)
    assert os.waitpid(pid, 0)[1] == 0
    assert out.decode().strip() == "terminal"
    no_tty = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, start_new_session=True)
    assert no_tty.stdout.strip() == "none"

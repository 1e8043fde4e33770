"""Run one training job and make sure the cell ends with a record.

    python run_cell.py --out RECORD --log LOG -- <experiments.train arguments>

The training job writes its own record atomically for ``ok``, ``oom`` and ``error`` cells (exit 0 for ``ok``, 1 for
the others); a cell with a record is done, whatever the job's exit status, so the sweep goes on. If it dies
without a record (a crash, an import error, killed for memory by the OS) this writes an ``error`` record itself,
atomically (``experiments.record.error_record`` and ``write``), with the end of the log as the message, so the sweep
goes on and the table shows the failure. It does not write a record when the job was stopped by a signal from the
user (SIGINT/SIGTERM/SIGHUP: an interrupted run leaves nothing; the job runs in a process group of its own and gets
the first such signal once, from this wrapper) or when the job rejected its arguments (exit 2: a config mistake that
must be fixed, not recorded).

``--nproc N`` (the rule passes the cell's ``resources: {gpu: N}``): N > 1 runs the job under torchrun with N
processes on this node (``python -m torch.distributed.run --standalone --nproc-per-node N``), adding
``--distributed ddp`` unless the cell's ``train_args`` choose (``[--distributed, fsdp]``); ``--batch-size`` is
then the global batch (``experiments.distributed``).

One GPU per job: where the machine has several GPUs and ``CUDA_VISIBLE_DEVICES`` is not set (a local run; SLURM sets
it), a one-process job claims a GPU of its own (:func:`claim_gpu`: an exclusive ``flock`` on one lock file per GPU,
held until the job ends) and sees only that one. Snakemake runs at most ``gpu`` such jobs at once (the Snakefile's
default ``--resources gpu=<number of GPUs>``), so a free one is always there.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

# The checkout's root on the path: this script imports ``experiments.record`` when it writes a crash record, also when
# it is run by path outside Snakemake (which puts the root on the job's PYTHONPATH, workflow/rules/common.smk).
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

USAGE_ERROR = 2
USER_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def identity(train_args: list[str]) -> dict:
    """The cell's identity from the training job's arguments (what the crash record says the cell was)."""
    p = argparse.ArgumentParser(add_help=False)
    for flag in ("--model", "--task", "--method", "--dtype"):
        p.add_argument(flag)
    for flag in ("--batch-size", "--seed", "--steps"):
        p.add_argument(flag, type=int)
    a, _ = p.parse_known_args(train_args)
    ident = {"task": a.task, "model": a.model, "method": a.method, "seed": a.seed,
             "dtype": a.dtype if a.dtype in ("fp32", "bf16", "fp16") else None,
             "batch_size": a.batch_size if a.batch_size and a.batch_size > 0 else None, "steps": 0,
             "steps_planned": a.steps}
    return {k: v for k, v in ident.items() if v is not None}


def write_error_record(out: Path, train_args: list[str], message: str, started: str) -> None:
    """A valid ``error`` record (experiments.record: the record layout's one writer), written atomically."""
    from experiments.record import error_record, write

    write(error_record(identity(train_args), message, started, environment={
        "device": "unknown (the job died before reporting)", "hostname": platform.node()}), out)


def job_command(python: str, train_args: list[str], out: Path, nproc: int = 1) -> list[str]:
    """The training job's command: one process, or torchrun with ``nproc`` (see the module doc)."""
    job = ["-m", "experiments.train", *train_args, "--out", str(out)]
    if nproc <= 1:
        return [python, *job]
    if not any(a == "--distributed" or a.startswith("--distributed=") for a in train_args):
        job += ["--distributed", "ddp"]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *job]


class Stop:
    """Stopping this wrapper stops the job too, and leaves no record: the first user signal is passed on to the job
    once (more signals, e.g. a terminal's Ctrl-C and Snakemake's, do not interrupt the job's clean-up again)."""

    def __init__(self):
        self.job: subprocess.Popen | None = None
        self.signals: list[int] = []
        self.passed_on = False

    def handle(self, signum, frame):
        self.signals.append(signum)
        self.pass_on()

    def pass_on(self):
        if self.signals and self.job is not None and not self.passed_on:
            self.passed_on = True
            self.job.send_signal(self.signals[0])


def gpu_count() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without it): no CUDA context here."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else 0


def claim_gpu(count: int, lock_dir: Path | None = None):
    """``(index, open lock file)`` of a GPU no other job of this user holds (an exclusive non-blocking ``flock`` on
    ``<lock_dir>/lowmembp-gpu-<uid>-<index>.lock``; the lock goes with the file's closing or the process's end), or
    ``(None, None)`` when all ``count`` are held."""
    import fcntl
    import tempfile

    where = Path(lock_dir or tempfile.gettempdir())
    for i in range(count):
        f = open(where / f"lowmembp-gpu-{os.getuid()}-{i}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        return i, f
    return None, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) of the job: >1 runs it under torchrun")
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    a.log.parent.mkdir(parents=True, exist_ok=True)
    cmd = job_command(a.python, train_args, a.out, a.nproc)
    env, held = None, None
    if a.nproc == 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        count = gpu_count()
        if count > 1:
            index, held = claim_gpu(count)
            if index is not None:
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(index))
    started = _now()
    stop = Stop()
    for sig in USER_SIGNALS:  # before the job starts: a signal that comes while it starts still reaches it
        signal.signal(sig, stop.handle)
    with open(a.log, "w") as log:
        log.write(("" if env is None else f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} ")
                  + "$ " + " ".join(cmd) + "\n")
        log.flush()
        # its own process group: a signal reaches the job once, from here (a terminal's Ctrl-C reaches this wrapper)
        stop.job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        stop.pass_on()
        rc = stop.job.wait()
    if held is not None:
        held.close()
    stopped = stop.signals
    if stopped:
        a.out.unlink(missing_ok=True)
        return 128 + stopped[0]
    if a.out.exists():
        return 0
    if rc < 0 and -rc in USER_SIGNALS:
        return rc and 1
    if rc == USAGE_ERROR:
        sys.stderr.write(f"the training job rejected its arguments; see {a.log}\n")
        return USAGE_ERROR
    tail = a.log.read_text(errors="replace").strip().splitlines()[-15:]
    why = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
    message = f"the training job died without a record ({why}): " + "\n".join(tail)
    write_error_record(a.out, train_args, message, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pass an interrupt of Snakemake on to the jobs it is running (installed by workflow/rules/sweep.smk).

Ctrl-C in a terminal sends SIGINT to every process of the terminal's foreground process group, so Snakemake and its
jobs stop together. A SIGINT to the Snakemake process alone (``kill -INT <pid>``, a supervisor, a CI runner, a
background run) reaches only Snakemake: its local executor then waits for the running jobs to *finish* (a training
cell: minutes to hours) and exits with their outputs still marked incomplete, so the next run throws that work away
and remakes them. :func:`install` replaces Python's SIGINT handler in the Snakemake process with
:func:`pass_on_interrupt`: it sends SIGINT to every descendant in Snakemake's own process group (the job shells,
``run_cell.py``, the scripts; ``run_cell.py`` passes it on to its training job, which runs in a group of its own),
then raises ``KeyboardInterrupt`` as the default handler does, and Snakemake's own shutdown follows. When the
SIGINT most likely came from the terminal (Snakemake's group is the terminal's foreground group) the jobs got it
already, and nothing is sent twice.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

import psutil  # a dependency of Snakemake itself


def interrupted_by_terminal() -> bool:
    """Whether this process's group is the foreground group of its controlling terminal (then a Ctrl-C there reached
    every process of the group, the jobs included)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal: the SIGINT was sent to this process
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def jobs_to_interrupt(root: psutil.Process | None = None) -> list[psutil.Process]:
    """The descendants of ``root`` (default: this process) in ``root``'s process group."""
    root = psutil.Process() if root is None else root
    group = os.getpgid(root.pid)
    found = []
    for child in root.children(recursive=True):
        with contextlib.suppress(OSError, psutil.Error):  # gone meanwhile
            if os.getpgid(child.pid) == group:
                found.append(child)
    return found


def pass_on_interrupt(signum, frame):
    """SIGINT handler: interrupt the jobs too (unless the terminal did), then stop as Python's default handler does."""
    if not interrupted_by_terminal():
        for job in jobs_to_interrupt():
            with contextlib.suppress(OSError, psutil.Error):
                job.send_signal(signal.SIGINT)
    raise KeyboardInterrupt


def install() -> bool:
    """Use :func:`pass_on_interrupt` for SIGINT in this process. Does nothing (returns False) outside the main thread
    or when SIGINT already has a handler other than Python's default one (an embedding program's)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, pass_on_interrupt):
        return False
    signal.signal(signal.SIGINT, pass_on_interrupt)
    return True

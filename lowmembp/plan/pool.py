"""The planner's rows in worker processes: how the workers start, in what order the rows go, which are dropped.

    rows, failed = run_rows(evaluate, singles, multis, jobs=2, preload=[...], start_method="fork", progress=bar)

Every row is submitted at once (no wait between the single methods and their combinations): the single methods
first, then the combinations, those of the most methods first (the longest rows early, so that the two workers end
together). A single method whose row fails drops every combination holding it: those not yet started are
cancelled, those already run are left out.

How the workers start (``start_method``):

- ``"forkserver"`` (the default where the platform has it): forked from a server process that has imported
  ``preload`` (the model's modules, peft), not from this one, which may have run autograd already: torch refuses
  autograd in a child forked after a backward pass ("Unable to handle autograd's threading in combination with
  fork-based multiprocessing"). The server's imports cost ~4-5 s before the first row.
- ``"fork"``: forked from this process after it has imported ``preload``; nothing is imported twice. Only for a
  process that has not run a backward pass: the command line (``python -m lowmembp.plan``) uses it.
- ``"spawn"``: fresh interpreters (where neither of the others exists).
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable

from lowmembp.plan import worker

__all__ = ["run_rows", "rows_of", "modules_needed", "START_METHODS"]

START_METHODS = ("forkserver", "fork", "spawn")


def run_rows(evaluate: Callable[[dict], dict | list[dict]], singles: list[dict], multis: list[dict], *, jobs: int,
             preload: list[str], start_method: str | None = None, progress=None) -> tuple[list[dict], dict]:
    """``(rows, failed)``: ``evaluate(job)`` of every single-method job and of every combination whose methods all
    succeeded alone (``failed``: method -> the reason its single row gave; baseline never fails a combination);
    ``progress(row)`` after each row run, ``progress.set_total(n)`` (when it has one) once combinations are dropped
    (those not yet run: the count of rows run ends equal to the total). A job may give several rows (a list: one
    combination's rows for several optimizers or weights, :func:`lowmembp.plan.evaluate_group`); its
    ``"variants"`` then say how many."""
    multis = sorted(multis, key=lambda j: -len(_parts(j)))
    failed: dict[str, str] = {}
    rows: list[dict] = []
    total = sum(map(rows_of, singles + multis))
    reported: set[int] = set()  # ids of the jobs whose rows progress() has seen

    def take(job: dict, row: dict) -> bool:
        """Keep ``row`` (of ``job``); True when it is a single method's first failure."""
        nonlocal total
        new_failure = False
        if "+" not in job["method"]:
            if row["status"] != "ok" and row["method"] != "baseline" and row["method"] not in failed:
                gone = [j for j in multis if job["method"] in _parts(j) and not _parts(j) & set(failed)
                        and id(j) not in reported]  # those already counted stay counted: they ran
                failed[row["method"]] = row["reason"]
                total -= sum(map(rows_of, gone))
                new_failure = True
                if hasattr(progress, "set_total"):
                    progress.set_total(total)
        elif _parts(job) & set(failed):
            return False
        rows.append(row)
        reported.add(id(job))
        if progress:
            progress(row)
        return new_failure

    def take_all(job: dict, out) -> bool:
        """Keep ``job``'s row or rows; True when one is a single method's first failure."""
        return any([take(job, row) for row in (out if isinstance(out, list) else [out])])

    with _pool(jobs, len(singles) + len(multis), preload, start_method) as pool:
        if pool is None:
            for job in singles + multis:
                if "+" in job["method"] and _parts(job) & set(failed):
                    continue
                take_all(job, evaluate(job))
        else:
            from concurrent.futures import as_completed
            futures = {pool.submit(evaluate, job): job for job in singles + multis}
            for fut in as_completed(futures):
                if fut.cancelled():
                    continue
                if take_all(futures[fut], fut.result()):
                    for f, j in futures.items():
                        if "+" in j["method"] and _parts(j) & set(failed):
                            f.cancel()
    # a combination that finished before one of its methods failed alone (on the other worker) goes too
    rows = [r for r in rows if not set(r["method"].split("+")) & set(failed)]
    return rows, failed


def rows_of(job: dict) -> int:
    """How many rows ``job`` gives: one, or one per (optimizer, weights) in its ``"variants"``."""
    return len(job.get("variants") or (None,))


def _parts(job: dict) -> set[str]:
    return set(job["method"].split("+"))


@contextlib.contextmanager
def _pool(jobs: int, n_tasks: int, preload: list[str], start_method: str | None):
    """Worker processes for the rows (None: plan in this process); see the module doc for ``start_method``."""
    import multiprocessing as mp

    available = mp.get_all_start_methods()
    if start_method is None:
        start_method = "forkserver" if "forkserver" in available else "spawn"
    if start_method not in START_METHODS or start_method not in available:
        raise ValueError(f"start_method must be one of {[m for m in START_METHODS if m in available]} on this "
                         f"platform, got {start_method!r}")
    if jobs <= 1 or n_tasks <= 1:
        yield None
        return
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(preload)
    elif start_method == "fork":
        for name in preload:
            importlib.import_module(name)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=worker.init) as ex:
        yield ex


def modules_needed(spec, overrides, combos: list[str]) -> list[str]:
    """What every worker would import: the planner, the model's own modules (transformers' LLaMA alone takes ~2.4 s)
    and peft when a combination uses it (~1.3 s); imported once, before the workers start."""
    from lowmembp.estimator.zoo import build
    from lowmembp.estimator.weights import FROZEN_BASE_METHODS

    try:
        model = build(spec, layers=2, overrides=overrides, device="meta")
    except ValueError:  # depth per stage (Swin): the whole model, still on the meta device
        model = build(spec, overrides=overrides, device="meta")
    own = sorted({type(m).__module__ for m in model.modules()} - {"__main__"})
    uses_peft = any(part in FROZEN_BASE_METHODS for c in combos for part in c.split("+"))
    return ["lowmembp.plan.worker", "lowmembp.plan.steps", "transformers", *own, *(["peft"] if uses_peft else [])]

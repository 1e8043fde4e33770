"""The planner: what fits my GPU? Every method combination for a model, batch, sequence length and GPU size.

    from lowmembp.plan import plan                     # also lowmembp.plan(...)
    p = plan("llama_7b", gpu_memory="24GiB", batch_size=4, seq_len=2048)
    print(p.table())                                   # ranked; p.rows (dicts), p.to_json(), p.to_csv(path)
    python -m lowmembp.plan --model llama_7b --gpu-memory 24GiB --batch-size 4 --seq-len 2048

Each row is one valid combination of the registry's methods (:mod:`lowmembp.plan.combos`), estimated on fake tensors
by :func:`lowmembp.estimate.estimate_by_depth` (2- and 3-block builds extended to the full depth; the full model when
its depth is per stage or too shallow):

- ``peak_bytes``: the step's exact tensor bytes at the requested batch (what ``estimate`` says for that
  combination); ``need_bytes`` adds the margin (:func:`lowmembp.plan.sources.margin`, its source stated); ``fits``:
  ``need_bytes`` within the GPU's memory.
- ``largest_batch``: found from the line through two estimates and checked directly — it fits and the next batch
  does not, both by the same estimate (:mod:`lowmembp.plan.search`).
- ``flops_ratio``: FLOPs of the step (forward, backward, recomputation; torch's formulas, :mod:`lowmembp.flops`)
  over the baseline's, counted on the same fake step; ``measured_ratio``: step time over the baseline's where the
  pipeline's records have that method (CPU today), with the runs it comes from.
"""
from __future__ import annotations

import inspect
import os
import time
import warnings
from dataclasses import dataclass, field

from lowmembp.estimate import ModelSpec, build, estimate, estimate_by_depth, full_depth
from lowmembp.methods.registry import parse
from lowmembp.plan.combos import combinations, key_of, option_grid
from lowmembp.plan.models import resolve_model
from lowmembp.plan.search import largest_batch
from lowmembp.plan.sources import GiB, margin as margin_of, measured_ratios, parse_bytes

__all__ = ["plan", "Plan", "evaluate"]

PEAK_SOURCE = ("fake-tensor step of lowmembp.estimate (exact tensor bytes: forward, backward, AdamW step with its "
               "state), {depth}")
FLOPS_SOURCE = ("torch.utils.flop_counter formulas summed over the same fake step (lowmembp.flops: matmuls, "
                "attention incl. recomputation; pointwise ops = 0)")
_STATIC = ("parameters", "gradients", "optimizer_state")


@dataclass
class Plan:
    """The answer: ``rows`` ranked (fits first, then by FLOP ratio), ``skipped`` methods, ``settings``, ``sources``."""
    settings: dict
    rows: list[dict]
    skipped: dict[str, str]
    sources: dict[str, str]
    elapsed_s: float = 0.0
    load: tuple = field(default_factory=tuple)

    def table(self) -> str:
        from lowmembp.plan.report import text_table
        return text_table(self)

    def to_json(self) -> str:
        from lowmembp.plan.report import to_json
        return to_json(self)

    def to_csv(self, path) -> None:
        from lowmembp.plan.report import write_csv
        write_csv(self, path)


def plan(model: str | ModelSpec, *, batch_size: int, gpu_memory: str | int = "24GiB", seq_len: int | None = None,
         dtype: str | None = None, world_size: int = 1, methods: list[str] | None = None,
         exclude: list[str] | None = None, max_methods: int | None = None,
         options: dict[str, dict[str, list]] | None = None, margin: float | None = None,
         reserved: int | str | None = None, margin_file=None, runs=None, jobs: int = 1,
         overrides: dict | None = None, num_classes: int | None = None, image_size: int | None = None,
         max_batch: int = 1 << 16, depth: str = "auto", combos: list[str] | None = None,
         more_gpus: list[str | int] | None = None, progress=None) -> Plan:
    """Plan every valid method combination (see the module doc). ``methods``/``exclude``/``max_methods`` narrow the
    combinations; ``options``: sweeps, ``{"tokentune": {"k": [16, 256]}}``; ``margin``/``reserved``: the allocator
    fraction and the fixed reserve (default: ``results/gpu/margin.json`` if present, else rules of thumb);
    ``runs``: the runs.csv with measured step times; ``jobs``: worker processes; ``overrides``: model config changes
    (small test models); ``depth``: ``"auto"`` (extend 2- and 3-block builds) or ``"full"`` (estimate the whole
    model: slow at paper scale); ``combos``: exactly these combinations instead of every valid one;
    ``more_gpus``: other GPU sizes, each row then also has ``largest_batch_by_gpu`` (the same estimates reused);
    ``progress``: called with each finished row."""
    t0 = time.perf_counter()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if depth not in ("auto", "full"):
        raise ValueError(f"depth must be 'auto' or 'full', got {depth!r}")
    extra = _world_size_kwargs(world_size)
    spec, where = resolve_model(model, seq_len=seq_len, num_classes=num_classes, image_size=image_size)
    dtype = dtype or spec.dtype
    budget = parse_bytes(gpu_memory)
    mg = margin_of(margin, reserved, margin_file=margin_file)
    capacity = (budget - mg["reserved_bytes"]) / (1 + mg["fraction"])
    extend, depth_note = _depth_mode(spec, overrides, depth)
    if combos is not None:
        skipped = {}
        combos = ["baseline"] + ["+".join(m.name for m in parse(c)) for c in combos if c != "baseline"]
    else:
        combos, skipped = combinations(methods, exclude, max_methods)
    more = {str(g): (parse_bytes(g) - mg["reserved_bytes"]) / (1 + mg["fraction"]) for g in more_gpus or []}
    common = dict(spec=spec, batch_size=batch_size, seq_len=spec.seq_len, dtype=dtype, overrides=overrides,
                  extend=extend, capacity=capacity, margin=mg, max_batch=max_batch, extra=extra, more=more)
    singles = [c for c in combos if "+" not in c]
    rows = _run([dict(common, method=c, options=o) for c in singles for o in option_grid(c, options)], jobs,
                progress)
    failed = {r["method"]: r["reason"] for r in rows if r["status"] != "ok" and r["method"] != "baseline"}
    skipped.update({m: f"its estimate fails: {why}" for m, why in failed.items()})
    rows = [r for r in rows if r["method"] not in failed]
    multi = [c for c in combos if "+" in c and not set(c.split("+")) & set(failed)]
    rows += _run([dict(common, method=c, options=o) for c in multi for o in option_grid(c, options)], jobs,
                 progress)
    measured, runs_file = measured_ratios(runs)
    _add_costs(rows, measured)
    rows.sort(key=_rank)
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    settings = {"model": spec.arch, "model_source": where, "family": spec.family, "batch_size": batch_size,
                "seq_len": spec.seq_len, "dtype": dtype, "gpu_memory_bytes": budget,
                "capacity_bytes": int(capacity), "world_size": world_size, "margin": mg, "combinations": len(rows),
                "jobs": jobs}
    sources = {"peak": PEAK_SOURCE.format(depth=depth_note), "margin": mg["source"], "flops": FLOPS_SOURCE,
               "measured": (f"step_time_p50 / baseline's, same task, model, batch size and device, from {runs_file}"
                            if runs_file else "no runs.csv found (run the pipeline, or pass runs=)"),
               "largest_batch": "line through two estimates, then checked: it fits and the next batch does not"}
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    return Plan(settings, rows, skipped, sources, time.perf_counter() - t0, load)


def evaluate(job: dict) -> dict:
    """One row: the estimates of one combination at the requested batch and around its largest batch."""
    t0 = time.perf_counter()
    method, opts, spec = job["method"], job["options"], job["spec"]
    row = {"method": method, "options": dict(opts), "label": _label(method, opts), "status": "ok", "reason": ""}
    est = estimate_by_depth if job["extend"] else estimate
    kw = dict(seq_len=job["seq_len"], dtype=job["dtype"], overrides=job["overrides"], **job["extra"], **opts)
    cap = job["capacity"]
    calls = [0]

    def peak_at(b: int, flops: bool = False) -> dict:
        calls[0] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return est(spec, method, batch_size=b, flops=flops, **kw)

    try:
        first = peak_at(job["batch_size"], flops=True)
        pk, cats = first["peak"]["bytes"], first["peak"]["by_category"]
        static = sum(cats.get(k, 0) for k in _STATIC)
        floor = cats.get("parameters", 0) + cats.get("optimizer_state", 0)
        known = {job["batch_size"]: pk}
        search = dict(known=known, floor=floor, max_batch=job["max_batch"],
                      first_slope=(pk - static) / job["batch_size"])
        best, how = largest_batch(lambda b: peak_at(b)["peak"]["bytes"], cap, **search)
        by_gpu = {g: largest_batch(lambda b: peak_at(b)["peak"]["bytes"], c, **search)[0]
                  for g, c in job.get("more", {}).items()}
    except Exception as e:  # a method that cannot run on this model / on fake tensors: say why, keep planning
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row.update(status="skipped", reason=f"{type(e).__name__}: {msg}"[:300], seconds=time.perf_counter() - t0)
        return row
    mg = job["margin"]
    row.update(peak_bytes=pk, need_bytes=int(pk * (1 + mg["fraction"]) + mg["reserved_bytes"]), fits=pk <= cap,
               static_bytes=static, largest_batch=best, largest_batch_how=how, largest_batch_by_gpu=by_gpu,
               flops=first["flops"],
               estimates=calls[0] * (2 if job["extend"] else 1), seconds=time.perf_counter() - t0)
    return row


def _run(jobs_: list[dict], jobs: int, progress=None) -> list[dict]:
    out = []
    if jobs <= 1 or len(jobs_) <= 1:
        results = (evaluate(j) for j in jobs_)
        for r in results:
            out.append(r)
            if progress:
                progress(r)
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker) as ex:
        for r in ex.map(evaluate, jobs_):
            out.append(r)
            if progress:
                progress(r)
    return out


def _init_worker() -> None:
    import torch
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def _world_size_kwargs(world_size: int) -> dict:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if "world_size" in inspect.signature(estimate).parameters:
        return {"world_size": world_size}
    if world_size > 1:
        raise ValueError("world_size > 1 needs lowmembp.estimate to shard the model (FSDP), which it does not do "
                         "yet; plan for one GPU (world_size=1)")
    return {}


def _depth_mode(spec: ModelSpec, overrides, depth: str) -> tuple[bool, str]:
    if depth == "full":
        return False, "the whole model estimated (depth='full')"
    try:
        blocks = full_depth(spec, overrides)
        build(spec, layers=2, overrides=overrides, device="meta")
    except ValueError as e:  # depth per stage (Swin)
        return False, f"the whole model estimated ({e})"
    if blocks <= 3:
        return False, f"the whole model estimated ({blocks} blocks)"
    return True, f"2- and 3-block builds extended to {blocks} blocks (estimate_by_depth)"


def _label(method: str, opts: dict) -> str:
    return method + "".join(f" {k}={v}" for k, v in sorted(opts.items()))


def _add_costs(rows: list[dict], measured: dict[str, list[dict]]) -> None:
    base = next((r for r in rows if r["method"] == "baseline" and r["status"] == "ok"), None)
    by_key = {key_of(m): v for m, v in measured.items()}
    for r in rows:
        if r["status"] != "ok":
            continue
        r["flops_ratio"] = r["flops"] / base["flops"] if base and base.get("flops") else None
        got = by_key.get(key_of(r["method"]), [])
        r["measured"] = got
        r["measured_ratio"] = sorted(g["ratio"] for g in got)[len(got) // 2] if got else None


def _rank(r: dict):
    if r["status"] != "ok":
        return (3, 0, 0, r["label"])
    cost = r["flops_ratio"] if r.get("flops_ratio") is not None else float("inf")
    if r["fits"]:
        return (0, cost, r["peak_bytes"], r["label"])
    if r["largest_batch"] > 0:
        return (1, -r["largest_batch"], cost, r["label"])
    return (2, r["peak_bytes"], 0, r["label"])


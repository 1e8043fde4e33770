"""The planner: what fits my GPU? Every method combination for a model, batch, sequence length and GPU size.

    from lowmembp.plan import make_plan                # also lowmembp.make_plan(...)
    p = make_plan("llama-7b", gpu_memory="24GiB", batch_size=4, seq_len=2048)
    print(p.table())                                   # ranked; p.rows (dicts), p.to_json(), p.to_csv(path)
    python -m lowmembp.plan --model llama-7b --gpu-memory 24GiB --batch-size 4 --seq-len 2048

Each row is one valid combination of the registry's methods (:mod:`lowmembp.plan.combos`), estimated on fake tensors
as :func:`lowmembp.estimator.step.estimate_by_depth` does, to the byte: its peak (``peak_bytes``), the peak with
the margin (``need_bytes``, :func:`lowmembp.plan.sources.margin`) and whether it ``fits``, the largest batch that
fits (``largest_batch``, checked by steps: it fits and the next does not), and its cost against the baseline
(``flops_ratio``; ``measured_ratio`` where the pipeline's records have one). What each field means and how the rows
are stepped (the batch line, shared steps): docs/planner.md, "What each column means" and "How a row is stepped".

May import every other room of lowmembp (it is the top of the library); never the experiments or the pipeline.
"""
from __future__ import annotations

import inspect
import os
import time
import warnings
from dataclasses import dataclass, field

from lowmembp._deprecation import make_module_callable
from lowmembp.estimator.step import estimate, full_depth
from lowmembp.estimator.zoo import ModelSpec, build
from lowmembp.estimator.weights import FROZEN_BASE_METHODS, WEIGHTS, auto_weights, frozen_base, storage_dtype
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER
from lowmembp.methods.registry import parse
from lowmembp.plan.breakdown import split_peak
from lowmembp.plan.combination import Peaks, StepSource
from lowmembp.plan.combos import (NOT_ESTIMATED, check_sweeps, combinations, default_max_methods, key_of,
                                  option_grid)
from lowmembp.plan.models import resolve_model
from lowmembp.plan.pool import modules_needed, rows_of, run_rows
from lowmembp.plan.progress import Bar
from lowmembp.plan.search import largest_batch, largest_fitting
from lowmembp.plan.sources import margin as margin_of, measured_ratios, parse_bytes

__all__ = ["make_plan", "Plan", "evaluate", "evaluate_group", "WEIGHT_CHOICES", "AUTO_WEIGHTS"]

FIND_CHOICES = ("batch", "seq-len")  # what a row searches for (make_plan's find=, --find)
AUTO_WEIGHTS = "auto"
WEIGHT_CHOICES = (AUTO_WEIGHTS,) + WEIGHTS  # what --weights takes (one, or several comma-separated)
AUTO_WORDS = ("auto: a LoRA-family base in the compute dtype, trained weights as fp32 masters "
              "(lowmembp.estimator.weights.auto_weights)")

PEAK_SOURCE = ("fake-tensor step of lowmembp.estimator.step (exact tensor bytes: forward, backward, the optimizer's "
               "step with its state as that optimizer holds it), {depth}")
FLOPS_SOURCE = ("torch.utils.flop_counter formulas summed over the same fake step "
                "(lowmembp.measurement.flops: matmuls, "
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

    def plot(self, path) -> None:
        """One stacked bar per row: where its peak is and what it holds (:mod:`lowmembp.plan.breakdown`)."""
        from lowmembp.plan.breakdown import plot_breakdown
        plot_breakdown(self, path)


def make_plan(model: str | ModelSpec, *, batch_size: int, gpu_memory: str | int = "24GiB", seq_len: int | None = None,
         dtype: str | None = None, world_size: int = 1, methods: list[str] | None = None,
         exclude: list[str] | None = None, max_methods: int | str | None = None,
         options: dict[str, dict[str, list]] | None = None, margin: float | None = None,
         reserved: int | str | None = None, margin_file=None, runs=None, jobs: int = 1,
         overrides: dict | None = None, num_classes: int | None = None, image_size: int | None = None,
         max_batch: int = 1 << 16, depth: str = "auto", combos: list[str] | None = None,
         more_gpus: list[str | int] | None = None, weights: str | list[str] = AUTO_WEIGHTS, progress=None,
         start_method: str | None = None, optimizer: str | list[str] = DEFAULT_OPTIMIZER,
         find: str | list[str] = "batch", max_seq_len: int = 1 << 20) -> Plan:
    """Plan every valid method combination (docs/planner.md). ``methods``/``exclude``/``max_methods`` choose the
    combinations: by default those of at most :data:`lowmembp.plan.combos.DEFAULT_MAX_METHODS` methods, without the
    variants of :func:`lowmembp.plan.combos.variants` (the parts of a composite, paper-figure variants); with
    ``methods`` every combination of those; ``max_methods``: at most that many methods (``"all"``: no limit);
    ``options``: sweeps, ``{"tokentune": {"k": [16, 256]}}``; ``margin``/``reserved``: the allocator
    fraction and the fixed reserve (default: ``results/gpu/margin.json`` if present, else rules of thumb);
    ``runs``: the runs.csv with measured step times; ``jobs``: worker processes; ``overrides``: model config changes
    (small test models); ``depth``: ``"auto"`` (extend 2- and 3-block builds) or ``"full"`` (estimate the whole
    model: slow at paper scale); ``combos``: exactly these combinations instead of every valid one;
    ``more_gpus``: other GPU sizes, each row then also has ``largest_batch_by_gpu`` (the same estimates reused);
    ``weights``: how the parameters are stored, one of :data:`WEIGHT_CHOICES` or a list of them (every combination
    planned with each; a row per pair): ``"auto"`` (default), each combination as people load it for that method
    (:func:`lowmembp.estimator.weights.auto_weights`: a LoRA-family base in the compute dtype, trained weights as
    fp32 masters under autocast); ``"fp32"``, ``"bf16"``/``"fp16"`` (the model loaded in that dtype), ``"nf4"``
    (QLoRA: only with LoRA-family methods; see :func:`lowmembp.estimator.step.estimate`);
    ``optimizer``: a name of :data:`lowmembp.methods.optimizers.OPTIMIZERS` (``"adamw"``, ``"adamw8bit"``,
    ``"adamw-fused-backward"``), or a list of them: every combination planned with each (a row per pair);
    ``progress``: called with each finished row, or ``"bar"``: a progress bar on stderr
    (:class:`lowmembp.plan.progress.Bar`, shown when stderr is a terminal);
    ``find``: what each row searches for, ``"batch"`` (the largest batch, always) and ``"seq-len"``: also the largest
    sequence length that fits at ``batch_size`` (text models; by steps at each length tried, checked as the batch:
    it fits and one token more does not; up to ``max_seq_len``, or the model's position table where it has one);
    ``start_method``: how the ``jobs`` worker processes start (:mod:`lowmembp.plan.pool`): None, a fork server (safe
    anywhere); ``"fork"``, ~4 s sooner, only in a process that has not run a backward pass (the command line)."""
    t0 = time.perf_counter()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if depth not in ("auto", "full"):
        raise ValueError(f"depth must be 'auto' or 'full', got {depth!r}")
    extra = _world_size_kwargs(world_size)
    spec, where = resolve_model(model, seq_len=seq_len, num_classes=num_classes, image_size=image_size)
    dtype = dtype or spec.dtype
    weights = _names(weights, WEIGHT_CHOICES, "weights", "the parameters' storage")
    finds = _names(find, FIND_CHOICES, "find", "search")
    if "seq-len" in finds and not spec.seq_len:
        raise ValueError(f"find='seq-len' needs a text model (tokens per sequence); {spec.arch} has no sequence length")
    optimizers = _optimizers(optimizer)
    budget = parse_bytes(gpu_memory)
    mg = margin_of(margin, reserved, margin_file=margin_file)
    capacity = (budget - mg["reserved_bytes"]) / (1 + mg["fraction"])
    for name, size in [(gpu_memory, budget)] + [(g, parse_bytes(g)) for g in more_gpus or []]:
        if size <= mg["reserved_bytes"]:
            raise ValueError(f"GPU memory {name} ({size / 2**20:.1f} MiB) is not larger than the reserve for the CUDA "
                             f"context and workspaces ({mg['reserved_bytes'] / 2**20:.1f} MiB): no tensor would fit. "
                             f"Give the GPU's real memory, or a smaller reserve (--reserved / reserved=).")
    shallow, blocks, depth_note = _depth_mode(spec, overrides, depth)
    limit = default_max_methods(methods, max_methods)
    if combos is not None:
        skipped, limit = {}, None
        combos = ["baseline"] + list(dict.fromkeys("+".join(m.name for m in parse(c)) for c in combos
                                                   if c != "baseline"))
        for c in combos:
            for name in c.split("+"):
                if name in NOT_ESTIMATED:
                    raise ValueError(f"combination {c!r}: {name} cannot be planned ({NOT_ESTIMATED[name]})")
    else:
        combos, skipped = combinations(methods, exclude, limit, default=True)
    check_sweeps(options, combos)
    more = {str(g): (parse_bytes(g) - mg["reserved_bytes"]) / (1 + mg["fraction"]) for g in more_gpus or []}
    common = dict(spec=spec, batch_size=batch_size, seq_len=spec.seq_len, dtype=dtype, overrides=overrides,
                  shallow=shallow, depth=blocks, capacity=capacity, weights=weights, margin=mg, max_batch=max_batch,
                  extra=extra, more=more, find_seq_len=max_seq_len if "seq-len" in finds else None)
    grids = {c: option_grid(c, options) for c in combos}
    pairs = _weighted(combos, weights, dtype, skipped)
    jobs_ = _grouped([dict(common, method=c, options=o, optimizer=z, weights=w) for z in optimizers
                      for c, w in pairs for o in grids[c]])
    singles = [j for j in jobs_ if "+" not in j["method"]]
    multis = [j for j in jobs_ if "+" in j["method"]]
    bar = Bar(sum(map(rows_of, jobs_))) if progress == "bar" else None
    try:
        rows, failed = run_rows(evaluate_group, singles, multis, jobs=jobs, start_method=start_method,
                                preload=modules_needed(spec, overrides, combos), progress=bar or progress)
    finally:
        if bar is not None:
            bar.close()
    skipped.update({m: f"its estimate fails: {why}" for m, why in failed.items()})
    measured, runs_file = measured_ratios(runs)
    _add_costs(rows, measured)
    rows.sort(key=_rank)
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    settings = {"model": spec.arch, "model_source": where, "family": spec.family, "batch_size": batch_size,
                "seq_len": spec.seq_len, "dtype": dtype, "weights": weights,
                "weights_source": AUTO_WORDS if AUTO_WEIGHTS in weights else "given", "optimizer": optimizers,
                "find": finds,
                "gpu_memory_bytes": budget,
                "capacity_bytes": int(capacity), "world_size": world_size, "margin": mg, "combinations": len(rows),
                "max_methods": limit,
                "jobs": jobs}
    sources = {"peak": PEAK_SOURCE.format(depth=depth_note), "margin": mg["source"], "flops": FLOPS_SOURCE,
               "measured": (f"step_time_p50 / baseline's, same task, model, batch size and device, from {runs_file}"
                            if runs_file else "no runs.csv found (run the pipeline, or pass runs=)"),
               "largest_batch": ("the batch line through two steps (or a search by steps where the op sequence "
                                 "changes with the batch), then checked by steps: it fits and the next batch does not")}
    if "seq-len" in finds:
        sources["largest_seq_len"] = ("a search by steps at the requested batch (lowmembp.plan.search."
                                      "largest_fitting), checked: it fits and one token more does not")
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    return Plan(settings, rows, skipped, sources, time.perf_counter() - t0, load)


def _grouped(jobs: list[dict]) -> list[dict]:
    """``jobs`` (one per row) with the rows that step the same model made one job: the same combination and
    options, weights stored alike, any optimizer (``"variants"``: each row's ``(optimizer, weights)``, in order).
    A job of one row is left as it is."""
    groups: dict[tuple, list[dict]] = {}
    for j in jobs:
        key = (j["method"], tuple(sorted(j["options"].items())), storage_dtype(j["weights"]))
        groups.setdefault(key, []).append(j)
    return [g[0] if len(g) == 1 else dict(g[0], variants=[(j["optimizer"], j["weights"]) for j in g])
            for g in groups.values()]


def evaluate_group(job: dict) -> dict | list[dict]:
    """:func:`evaluate` of a job, or, for a job of several ``"variants"`` (:func:`_grouped`), the list of their rows,
    their fake steps shared (:class:`lowmembp.plan.combination.StepSource`)."""
    variants = job.get("variants")
    if not variants:
        return evaluate(job)
    stored = next((w for _, w in variants if w != "nf4"), variants[0][1])
    source = StepSource(job["spec"], job["method"], layers=job["shallow"] or (None,), seq_len=job["seq_len"],
                        dtype=job["dtype"], optimizers=[z for z, _ in variants], weights=stored,
                        overrides=job["overrides"], **job["extra"], **job["options"])
    return [evaluate(dict(job, optimizer=z, weights=w), source=source) for z, w in variants]


def evaluate(job: dict, source: StepSource | None = None) -> dict:
    """One row: one combination's peak at the requested batch, its largest batch, its FLOPs (docs/planner.md).
    ``source``: fake steps shared with other rows of the same combination (:func:`evaluate_group`)."""
    t0, c0 = time.perf_counter(), time.process_time()
    method, opts, spec = job["method"], job["options"], job["spec"]
    optimizer, weights = job.get("optimizer", DEFAULT_OPTIMIZER), job.get("weights", "fp32")
    row = {"method": method, "options": dict(opts), "optimizer": optimizer, "weights": weights,
           "label": _label(method, opts, optimizer), "status": "ok", "reason": ""}
    cap, bs = job["capacity"], job["batch_size"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peaks = Peaks(spec, method, shallow=job["shallow"], depth=job["depth"], seq_len=job["seq_len"],
                          dtype=job["dtype"], overrides=job["overrides"], weights=weights,
                          optimizer=optimizer, source=source, **job["extra"], **opts)
            first = peaks.direct(bs, flops=True)
            pk, cats = first["peak"]["bytes"], first["peak"]["by_category"]
            static = sum(cats.get(k, 0) for k in _STATIC)
            floor = cats.get("parameters", 0) + cats.get("optimizer_state", 0)
            caps = {None: cap, **job.get("more", {})}
            lined = any(c >= floor for c in caps.values()) and peaks.fit_line(bs)
            best, how, by_gpu = _largest(peaks, caps, bs, pk, floor, static, job["max_batch"])
            if job.get("find_seq_len"):
                top = min(job["find_seq_len"], _position_table(peaks) or job["find_seq_len"])
                row["largest_seq_len"], row["largest_seq_len_how"] = largest_fitting(
                    lambda n: peaks.at_seq_len(bs, n)["bytes"], cap, known={job["seq_len"]: pk}, floor=floor,
                    max_value=top, first_slope=(pk - static) / job["seq_len"], unit="sequence length")
    except Exception as e:  # a method that cannot run on this model / on fake tensors: say why, keep planning
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row.update(status="skipped", reason=f"{type(e).__name__}: {msg}"[:300], seconds=time.perf_counter() - t0)
        return row
    mg = job["margin"]
    row.update(peak_bytes=pk, need_bytes=int(pk * (1 + mg["fraction"]) + mg["reserved_bytes"]), fits=pk <= cap,
               peak_phase=first["peak"].get("phase"), peak_breakdown=split_peak(first["peak"]),
               peak_breakdown_how="proportional" if first["peak"].get("split_from") else "measured",
               static_bytes=static, floor_bytes=floor, largest_batch=best, largest_batch_how=how,
               largest_batch_by_gpu=by_gpu,
               flops=first["flops"], batch_line=bool(lined and peaks.lines is not None),
               estimates=peaks.steps_run, seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)
    return row


def _largest(peaks: Peaks, caps: dict, bs: int, pk: int, floor: int, static: int, max_batch: int):
    """``(largest batch, how, {gpu: largest batch})`` for the capacities ``caps`` (key None: the requested GPU).

    With a batch line every batch's peak is known without a step; each answer ``B`` is then checked by steps at
    ``B`` and ``B + 1`` (batch 1 when ``B`` is 0): they must agree with the line, ``B`` fit and ``B + 1`` not. If
    any disagrees (an op sequence that changes with the batch only away from the two batches the line was fitted
    on), the line is dropped and every answer is searched with steps."""
    for attempt in ("line", "steps"):
        if attempt == "steps":
            peaks.drop_line()
        lined = peaks.lines is not None
        known = {b: peaks.direct(b)["peak"]["bytes"] for b in peaks.runs}
        search = dict(floor=floor, max_batch=max_batch, first_slope=(pk - static) / bs,
                      max_estimates=10 ** 6 if lined else 24)
        answers = {g: largest_batch(lambda b: peaks.at(b)["bytes"], c, known=dict(known), **search)
                   for g, c in caps.items()}
        if not lined or all(_checked(peaks, b, caps[g], floor, max_batch) for g, (b, _) in answers.items()):
            break
    best, how = answers.pop(None)
    return best, how, {g: a[0] for g, a in answers.items()}


def _checked(peaks: Peaks, best: int, cap: float, floor: int, max_batch: int) -> bool:
    """Steps at ``best`` and ``best + 1`` agree with the line, ``best`` fits and ``best + 1`` does not."""
    if floor > cap or best >= max_batch:
        return True
    checked = {b: peaks.direct(b)["peak"]["bytes"] for b in ((best, best + 1) if best else (1,))}
    line = {b: peaks.from_line(b) for b in checked}
    return ((best == 0 or checked[best] <= cap) and checked[best + 1] > cap
            and all(line[b] is None or line[b]["bytes"] == v for b, v in checked.items()))


def _position_table(peaks: Peaks) -> int | None:
    """The longest sequence a text model's absolute position embeddings allow (BERT 512, RoBERTa 514 less its
    padding offset), None for rotary (LLaMA) or no config."""
    model = peaks.model
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "position_embedding_type", None) != "absolute":
        return None
    offset = (cfg.pad_token_id + 1) if getattr(cfg, "model_type", "") == "roberta" else 0
    return int(cfg.max_position_embeddings) - offset


def _world_size_kwargs(world_size: int) -> dict:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if "world_size" in inspect.signature(estimate).parameters:
        return {"world_size": world_size}
    if world_size > 1:
        raise ValueError("world_size > 1 needs lowmembp.estimator.step to shard the model (FSDP), which it does not do "
                         "yet; plan for one GPU (world_size=1)")
    return {}


def _depth_mode(spec: ModelSpec, overrides, depth: str) -> tuple[tuple[int, int] | None, int | None, str]:
    """``(shallow depths or None, full depth, words)``: extend 2- and 3-block builds, or step the whole model."""
    if depth == "full":
        return None, None, "the whole model estimated (depth='full')"
    try:
        blocks = full_depth(spec, overrides)
        build(spec, layers=2, overrides=overrides, device="meta")
    except ValueError as e:  # depth per stage (Swin)
        return None, None, f"the whole model estimated ({e})"
    if blocks <= 3:
        return None, None, f"the whole model estimated ({blocks} blocks)"
    return (2, 3), blocks, f"2- and 3-block builds extended to {blocks} blocks (as estimate_by_depth)"


def _label(method: str, opts: dict, optimizer: str = DEFAULT_OPTIMIZER) -> str:
    return (method + "".join(f" {k}={v}" for k, v in sorted(opts.items()))
            + ("" if optimizer == DEFAULT_OPTIMIZER else f" [{optimizer}]"))


def _optimizers(optimizer) -> list[str]:
    """The optimizers to plan with, as a list of known names (one name or several); ValueError otherwise."""
    from lowmembp.methods.optimizers import OPTIMIZERS, check_optimizer

    names = ([n.strip() for n in optimizer.split(",") if n.strip()] if isinstance(optimizer, str)
             else [str(n) for n in optimizer or []])
    # GaLore / APOLLO options written into a name ("galore-adamw@rank=64;update_proj_gap=500" on the command line,
    # where "," separates optimizers: ";" separates the options there)
    names = [n.replace(";", ",") for n in names]
    for n in names:
        if "@" in n:
            try:
                check_optimizer(n)
            except ValueError as err:
                raise ValueError(f"optimizer: {err}") from None
    return _names(names, list(OPTIMIZERS) + [n for n in names if "@" in n], "optimizer", "optimizer")


def _names(given, choices, what: str, noun: str) -> list[str]:
    """``given`` (a name, "a,b", or a list) as a list of names of ``choices``, each once; ValueError otherwise."""
    names = ([n.strip() for n in given.split(",") if n.strip()] if isinstance(given, str)
             else [str(n) for n in given or []])
    if not names:
        raise ValueError(f"{what}: give one or more of {', '.join(choices)}")
    bad = [n for n in names if n not in choices]
    if bad:
        raise ValueError(f"unknown {noun}(s) {', '.join(map(repr, bad))} for {what}; choose from {', '.join(choices)}")
    return list(dict.fromkeys(names))


def _weighted(combos: list[str], weights: list[str], dtype: str, skipped: dict) -> list[tuple[str, str]]:
    """``(combination, weights)`` to plan: each asked-for weights per combination ("auto" resolved), each pair once;
    NF4 only with a frozen base (QLoRA), the others noted in ``skipped``."""
    pairs, left = [], 0
    for c in combos:
        for w in weights:
            w = auto_weights(c, dtype) if w == AUTO_WEIGHTS else w
            if w == "nf4" and not frozen_base(c):
                left += 1
            elif (c, w) not in pairs:
                pairs.append((c, w))
    if left:
        skipped["nf4 weights"] = (f"NF4 is QLoRA's frozen base: planned only with {', '.join(FROZEN_BASE_METHODS)} "
                                  f"({left} combinations without one left out at nf4)")
    return pairs


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



def plan(*args, **kwargs) -> Plan:
    """Deprecated name of :func:`make_plan` (removed in the next release)."""
    warnings.warn("lowmembp.plan.plan(...) is deprecated and will be removed in the next release; use "
                  "lowmembp.make_plan(...)", DeprecationWarning, stacklevel=2)
    return make_plan(*args, **kwargs)


make_module_callable(__name__, "lowmembp.make_plan", lambda: make_plan)

"""torch.compile's ``activation_memory_budget`` below 1 against LowMemoryBP: saved-for-backward bytes and CPU step
time of baseline, lowmembp and lora+lowmembp on small ViT / BERT / LLaMA, at each budget, beside eager.

    df = compiled_budget()                    # python -m experiments.repro compiled-budget  (~8 CPU-min; budgets 1 … 0)
    df = compiled_budget(small=True)          # 1 block, L = 16, budgets 1 and 0.1, 2 timed steps
    compiled_budget(budgets=(1.0, 0.5, 0.1), families=("bert",), timing_backend="inductor")

The models are :func:`experiments.repro.compiled_saving.build`'s (random weights, fp32, batch 2, 2 blocks of width 64,
L = 64). One row per (family, method) eager, and one per (family, method, budget) compiled:

- ``saved_KiB``: eager, :class:`lowmembp.measurement.saved.SavedTensorAccountant`; compiled, the sum of
  :func:`experiments.repro.partitioner_saved.partitioner_saved`'s rows at that ``memory_budget`` (what the min-cut
  partitioner of inductor, ``aot_eager_decomp_partition`` semantics, saves per tensor; parameters left out, as the
  accountant leaves them out).
- ``saving_%``: 1 − saved bytes / the family's *eager baseline* bytes (one yardstick for every row, so a compiled
  baseline at a budget < 1 and an eager lowmembp read against each other directly).
- ``step_ms``: median wall time of ``steps`` forward + backward passes (gradients set to None before each, one
  untimed warm-up) on the CPU, the eager model or the compiled one as partitioned above (no code generation: a
  recomputed op runs as its own ATen kernel; ``timing_backend="inductor"`` times a model compiled by the ``compile``
  method at the same budget with inductor instead). Each model's steps alternate with the eager baseline's
  (``baseline_step_ms``, the same window), and ``step_vs_eager`` = ``step_ms`` / ``baseline_step_ms``, so a change
  of the shared CPU's load moves both. Times are indicative, bytes exact.
- ``timed_KiB``: the accountant's count of the timed model after its steps: equal to ``saved_KiB`` (ViT: + 64 B,
  its loss runs outside the compiled model) unless ``timing_backend`` is given (inductor's own passes can move a
  few tensors). A step that recompiles (BERT's first call sets ``config.problem_type``, a guard) partitions under
  the same budget: the timing runs with it in force.

The budget is relative to each graph's own budget-1 cut: torch (``choose_saved_values_set``) keeps the saved bytes
at about ``budget`` of the way from "save only the graph's inputs" (0) to its default min-cut choice (1), so a
lowmembp graph at budget b is held to b of its own, smaller, budget-1 bytes.
"""
from __future__ import annotations

import statistics

import pandas as pd
import torch

from experiments.repro.compiled_saving import FAMILIES, KiB, WIDTH, build, convert

METHODS = ("baseline", "lowmembp", "lora+lowmembp")
BUDGETS = (1.0, 0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0)
FAST_BACKEND = "aot_eager_decomp_partition"


def _step_ms(model, forward, ref, steps: int, budget: float | None = None) -> tuple[float, float]:
    """Median ms of ``steps`` forward + backward passes of ``model`` and of the eager reference ``ref = (model,
    forward)``, their steps alternating (the CPU's load changes both alike), after one untimed warm-up of each.
    ``budget``: the activation memory budget in force meanwhile, so that a recompile (BERT: its first call sets
    ``config.problem_type``, a guard of the graph) partitions at the budget measured."""
    from lowmembp._compat import functorch_config

    from lowmembp.measurement.timing import time_interleaved

    def step(m, f):
        def run(_round):
            m.zero_grad(set_to_none=True)
            f(m).backward()
        return run

    patch = {} if budget is None else {"activation_memory_budget": budget}
    with functorch_config().patch(**patch):
        times = time_interleaved({"model": step(model, forward), "ref": step(*ref)}, rounds=steps)
    for m in (model, ref[0]):
        m.zero_grad(set_to_none=True)
    return 1e3 * statistics.median(times["model"]), 1e3 * statistics.median(times["ref"])


def _count(model, forward, budget: float | None = None) -> int:
    from lowmembp.measurement.saved import saved_bytes
    from lowmembp._compat import functorch_config

    torch.manual_seed(0)
    with functorch_config().patch(**({} if budget is None else {"activation_memory_budget": budget})):
        nbytes = saved_bytes(model, lambda: forward(model))["total"]
    model.zero_grad(set_to_none=True)
    return nbytes


def eager_model(family: str, method: str, seq_len: int, batch: int, depth: int):
    """``(model, forward, saved bytes)`` of the eager converted model (the accountant's count)."""
    model, forward = build(family, seq_len, batch, depth)
    model = convert(model, method)
    return model, forward, _count(model, forward)


def measure_compiled(family: str, method: str, budget: float, seq_len: int, batch: int, depth: int, steps: int,
                     ref, timing_backend: str | None = None) -> dict:
    """``{"bytes", "rows", "step_ms", "ref_ms", "timed_bytes"}`` of ``method`` compiled at ``budget``: bytes and
    rows from :func:`partitioner_saved`; step time (beside the eager reference ``ref``, see :func:`_step_ms`) on that
    model, or (``timing_backend``) on a model compiled by the ``compile`` method with that backend at the same
    budget; ``timed_bytes``: the accountant's count of the timed model after its steps (equal to ``bytes`` without
    ``timing_backend``, up to what runs outside the compiled model: ViT's loss)."""
    from lowmembp._compat import reset_compiler
    from experiments.repro.partitioner_saved import partitioner_saved

    model, forward = build(family, seq_len, batch, depth)
    model = convert(model, method)
    torch.manual_seed(0)
    rows = partitioner_saved(model, lambda: forward(model), memory_budget=budget)
    out = {"bytes": sum(r["bytes"] for r in rows), "rows": rows}
    if timing_backend is not None:
        reset_compiler()
        model, forward = build(family, seq_len, batch, depth)
        model = convert(model, "compile" if method == "baseline" else f"{method}+compile", memory_budget=budget,
                        compile_backend=timing_backend)
        forward(model).backward()  # compiles both graphs, outside the count and the clock
        model.zero_grad(set_to_none=True)
    out["step_ms"], out["ref_ms"] = _step_ms(model, forward, ref, steps, budget)
    out["timed_bytes"] = _count(model, forward, budget)  # after the steps: none ran a graph of another budget
    return out


def compiled_budget(small: bool = False, budgets: tuple[float, ...] | None = None,
                    methods: tuple[str, ...] = METHODS, families: tuple[str, ...] = FAMILIES,
                    seq_len: int | None = None, batch: int = 2, depth: int | None = None, steps: int | None = None,
                    timing_backend: str | None = None) -> pd.DataFrame:
    """The table of the module doc. ``small``: 1 block at L = 16, budgets (1, 0.1), 2 timed steps."""
    budgets = tuple(float(b) for b in (budgets or ((1.0, 0.1) if small else BUDGETS)))
    bad = [b for b in budgets if not 0.0 <= b <= 1.0]
    if bad:
        raise ValueError(f"compiled_budget: every budget must be in [0, 1] (torch's activation_memory_budget), "
                         f"got {bad}")
    seq_len = seq_len or (16 if small else 64)
    depth = depth or (1 if small else 2)
    steps = steps or (2 if small else 20)
    methods = ("baseline",) + tuple(m for m in methods if m != "baseline")
    rows = []
    for family in families:
        eager = {m: eager_model(family, m, seq_len, batch, depth) for m in methods}
        ref = eager["baseline"][:2]
        base_bytes = eager["baseline"][2]

        def row(method, mode, budget, nbytes, step_ms, ref_ms, timed_bytes, note=""):
            return {"family": family, "method": method, "mode": mode, "memory_budget": budget,
                    "saved_KiB": nbytes / KiB, "saving_%": 100 * (1 - nbytes / base_bytes),
                    "step_ms": step_ms, "baseline_step_ms": ref_ms, "step_vs_eager": step_ms / ref_ms,
                    "timed_KiB": timed_bytes / KiB, "note": note}

        for m, (model, forward, nbytes) in eager.items():
            ms, ref_ms = _step_ms(model, forward, ref, steps)
            rows.append(row(m, "eager", None, nbytes, ms, ref_ms, nbytes))
        for method in methods:
            for budget in budgets:
                c = measure_compiled(family, method, budget, seq_len, batch, depth, steps, ref, timing_backend)
                rows.append(row(method, "compiled", budget, c["bytes"], c["step_ms"], c["ref_ms"], c["timed_bytes"],
                                _note(method, c["bytes"], eager["lowmembp"][2] if "lowmembp" in eager else None)))
    df = pd.DataFrame(rows)
    timed = (f"compiled by the compile method with {timing_backend}" if timing_backend else
             f"as partitioned ({FAST_BACKEND}, no code generation)")
    df.attrs["caption"] = (f"saved for backward, KiB (compiled: inductor's min-cut partitioner at each "
                           f"activation_memory_budget, per-tensor count); fp32, batch {batch}, L = {seq_len}, {depth} "
                           f"block(s) of width {WIDTH}; saving: against the eager baseline; step: median of {steps} "
                           f"CPU forward + backward passes, {timed}, / the eager baseline's, timed alternately "
                           f"with it (baseline_step_ms).")
    return df


def _note(method: str, nbytes: int, lowmembp_eager: int | None) -> str:
    """For a compiled baseline: where it saves as little as eager lowmembp (the question this table answers)."""
    if method != "baseline" or lowmembp_eager is None:
        return ""
    return f"at or below eager lowmembp's {lowmembp_eager / KiB:.0f} KiB" if nbytes <= lowmembp_eager else ""

"""The stacked table (``python -m experiments.repro stacked``) and the Pareto figure (workflow/scripts/plots_pareto.py):
every row a valid composition adding one lever (or putting one in place of another); its categories and peak are
estimates (reproduced by direct calls, QLoRA's NF4 bytes counted independently); the small-width measurement on the
CPU allocator agrees with the estimate; the Pareto front is the non-dominated set; the figures are drawn."""
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.repro import REPROS, run
from script_loader import load_script
from experiments.repro.stacked import (BATCH, CONTEXT, GiB, MODEL, OPTIONS, QLORA, RATIO, ROWS, SMALL_LAYERS,
                                       SMALL_WIDTH, WEIGHTS)

ROOT = Path(__file__).resolve().parents[2]
CATS = ["weights_GiB", "gradients_GiB", "optimizer_GiB", "activations_GiB", "temporaries_GiB"]


def _levers(spec: str, optimizer: str) -> set[str]:
    """A row's levers: each method (and each option written into it), AdamW and its variant's lever."""
    from lowmembp.methods.registry import spec_parts

    variant = {"adamw": "adamw", "adamw8bit": "8-bit states", "adamw-fused-backward": "step in backward"}
    out = {"adamw", variant[optimizer]}
    for name, opts in spec_parts(spec):
        if name != "baseline":
            out |= {name} | {f"{name}@{k}={v}" for k, v in opts.items()}
    return out


def test_every_row_is_a_valid_composition_one_lever_from_the_row_before():
    from lowmembp.methods.optimizers import OPTIMIZERS
    from lowmembp.methods.registry import parse

    assert "stacked" in REPROS and ROWS[0][1:] == ("baseline", "adamw")
    for (_, prev_spec, prev_opt), (label, spec, opt) in zip(ROWS, ROWS[1:]):
        parse(spec)  # raises for an exclusion (offload with tokentune, ...)
        assert opt in OPTIMIZERS
        before, after = _levers(prev_spec, prev_opt), _levers(spec, opt)
        added, removed = after - before, before - after
        assert len(added) == 1, (label, added)
        if label.startswith("+ "):
            assert not removed, (label, removed)
        else:
            assert " in place of " in label and len(removed) <= 1, (label, removed)


def _nf4_delta(overrides: dict) -> int:
    """bf16 bytes minus NF4 bytes (double quantisation) of every linear inside the blocks, counted here."""
    import torch.nn as nn

    from lowmembp.estimator.step import block_names, build, model_spec, nf4_weight_bytes

    model = build(model_spec(MODEL), layers=SMALL_LAYERS, overrides=overrides, device="meta")
    lins = [m for b in block_names(model) for m in model.get_submodule(b).modules() if isinstance(m, nn.Linear)]
    assert len(lins) == 7 * SMALL_LAYERS
    return sum(2 * m.weight.numel() - nf4_weight_bytes(m.weight.numel(), double_quant=True) for m in lins)


PICKED = ("full fine-tuning, AdamW", "8-bit AdamW in place of the fused step", "+ NF4 base (QLoRA)")


@pytest.fixture(scope="module")
def small_table():  # three rows at the small width, 256 tokens: estimates and CPU measurements (~1-2 min shared)
    return run("stacked", small=True, rows=PICKED)


@pytest.mark.slow
def test_rows_are_estimates_and_the_cpu_allocator_agrees(small_table):
    from lowmembp.estimator.step import estimate

    df = small_table.set_index("lever")
    assert list(df.index) == list(PICKED)
    assert len(small_table.columns) <= 11
    overrides = dict(CONTEXT, **SMALL_WIDTH)
    for lever, spec, opt in ROWS:
        if lever not in PICKED:
            continue
        row = df.loc[lever]
        assert row["method"] == f"{spec}, {opt}"
        plain = spec.replace(QLORA, "")
        opts = {k: v for k, v in OPTIONS.items() if k in ("rank", "alpha")} if "lora" in spec else {}
        est = estimate(MODEL, plain, layers=SMALL_LAYERS, batch_size=BATCH, seq_len=256, overrides=overrides,
                       weights=WEIGHTS, optimizer=opt, **opts)["peak"]
        cats = dict(est["by_category"])
        delta = _nf4_delta(overrides) if QLORA in spec else 0
        assert delta > 0 or QLORA not in spec
        expect = {"weights_GiB": cats["parameters"] - delta, "gradients_GiB": cats["gradients"],
                  "optimizer_GiB": cats["optimizer_state"], "activations_GiB": cats["activations"],
                  "temporaries_GiB": cats["temporaries"] + cats["other"]}
        for col, value in expect.items():
            assert math.isclose(row[col], value / GiB, rel_tol=1e-12, abs_tol=1e-15), (lever, col)
        assert math.isclose(row["peak_GiB"], (est["bytes"] - delta) / GiB, rel_tol=1e-12)
        assert math.isclose(row[CATS].sum(), row["peak_GiB"], rel_tol=1e-9)  # the categories split the peak
        # the CPU allocator's own count of the same step on real tensors (NF4 from bitsandbytes) within 5 %
        assert abs(row[RATIO] - 1) < 0.05, (lever, row[RATIO])
    # what 8-bit AdamW promises: about half of AdamW's two bf16 states (1 + 1 bytes an element and an absmax per
    # 256, against 2 + 2). (At this width LoRA r 64's fp32 adapters weigh as much as the base: no LoRA promise here.)
    full, eight = df.loc[PICKED[0]], df.loc[PICKED[1]]
    assert eight["optimizer_GiB"] < 0.6 * full["optimizer_GiB"]
    peaks = small_table["peak_GiB"].tolist()
    changes = small_table["change_%"].tolist()[1:]
    assert all(math.isclose(c, 100 * (b / a - 1)) for a, b, c in zip(peaks, peaks[1:], changes))


@pytest.mark.slow
def test_stacked_figure_from_the_table(small_table, tmp_path):
    sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
    import plots_repro

    fig = plots_repro.figure("stacked", small_table)
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title, ax.xaxis.label]
                     + ax.get_yticklabels() + (ax.get_legend().get_texts() if ax.get_legend() else []))
    assert "GiB" in texts and "activations" in texts and PICKED[1] in texts


def _pareto_module():
    return load_script("workflow/scripts/plots_pareto.py")


def test_pareto_front_and_figure(tmp_path):
    MiB = 2 ** 20
    mod = _pareto_module()
    rows = []
    for method, peak, time, host in [("a", 10, 1.0, None), ("b", 5, 2.0, None), ("c", 12, 3.0, None),
                                      ("d", 5, 2.5, None), ("e", 2, 4.0, 8.0)]:
        rows.append(dict(task="t", model="m", method=method, batch_size=8, seed=0, status="ok",
                         peak_bytes=peak * MiB, step_time_p50=time, host_peak_bytes=host and host * MiB))
    rows.append(dict(task="t", model="m", method="a", batch_size=32, seed=0, status="ok", peak_bytes=1,
                     step_time_p50=1.0, host_peak_bytes=None))  # another batch size: not in the same run
    rows.append(dict(task="t", model="m", method="f", batch_size=8, seed=0, status="oom", peak_bytes=None,
                     step_time_p50=None, host_peak_bytes=None))
    runs = pd.DataFrame(rows)
    pts = mod.points(runs)
    assert set(pts["method"]) == {"a", "b", "c", "d", "e"} and set(pts["batch_size"]) == {8}
    assert list(mod.pareto_front(pts)["method"]) == ["a", "b", "e"]  # c and d are beaten on both
    csv = tmp_path / "runs.csv"
    runs.to_csv(csv, index=False)
    mod.main(csv, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 10_000

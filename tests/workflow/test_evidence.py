"""The convergence evidence (workflow/scripts/evidence_table.py, evidence_plots.py, workflow/rules/evidence.smk): the
paired t interval against a hand computation and scipy, the verdicts on constructed intervals, the pairing of each
method with its compared method on synthetic rows (a test input, not a result), and the whole path through Snakemake
on config/evidence-tiny.yaml (records with curves -> table, figure, reference copy) in the pipeline tier."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
sys.path.insert(0, str(ROOT / "workflow"))

import evidence_table as ev  # noqa: E402

T_975_4 = 2.7764451052  # t quantile 0.975 with 4 degrees of freedom (any t table)


def test_paired_interval_by_hand_and_by_scipy():
    d = [1.0, 2.0, 3.0, 0.5, 1.5]
    # mean 1.6; squared deviations .36 + .16 + 1.96 + 1.21 + .01 = 3.7; sd = sqrt(3.7 / 4)
    sd = math.sqrt(3.7 / 4)
    half = T_975_4 * sd / math.sqrt(5)
    mean, got_sd, low, high, n = ev.t_interval(d)
    assert n == 5 and mean == pytest.approx(1.6) and got_sd == pytest.approx(sd)
    assert (low, high) == (pytest.approx(1.6 - half, abs=1e-9), pytest.approx(1.6 + half, abs=1e-9))
    # the same interval as scipy's paired t test of two samples whose differences are d
    compared = np.array([10.0, 11.0, 9.0, 12.0, 10.5])
    ci = stats.ttest_rel(compared + np.array(d), compared).confidence_interval(0.95)
    assert (low, high) == (pytest.approx(ci.low), pytest.approx(ci.high))


def test_interval_of_too_few_values_and_of_no_spread():
    assert ev.t_interval([2.0])[:1] == (2.0,) and all(math.isnan(v) for v in ev.t_interval([2.0])[1:4])
    assert ev.t_interval([math.nan, 1.0])[4] == 1
    assert ev.t_interval([0.0, 0.0, 0.0])[1:4] == (0.0, 0.0, 0.0)  # an exact method: the interval is the point 0


@pytest.mark.parametrize("low, high, higher_is_better, expected", [
    (-0.5, 0.8, True, "equivalent"),   # inside ±1
    (-0.9, -0.2, True, "equivalent"),  # a loss is shown, but less than the margin
    (-3.0, -0.5, True, "worse"),       # below 0, reaching past -1
    (-3.0, -1.5, True, "worse"),       # a loss of more than the margin shown
    (0.5, 2.0, True, "better"),
    (-2.0, 0.5, True, "undecided"),    # holds 0 and reaches past -1
    (-0.5, 1.5, True, "undecided"),
    (-1.0, 0.5, True, "undecided"),    # touching the margin is not inside it
    (0.5, 3.0, False, "worse"),        # perplexity up: a loss
    (-0.5, 0.3, False, "equivalent"),
    (math.nan, math.nan, True, "undecided"),
])
def test_verdicts(low, high, higher_is_better, expected):
    assert ev.verdict(low, high, 1.0, higher_is_better) == expected


def test_a_margin_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ev.verdict(-0.1, 0.1, 0.0)


def _runs() -> pd.DataFrame:
    """5 seeds: accuracy of baseline, checkpointing (= baseline), lowmembp, lora, lora+lowmembp; perplexity of a LM."""
    acc = {"baseline": [0.90, 0.91, 0.89, 0.92, 0.90], "checkpointing": [0.90, 0.91, 0.89, 0.92, 0.90],
           "lowmembp": [0.905, 0.905, 0.895, 0.915, 0.905], "lora": [0.80, 0.82, 0.79, 0.83, 0.80],
           "lora+lowmembp": [0.78, 0.80, 0.77, 0.81, 0.78]}
    ppl = {"baseline": [7.0, 7.1, 6.9, 7.0, 7.2], "mesa": [7.7, 7.81, 7.59, 7.7, 7.92]}  # +10 % each seed
    rows = []
    for task, model, metric, table in (("mnist5k", "vit-mnist", "accuracy", acc), ("tweets-lm", "llama-tiny",
                                                                                   "perplexity", ppl)):
        for method, values in table.items():
            for seed, v in enumerate(values):
                rows.append(dict(task=task, model=model, method=method, batch_size=16, seed=seed, status="ok",
                                 steps=100, metric_name=metric, metric_value=v, device="cpu (test)", dtype="fp32"))
    rows.append(dict(rows[-1], seed=5, method="lowmembp", status="error", metric_value=np.nan))  # no partner: out
    return pd.DataFrame(rows)


def test_each_method_is_paired_with_its_compared_method_seed_by_seed():
    df = ev.evidence_table(_runs(), {"accuracy": 1.0, "perplexity": 1.0}).set_index("method")
    assert df.loc["lora+lowmembp", "compared_with"] == "lora" and df.loc["lora", "compared_with"] == "baseline"
    assert "baseline" not in df.index and (df["seeds"] == 5).all()
    # lora+lowmembp - lora: -2 points on every seed -> sd 0, the interval the point -2
    row = df.loc["lora+lowmembp"]
    assert (row.change_mean, row.change_sd, row.ci_low, row.ci_high) == pytest.approx((-2.0, 0.0, -2.0, -2.0))
    assert row.verdict == "worse" and row.equivalent_within == pytest.approx(2.0)
    ck = df.loc["checkpointing"]
    assert (ck.change_mean, ck.ci_low, ck.ci_high, ck.verdict) == (0.0, 0.0, 0.0, "equivalent")
    # lowmembp - baseline: +0.5, -0.5, +0.5, -0.5, +0.5 points
    d = np.array([0.5, -0.5, 0.5, -0.5, 0.5])
    half = T_975_4 * d.std(ddof=1) / math.sqrt(5)
    lm = df.loc["lowmembp"]
    assert (lm.change_mean, lm.ci_low, lm.ci_high) == pytest.approx((0.1, 0.1 - half, 0.1 + half))
    assert lm.verdict == "equivalent" and (lm.compared_mean, lm.method_mean) == pytest.approx((90.4, 90.5))
    # perplexity: +10 % of the compared method's on every seed; lower is better, so worse
    ms = df.loc["mesa"]
    assert (ms.unit, ms.change_mean, ms.ci_low, ms.ci_high) == ("%", pytest.approx(10.0), pytest.approx(10.0),
                                                                 pytest.approx(10.0))
    assert ms.verdict == "worse"


def test_a_metric_without_a_margin_is_an_error():
    with pytest.raises(ValueError, match="no equivalence margin for metric 'perplexity'"):
        ev.evidence_table(_runs(), {"accuracy": 1.0})


# ----------------------------------------------------------------------------------------------- through Snakemake
def _snakemake(*args, cwd: Path, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
                        str(cwd), *args], capture_output=True, text=True, timeout=900, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-6000:]}")
    return p


@pytest.mark.pipeline
def test_tiny_evidence_config_end_to_end(tmp_path):
    config = ROOT / "config" / "evidence-tiny.yaml"
    cfg = yaml.safe_load(config.read_text())
    # the evidence's own targets (the sweep's usual tables and figures are tested by test_workflow.py)
    _snakemake("evidence_table", "evidence_figure", "--cores", "2", "--configfile", str(config), cwd=tmp_path)
    res = tmp_path / "results"
    records = sorted((res / "runs").rglob("*.json"))
    assert len(records) == 8
    recs = [json.loads(p.read_text()) for p in records]
    for r in recs:  # a point every 2 steps, the last one the final metric
        assert [p["step"] for p in r["curve"]["points"]] == [2, 4]
        assert r["curve"]["points"][-1]["metric"] == r["metric"]["value"]
    # the table against an independent computation from the records: scipy's paired t interval in points
    acc = {(r["run"]["method"], r["run"]["seed"]): 100 * r["metric"]["value"] for r in recs}
    table = pd.read_csv(res / "tables" / "evidence.csv").set_index("method")
    assert sorted(table.index) == ["lora", "lora+lowmembp", "lowmembp"]
    for method, ref in (("lowmembp", "baseline"), ("lora", "baseline"), ("lora+lowmembp", "lora")):
        m, c = np.array([acc[(method, s)] for s in (0, 1)]), np.array([acc[(ref, s)] for s in (0, 1)])
        row = table.loc[method]
        assert row.compared_with == ref and row.seeds == 2 and row.margin == 1.0
        assert row.change_mean == pytest.approx((m - c).mean())
        if (m - c).std() > 0:
            ci = stats.ttest_rel(m, c).confidence_interval(0.95)
            assert (row.ci_low, row.ci_high) == (pytest.approx(ci.low), pytest.approx(ci.high))
        assert row.verdict == ev.verdict(row.ci_low, row.ci_high, 1.0)
    md = (res / "tables" / "evidence.md").read_text()
    assert cfg["evidence"]["label"] in md.splitlines()[0] and "Machine: cpu" in md
    assert "snakemake --cores all --configfile config/evidence-tiny.yaml" in md
    assert (res / "figures" / "evidence_curves.png").read_bytes()[:4] == b"\x89PNG"
    # the reference copy (not part of `all`)
    _snakemake("evidence_reference", "--cores", "1", "--configfile", str(config), cwd=tmp_path)
    ref = tmp_path / cfg["evidence"]["reference"]
    assert (ref / "evidence.md").read_text() == (res / "tables" / "evidence.md").read_text()
    assert (ref / "evidence_curves.png").is_file()


@pytest.mark.pipeline
def test_an_evidence_sweep_needs_two_seeds(tmp_path):
    cfg = yaml.safe_load((ROOT / "config" / "evidence-tiny.yaml").read_text())
    cfg["sweeps"]["tiny-evidence"]["seeds"] = [0]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = _snakemake("-n", "--configfile", str(path), cwd=tmp_path, check=False)
    assert p.returncode != 0 and "fewer than 2 seeds" in p.stdout + p.stderr


def test_cells_of_another_optimizer_are_paired_among_themselves():
    runs = _runs()
    other = runs.assign(optimizer="adamw8bit", metric_value=runs["metric_value"] * 0.5)
    df = ev.evidence_table(pd.concat([runs, other]), {"accuracy": 1.0, "perplexity": 1.0})
    assert len(df) == 2 * 5 and (df.groupby("optimizer").size() == 5).all()
    lm = df.set_index(["optimizer", "method"]).loc[("adamw8bit", "lowmembp")]
    assert lm.change_mean == pytest.approx(0.05) and lm.compared_mean == pytest.approx(45.2)  # halved accuracies
    assert "lowmembp, adamw8bit (vs baseline)" in set(ev.display(df)["method (vs compared)"])

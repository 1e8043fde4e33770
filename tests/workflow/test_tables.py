"""The tables read alone (issue #19): column names with units and ratios named as ratios, a caption under the
title, accuracy only from the cells long enough to learn (the short memory cells in their own table), the step
time's spread and a flag where the ratio's spread contains 1, and the headline's numbers from the detail tables.
Synthetic rows (a test input, not a result) with hand-computed expectations."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
sys.path.insert(0, str(ROOT / "workflow"))

import tables  # noqa: E402

MiB = 2**20


def _runs() -> pd.DataFrame:
    """mnist5k: a trained batch (32, 100 steps, 2 seeds) and a 5-step memory batch (8); step times with spreads."""
    rows = []
    # method: (peak MiB at 32, acc seed0, acc seed1, p20, p50, p80 at batch 32)
    spec = {"baseline": (100, 0.60, 0.62, 0.95, 1.00, 1.05), "lowmembp": (75, 0.61, 0.61, 0.98, 1.02, 1.08),
            "checkpointing": (50, 0.60, 0.62, 1.40, 1.50, 1.60), "lora": (80, 0.55, 0.57, 0.70, 0.80, 0.90),
            "lora+lowmembp": (60, 0.56, 0.56, 0.72, 0.82, 0.88)}
    for m, (peak, a0, a1, p20, p50, p80) in spec.items():
        for seed, acc in ((0, a0), (1, a1)):
            rows.append(dict(task="mnist5k", model="vit-mnist", method=m, batch_size=32, seed=seed, status="ok",
                             steps=100, peak_bytes=peak * MiB, activation_bytes=peak / 2 * MiB, step_time_p20=p20,
                             step_time_p50=p50, step_time_p80=p80, samples_per_s=32 / p50, metric_name="accuracy",
                             metric_value=acc, device="cpu (test)", dtype="fp32"))
        rows.append(dict(rows[-1], batch_size=8, seed=0, steps=5, peak_bytes=peak / 3 * MiB, metric_value=0.1))
    return pd.DataFrame(rows)


def _paper_runs(targets="qkv") -> pd.DataFrame:
    """The same rows as a paper model's (ViT-B/16 on CIFAR-100), the LoRA rows with the ``targets`` option."""
    runs = _runs().assign(task="cifar100", model="vit-b16")
    runs["opt_targets"] = [targets if m.startswith("lora") else None for m in runs["method"]]
    return runs


def test_accuracy_table_has_only_the_learning_cells_in_percent():
    acc = tables.accuracy_table(_runs(), tables.load_claims())
    assert set(acc["batch_size"]) == {32} and set(acc["steps"]) == {100}
    b = acc.set_index("method").loc["baseline"]
    assert b["metric_mean"] == pytest.approx(61.0) and b["unit"] == "%" and b["seeds"] == 2
    low = acc.set_index("method").loc["lowmembp"]
    assert low["change_vs_compared"] == pytest.approx(0.0) and low["metric_ratio_ours"] == pytest.approx(1.0)
    lora = acc.set_index("method").loc["lora+lowmembp"]
    assert lora["compared_with"] == "lora" and lora["change_vs_compared"] == pytest.approx(0.0)
    short = tables.accuracy_short_table(_runs(), tables.load_claims())
    assert set(short["batch_size"]) == {8} and short["metric_mean"].tolist() == pytest.approx([10.0] * 5)
    assert not [c for c in short.columns if "ratio" in c]  # no ratios that look like gains


def test_memory_table_names_its_ratios():
    mem = tables.memory_table(_runs(), tables.load_claims()).set_index(["method", "batch_size"])
    assert "reference" not in mem.columns and "compared_with" in mem.columns
    assert mem.loc[("lowmembp", 32), "peak_ratio_ours"] == pytest.approx(0.75)
    assert pd.isna(mem.loc[("lowmembp", 32), "peak_ratio_paper"])  # vit-mnist: no paper value (a stand-in)
    assert mem.loc[("lora+lowmembp", 32), "peak_ratio_ours"] == pytest.approx(0.75)  # 60 / 80, against lora
    assert mem.loc[("lowmembp", 32), "peak_MiB"] == pytest.approx(75)


def test_speed_table_spread_and_within_noise():
    spd = tables.speed_table(_runs(), tables.load_claims())
    spd = spd[spd["batch_size"] == 32].set_index("method")
    low = spd.loc["lowmembp"]  # 1.02 / 1.00; spread 0.98/1.05 .. 1.08/0.95 contains 1
    assert low["time_ratio_ours"] == pytest.approx(1.02)
    assert low["time_ratio_ours_p20/p80"] == pytest.approx(0.98 / 1.05)
    assert low["time_ratio_ours_p80/p20"] == pytest.approx(1.08 / 0.95)
    assert low["within_noise"] == "yes" and "contains 1" in low["notes"]
    assert spd.loc["checkpointing", "within_noise"] == "no"  # 1.40/1.05 > 1
    assert spd.loc["checkpointing", "step_ms_p50"] == pytest.approx(1500)


def test_headline_is_the_detail_tables_in_percent():
    h = tables.headline_table(_runs(), tables.load_claims()).set_index("method")
    assert "baseline" not in h.index
    low = h.loc["lowmembp"]
    assert low["memory_batch"] == 32 and low["peak_saved_%_ours"] == pytest.approx(25.0)
    assert pd.isna(low["peak_saved_%_paper"])  # vit-mnist is a stand-in: the paper's ViT numbers are not its
    assert low["step_time_change_%_ours"] == pytest.approx(2.0) and low["within_noise"] == "yes"
    assert low["metric_change_ours"] == pytest.approx(0.0) and pd.isna(low["metric_change_paper"])
    assert h.loc["checkpointing", "step_time_change_%_ours"] == pytest.approx(50.0)
    shown = tables.headline_display(h.reset_index())
    row = shown[shown["method (compared with)"] == "lowmembp (vs baseline)"].iloc[0]
    assert row["peak memory saved: ours / paper"].startswith("25 % / ")
    h = tables.headline_table(_paper_runs(), tables.load_claims()).set_index("method")
    assert h.loc["lowmembp", "peak_saved_%_paper"] == pytest.approx(27.0)  # LowMemoryBP summary, ViT: -27 %
    assert h.loc["lora+lowmembp", "peak_saved_%_paper"] == pytest.approx(29.0)  # Fig. 1: 1 - 2717/3827
    shown = tables.headline_display(h.reset_index())
    row = shown[shown["method (compared with)"] == "lowmembp (vs baseline)"].iloc[0]
    assert row["peak memory saved: ours / paper"] == "25 % / 27 %"
    assert "(within noise)" in row["step time (+ = slower): ours [p20–p80] / paper"]


def test_markdown_has_title_caption_units_and_sources(tmp_path):
    runs_csv = tmp_path / "runs.csv"
    pd.concat([_runs(), _paper_runs()]).to_csv(runs_csv, index=False)
    out = {n: {e: str(tmp_path / f"{n}.{e}") for e in ("md", "csv", "html")} for n in tables.RUN_TABLES}
    tables.run_tables(runs_csv, out)
    for name in tables.RUN_TABLES:
        md = Path(out[name]["md"]).read_text().splitlines()
        assert md[0].startswith("# ") and md[2] == tables.CAPTIONS[name]
        assert "cpu (test); dtype fp32" in "\n".join(md)
        assert tables.CAPTIONS[name] in Path(out[name]["html"]).read_text().replace("&#x27;", "'")
    assert "peak_MiB" in Path(out["memory"]["md"]).read_text()
    assert "step_ms_p50" in Path(out["speed"]["md"]).read_text()
    assert "Sources of the paper values" in Path(out["memory"]["md"]).read_text()


def test_block_breakdown_table_gives_its_unit(tmp_path):
    out = {e: str(tmp_path / f"bb.{e}") for e in ("md", "csv", "html")}
    tables.repro_table("block_breakdown", ROOT / "results" / "reference" / "repro" / "block-breakdown.csv", out)
    md = Path(out["md"]).read_text()
    assert "16-bit units of b·s·d" in md and "2·b·s·d bytes" in md


def test_headline_batch_label_when_no_seed_of_a_method_finished():
    """A method whose accuracy cells all failed has no seed count (NaN): the headline says so instead of crashing
    (the fault-injection pipeline run hit `int(nan)` here)."""
    import numpy as np
    from tables import _batch_seeds

    assert _batch_seeds(np.nan, 1) == "-"
    assert _batch_seeds(32.0, np.nan) == "32 (no seed finished)"
    assert _batch_seeds(32.0, 2.0) == "32 (2 seeds)"
    assert _batch_seeds(8, 1) == "8 (1 seed)"


def test_optimizer_is_a_column_and_part_of_the_cell():
    """Runs with another optimizer are their own cells, compared within that optimizer; runs.csv without the
    column (older aggregations) read as adamw."""
    runs = _runs()
    assert "optimizer" not in runs
    mem = tables.memory_table(runs, tables.load_claims())
    assert set(mem["optimizer"]) == {"adamw"}
    eight = runs[runs["method"].isin(["baseline", "lowmembp"])].assign(optimizer="adamw8bit")
    eight["peak_bytes"] = eight["peak_bytes"] / 2
    eight.loc[eight["method"] == "lowmembp", "peak_bytes"] *= 0.9
    both = pd.concat([runs.assign(optimizer="adamw"), eight], ignore_index=True)
    mem = tables.memory_table(both, tables.load_claims()).set_index(["method", "optimizer", "batch_size"])
    assert mem.loc[("lowmembp", "adamw", 32), "peak_ratio_ours"] == pytest.approx(0.75)
    assert mem.loc[("lowmembp", "adamw8bit", 32), "peak_ratio_ours"] == pytest.approx(0.75 * 0.9)
    assert mem.loc[("baseline", "adamw8bit", 32), "peak_MiB"] == pytest.approx(50)  # not averaged with adamw's
    head = tables.headline_table(both, tables.load_claims())
    assert sorted(head[head["method"] == "lowmembp"]["optimizer"]) == ["adamw", "adamw8bit"]
    shown = tables.headline_display(head)["method (compared with)"].tolist()
    assert "lowmembp, adamw8bit (vs baseline)" in shown and "lowmembp (vs baseline)" in shown
def test_a_paper_value_shows_only_beside_its_own_setting():
    """Each paper ratio belongs to one setting (workflow/resources/paper_claims.yaml): Fig. 1's ratios (ViT-B/16,
    LoRA on q and v, relative to LoRA) beside ViT-B/16 LoRA rows with targets qkv only — not beside LoRA on all
    linears, not beside full fine-tuning rows of the same method without LoRA, not beside a stand-in model; the
    paper's stated summaries beside the paper's own models only; Mesa's DeiT-B ratio beside no stand-in."""
    claims = tables.load_claims()
    qv = tables.memory_table(_paper_runs("qkv"), claims).set_index(["method", "batch_size"])
    assert qv.loc[("lora+lowmembp", 32), "peak_ratio_paper"] == pytest.approx(0.710)
    assert "Fig. 1" in qv.loc[("lora+lowmembp", 32), "peak_source"]
    assert "setting: ViT-B/16, LoRA r4 on q and v" in qv.loc[("lora+lowmembp", 32), "peak_source"]
    assert qv.loc[("lowmembp", 32), "peak_ratio_paper"] == pytest.approx(0.73)
    assert "stated summary" in qv.loc[("lowmembp", 32), "peak_source"]
    # checkpointing without LoRA is full fine-tuning: Fig. 1's LoRA + checkpointing ratio is not its
    assert pd.isna(qv.loc[("checkpointing", 32), "peak_ratio_paper"])
    every = tables.memory_table(_paper_runs('["qkv", "proj", "fc1", "fc2"]'),
                                claims).set_index(["method", "batch_size"])
    assert pd.isna(every.loc[("lora+lowmembp", 32), "peak_ratio_paper"])  # lora_all: Fig. 1 is not its setting
    spd = tables.speed_table(_paper_runs("qkv"), claims).set_index(["method", "batch_size"])
    assert spd.loc[("lora+lowmembp", 32), "time_ratio_paper"] == pytest.approx(0.993)
    stand_in = tables.memory_table(_runs(), claims)
    assert stand_in["peak_ratio_paper"].isna().all() and stand_in["act_ratio_paper"].isna().all()
    # the targets written into the spec count as the row's own (vit-cifar's lora_qv sweep: lora@targets=qkv+X)
    assert tables.claim(claims, "peak_ratio", "lora@targets=qkv+lowmembp", "vit-b16")[0] == pytest.approx(0.710)
    assert np.isnan(tables.claim(claims, "peak_ratio", "lora+lowmembp", "vit-b16")[0])  # default: all linears
    assert np.isnan(tables.claim(claims, "peak_ratio", "mesa", "vit-mnist")[0])
    assert tables.claim(claims, "metric_ratio", "checkpointing", "vit-mnist")[0] == 1.0  # exact: any setting


def test_every_claim_names_its_setting_and_source():
    claims = tables.load_claims()
    for table in ("peak_ratio", "activation_ratio", "step_time_ratio", "metric_ratio"):
        for method, entries in claims[table].items():
            for e in entries:
                assert {"models", "value", "setting", "source"} <= set(e), (table, method, e)
                assert e["models"] == "any" or not set(e["models"]) & {"vit-mnist", "minilm-l6", "llama-tiny"}
                if method.startswith("lora+") and "vit-b16" in e["models"] and "Fig. 1" in e["source"]:
                    assert e.get("targets") == "qkv", (table, method)

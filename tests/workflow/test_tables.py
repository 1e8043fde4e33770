"""The tables read alone (issue #19): column names with units and ratios named as ratios, a caption under the
title, accuracy only from the cells long enough to learn (the short memory cells in their own table), the step
time's spread and a flag where the ratio's spread contains 1, and the headline's numbers from the detail tables.
Synthetic rows (a test input, not a result) with hand-computed expectations."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
sys.path.insert(0, str(ROOT / "workflow"))

import paper_claims  # noqa: E402
import repro_layouts  # noqa: E402
import sweep_layouts  # noqa: E402
import table_layout  # noqa: E402
import table_maths  # noqa: E402
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
    acc = table_maths.accuracy_table(_runs(), paper_claims.load_claims())
    assert set(acc["batch_size"]) == {32} and set(acc["steps"]) == {100}
    b = acc.set_index("method").loc["baseline"]
    assert b["metric_mean"] == pytest.approx(61.0) and b["unit"] == "%" and b["seeds"] == 2
    low = acc.set_index("method").loc["lowmembp"]
    assert low["change_vs_compared"] == pytest.approx(0.0) and low["metric_ratio_ours"] == pytest.approx(1.0)
    lora = acc.set_index("method").loc["lora+lowmembp"]
    assert lora["compared_with"] == "lora" and lora["change_vs_compared"] == pytest.approx(0.0)
    short = table_maths.accuracy_short_table(_runs(), paper_claims.load_claims())
    assert set(short["batch_size"]) == {8} and short["metric_mean"].tolist() == pytest.approx([10.0] * 5)
    assert not [c for c in short.columns if "ratio" in c]  # no ratios that look like gains


def test_memory_table_names_its_ratios():
    mem = table_maths.memory_table(_runs(), paper_claims.load_claims()).set_index(["method", "batch_size"])
    assert "reference" not in mem.columns and "compared_with" in mem.columns
    assert mem.loc[("lowmembp", 32), "peak_ratio_ours"] == pytest.approx(0.75)
    assert pd.isna(mem.loc[("lowmembp", 32), "peak_ratio_paper"])  # vit-mnist: no paper value (a stand-in)
    assert mem.loc[("lora+lowmembp", 32), "peak_ratio_ours"] == pytest.approx(0.75)  # 60 / 80, against lora
    assert mem.loc[("lowmembp", 32), "peak_MiB"] == pytest.approx(75)


def test_speed_table_spread_and_within_noise():
    spd = table_maths.speed_table(_runs(), paper_claims.load_claims())
    spd = spd[spd["batch_size"] == 32].set_index("method")
    low = spd.loc["lowmembp"]  # 1.02 / 1.00; spread 0.98/1.05 .. 1.08/0.95 contains 1
    assert low["time_ratio_ours"] == pytest.approx(1.02)
    assert low["time_ratio_ours_p20/p80"] == pytest.approx(0.98 / 1.05)
    assert low["time_ratio_ours_p80/p20"] == pytest.approx(1.08 / 0.95)
    assert low["within_noise"] == "yes" and "contains 1" in low["notes"]
    assert spd.loc["checkpointing", "within_noise"] == "no"  # 1.40/1.05 > 1
    assert spd.loc["checkpointing", "step_ms_p50"] == pytest.approx(1500)


def test_headline_is_the_detail_tables_in_percent():
    h = table_maths.headline_table(_runs(), paper_claims.load_claims()).set_index("method")
    assert "baseline" not in h.index
    low = h.loc["lowmembp"]
    assert low["memory_batch"] == 32 and low["peak_saved_%_ours"] == pytest.approx(25.0)
    assert pd.isna(low["peak_saved_%_paper"])  # vit-mnist is a stand-in: the paper's ViT numbers are not its
    assert low["step_time_change_%_ours"] == pytest.approx(2.0) and low["within_noise"] == "yes"
    assert low["metric_change_ours"] == pytest.approx(0.0) and pd.isna(low["metric_change_paper"])
    assert h.loc["checkpointing", "step_time_change_%_ours"] == pytest.approx(50.0)
    shown = sweep_layouts.headline_display(h.reset_index())
    row = shown[shown["method (compared with)"] == "lowmembp (vs baseline)"].iloc[0]
    # no paper figure for any row of these stand-in models: the column shows ours alone and says why
    assert "peak memory saved: ours / paper" not in shown and row["peak memory saved (no paper figure)"] == "25 %"
    h = table_maths.headline_table(_paper_runs(), paper_claims.load_claims()).set_index("method")
    assert h.loc["lowmembp", "peak_saved_%_paper"] == pytest.approx(27.0)  # LowMemoryBP summary, ViT: -27 %
    assert h.loc["lora+lowmembp", "peak_saved_%_paper"] == pytest.approx(29.0)  # Fig. 1: 1 - 2717/3827
    shown = sweep_layouts.headline_display(h.reset_index())
    row = shown[shown["method (compared with)"] == "lowmembp (vs baseline)"].iloc[0]
    assert row["peak memory saved: ours / paper"] == "25 % / 27 %"
    assert "(within noise)" in row["CPU step time, CPU fast path (this machine): change (%) [p20 … p80]"]
    assert not [c for c in shown.columns if "paper" in c and ("time" in c or "step" in c)]  # GPU claims stand apart


def test_markdown_has_title_caption_units_and_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_layouts, "flop_ratio", lambda *a: 1.0)  # its own test below (slow: fake ViT-B/16 steps)
    runs_csv = tmp_path / "runs.csv"
    pd.concat([_runs(), _paper_runs()]).to_csv(runs_csv, index=False)
    out = {n: {e: str(tmp_path / f"{n}.{e}") for e in ("md", "csv", "html")} for n in table_maths.RUN_TABLES}
    tables.write_run_tables(runs_csv, out)
    for name in table_maths.RUN_TABLES:
        md = Path(out[name]["md"]).read_text().splitlines()
        assert md[0] == f"# {sweep_layouts.TITLES[name]} — cpu (test), fp32"  # what, and on which machine
        assert md[2] == "Machine: cpu (test), fp32." and md[4] == sweep_layouts.caption(name, _runs())
        html = Path(out[name]["html"]).read_text().replace("&#x27;", "'")
        assert sweep_layouts.caption(name, _runs()) in html and "cpu (test), fp32" in html
    assert "peak (MiB)" in Path(out["memory"]["md"]).read_text()
    assert "step p50 (ms)" in Path(out["speed"]["md"]).read_text()
    assert "Source of a paper value" not in Path(out["memory"]["md"]).read_text()
    assert "Fig. 1: 2717 / 3827 MiB" in Path(out["memory"]["md"]).read_text()  # a footnote


def test_block_breakdown_table_gives_its_unit(tmp_path):
    out = {e: str(tmp_path / f"bb.{e}") for e in ("md", "csv", "html")}
    tables.write_repro_table("block_breakdown", ROOT / "results" / "reference" / "repro" / "block-breakdown.csv", out)
    md = Path(out["md"]).read_text()
    assert "16-bit units of b·s·d" in md and "2·b·s·d bytes" in md


def test_headline_batch_label_when_no_seed_of_a_method_finished():
    """A method whose accuracy cells all failed has no seed count (NaN): the headline says so instead of crashing
    (the fault-injection pipeline run hit `int(nan)` here)."""
    import numpy as np
    from sweep_layouts import _batch_seeds

    assert _batch_seeds(np.nan, 1) == "-"
    assert _batch_seeds(32.0, np.nan) == "32 (no seed finished)"
    assert _batch_seeds(32.0, 2.0) == "32 (2 seeds)"
    assert _batch_seeds(8, 1) == "8 (1 seed)"


def test_optimizer_is_a_column_and_part_of_the_cell():
    """Runs with another optimizer are their own cells, compared within that optimizer; runs.csv without the
    column (older aggregations) read as adamw."""
    runs = _runs()
    assert "optimizer" not in runs
    mem = table_maths.memory_table(runs, paper_claims.load_claims())
    assert set(mem["optimizer"]) == {"adamw"}
    eight = runs[runs["method"].isin(["baseline", "lowmembp"])].assign(optimizer="adamw8bit")
    eight["peak_bytes"] = eight["peak_bytes"] / 2
    eight.loc[eight["method"] == "lowmembp", "peak_bytes"] *= 0.9
    both = pd.concat([runs.assign(optimizer="adamw"), eight], ignore_index=True)
    mem = table_maths.memory_table(both, paper_claims.load_claims()).set_index(["method", "optimizer", "batch_size"])
    assert mem.loc[("lowmembp", "adamw", 32), "peak_ratio_ours"] == pytest.approx(0.75)
    assert mem.loc[("lowmembp", "adamw8bit", 32), "peak_ratio_ours"] == pytest.approx(0.75 * 0.9)
    assert mem.loc[("baseline", "adamw8bit", 32), "peak_MiB"] == pytest.approx(50)  # not averaged with adamw's
    head = table_maths.headline_table(both, paper_claims.load_claims())
    assert sorted(head[head["method"] == "lowmembp"]["optimizer"]) == ["adamw", "adamw8bit"]
    shown = sweep_layouts.headline_display(head)["method (compared with)"].tolist()
    assert "lowmembp, adamw8bit (vs baseline)" in shown and "lowmembp (vs baseline)" in shown
def test_a_paper_value_shows_only_beside_its_own_setting():
    """Each paper ratio belongs to one setting (workflow/resources/paper_claims.yaml): Fig. 1's ratios (ViT-B/16,
    LoRA on q and v, relative to LoRA) beside ViT-B/16 LoRA rows with targets qkv only — not beside LoRA on all
    linears, not beside full fine-tuning rows of the same method without LoRA, not beside a stand-in model; the
    paper's stated summaries beside the paper's own models only; Mesa's DeiT-B ratio beside no stand-in."""
    claims = paper_claims.load_claims()
    qv = table_maths.memory_table(_paper_runs("qkv"), claims).set_index(["method", "batch_size"])
    assert qv.loc[("lora+lowmembp", 32), "peak_ratio_paper"] == pytest.approx(0.710)
    assert "Fig. 1" in qv.loc[("lora+lowmembp", 32), "peak_source"]
    assert "setting: ViT-B/16, LoRA r4 on q and v" in qv.loc[("lora+lowmembp", 32), "peak_source"]
    assert qv.loc[("lowmembp", 32), "peak_ratio_paper"] == pytest.approx(0.73)
    assert "stated summary" in qv.loc[("lowmembp", 32), "peak_source"]
    # checkpointing without LoRA is full fine-tuning: Fig. 1's LoRA + checkpointing ratio is not its
    assert pd.isna(qv.loc[("checkpointing", 32), "peak_ratio_paper"])
    every = table_maths.memory_table(_paper_runs('["qkv", "proj", "fc1", "fc2"]'),
                                     claims).set_index(["method", "batch_size"])
    assert pd.isna(every.loc[("lora+lowmembp", 32), "peak_ratio_paper"])  # lora_all: Fig. 1 is not its setting
    spd = table_maths.speed_table(_paper_runs("qkv"), claims).set_index(["method", "batch_size"])
    assert spd.loc[("lora+lowmembp", 32), "time_ratio_paper"] == pytest.approx(0.993)
    stand_in = table_maths.memory_table(_runs(), claims)
    assert stand_in["peak_ratio_paper"].isna().all() and stand_in["act_ratio_paper"].isna().all()
    # the targets written into the spec count as the row's own (vit-cifar's lora_qv sweep: lora@targets=qkv+X)
    assert paper_claims.claim(claims, "peak_ratio", "lora@targets=qkv+lowmembp", "vit-b16")[0] == pytest.approx(0.710)
    assert np.isnan(paper_claims.claim(claims, "peak_ratio", "lora+lowmembp", "vit-b16")[0])  # default: all linears
    assert np.isnan(paper_claims.claim(claims, "peak_ratio", "mesa", "vit-mnist")[0])
    assert paper_claims.claim(claims, "metric_ratio", "checkpointing", "vit-mnist")[0] == 1.0  # exact: any setting


def test_every_claim_names_its_setting_and_source():
    claims = paper_claims.load_claims()
    for table in ("peak_ratio", "activation_ratio", "step_time_ratio", "metric_ratio"):
        for method, entries in claims[table].items():
            for e in entries:
                assert {"models", "value", "setting", "source"} <= set(e), (table, method, e)
                assert e["models"] == "any" or not set(e["models"]) & {"vit-mnist", "minilm-l6", "llama-tiny"}
                if method.startswith("lora+") and "vit-b16" in e["models"] and "Fig. 1" in e["source"]:
                    assert e.get("targets") == "qkv", (table, method)


# --- tables that read alone: at most MAX_COLUMNS columns, a title with the machine, footnotes, the CSV's figures ---

REFERENCE = ROOT / "results" / "reference"
MD_TABLE = re.compile(r"((?:^\|.*\|\n)+)", flags=re.M)


def md_tables(text: str) -> list[pd.DataFrame]:
    """Every Markdown table of ``text`` as a frame of strings (header, the rule line dropped)."""
    out = []
    for block in MD_TABLE.findall(text):
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()]
        out.append(pd.DataFrame(rows[2:], columns=rows[0]))
    return out


def footnotes(text: str) -> dict[int, str]:
    return {int(n): t for n, t in re.findall(r"^(\d+)\. (.+)$", text.split("\nNotes:\n", 1)[-1], flags=re.M)} \
        if "\nNotes:\n" in text else {}


def check_reads_alone(text: str, machine: str) -> None:
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[0].endswith(f" — {machine}"), lines[0]
    assert lines[2] == f"Machine: {machine}.", lines[2]
    found = md_tables(text)
    assert found, "no table"
    for t in found:
        assert len(t.columns) <= table_layout.MAX_COLUMNS, list(t.columns)
        assert all(len(str(v)) <= 120 for v in t.to_numpy().ravel()), "a long note left in a cell"
    notes = footnotes(text)
    marks = {int(n) for m in re.findall(r"\[(\d+(?:, \d+)*)\]", text.split("\nNotes:\n")[0]) for n in m.split(", ")}
    assert marks <= set(notes), f"markers without a footnote: {sorted(marks - set(notes))}"
    assert sorted(notes) == list(range(1, len(notes) + 1))


def _layouts(tmp_path, runs: pd.DataFrame) -> dict[str, str]:
    runs_csv = tmp_path / "runs.csv"
    runs.to_csv(runs_csv, index=False)
    out = {n: {e: str(tmp_path / f"{n}.{e}") for e in ("md", "csv", "html")} for n in table_maths.RUN_TABLES}
    tables.write_run_tables(runs_csv, out)
    head = {e: str(tmp_path / f"headline.{e}") for e in ("md", "csv", "html")}
    tables.write_headline(runs_csv, head)
    return {n: Path(o["md"]).read_text() for n, o in {**out, "headline": head}.items()}


def _with_refused_cce(runs: pd.DataFrame) -> pd.DataFrame:
    """A cce cell refused on this machine (status error, its message) beside finished ones."""
    base = runs[(runs["method"] == "baseline") & (runs["batch_size"] == 8)].iloc[0]
    row = dict(base, method="cce", status="error", peak_bytes=np.nan, activation_bytes=np.nan, step_time_p20=np.nan,
               step_time_p50=np.nan, step_time_p80=np.nan, metric_value=np.nan,
               message="cce: cut-cross-entropy's kernels need CUDA; on the CPU use chunked-ce")
    return pd.concat([runs, pd.DataFrame([row])], ignore_index=True)


def test_every_run_table_reads_alone(tmp_path):
    for name, text in _layouts(tmp_path, _with_refused_cce(_runs())).items():
        check_reads_alone(text, "cpu (test), fp32")


def test_a_refused_method_is_shown_with_its_reason(tmp_path):
    text = _layouts(tmp_path, _with_refused_cce(_runs()))["headline"]
    (shown,) = [t for t in md_tables(text) if "method (compared with)" in t.columns]
    cell = [c for c in shown["method (compared with)"] if c.startswith("cce")]
    assert len(cell) == 1 and cell[0].startswith("cce (vs baseline) — error [")
    n = int(re.search(r"\[(\d+)\]", cell[0]).group(1))
    assert "need CUDA; on the CPU use chunked-ce" in footnotes(text)[n]


def test_cpu_step_times_stand_apart_from_the_papers_gpu_claims(tmp_path, monkeypatch):
    """On a CPU the step-time column says so and holds ours only; a paper's throughput claim (a GPU figure) stands in
    its own part beside the FLOP ratio of the row's setting and a GPU column that is empty until a GPU ran."""
    monkeypatch.setattr(sweep_layouts, "flop_ratio",
                        lambda model, method, compared, *a: {"lowmembp": 1.0}.get(method, 1.5))
    texts = _layouts(tmp_path, _paper_runs().assign(ops_backend="cpu"))
    label = "CPU step time, CPU fast path (this machine)"  # the records' ops_backend named
    for name in ("headline", "speed"):
        found = md_tables(texts[name])
        cpu = [t for t in found if any(label in c or "step p50 (ms)" in c for c in t.columns)]
        assert cpu and all("paper" not in c for t in cpu for c in t.columns if "step" in c or "time" in c)
        (claims,) = [t for t in found if "paper: step-time ratio (GPU)" in t.columns]
        assert list(claims.columns)[2:] == ["paper: step-time ratio (GPU)", "FLOP ratio (fake tensors)",
                                            "GPU step-time ratio (ours)"]
        row = claims[claims["method (vs compared)"] == "lora+lowmembp (vs lora)"].iloc[0]
        assert row["paper: step-time ratio (GPU)"].startswith("0.993 [")  # Fig. 1: 288 / 290 img/s
        assert row["FLOP ratio (fake tensors)"] == "1.500" and row["GPU step-time ratio (ours)"] == sweep_layouts.NO_GPU
        assert texts[name].count(label) >= 1 and "{time}" not in texts[name]
    # stand-in models: no claim, no such part, a footnote that says where the claims are
    stand_in = _layouts(tmp_path, _runs())["headline"]
    assert not [t for t in md_tables(stand_in) if "paper: step-time ratio (GPU)" in t.columns]
    assert "fig1 table (part: Throughput)" in stand_in


def test_cpu_step_time_names_the_ops_the_records_ran():
    """The label of a CPU step time says which ops ran: the records' ops_backend, the reference where a record
    predates it, both where the records differ."""
    runs = _runs()
    assert sweep_layouts.cpu_time(runs) == "CPU step time, PyTorch reference ops (this machine)"
    assert sweep_layouts.cpu_time(runs.assign(ops_backend="cpu")) == "CPU step time, CPU fast path (this machine)"
    mixed = runs.assign(ops_backend=["cpu", None] * (len(runs) // 2) + ["cpu"] * (len(runs) % 2))
    assert sweep_layouts.cpu_ops(mixed) == "CPU fast path and PyTorch reference ops"
    assert sweep_layouts.caption("speed", runs.assign(ops_backend="torch")).startswith(
        "CPU step time, PyTorch reference ops (this machine): step time in ms")


def _md_numbers(col: pd.Series) -> pd.Series:
    return pd.to_numeric(col.str.replace(r"\s*\[[\d, ]+\]$", "", regex=True).replace("-", np.nan))


@pytest.mark.parametrize("name", ["memory", "speed", "accuracy", "headline", "fig1", "mesa_table",
                                  "block_breakdown", "tokentune_memory", "accuracy_short"])
def test_reference_tables_read_alone_and_hold_the_csvs_figures(name):
    text = (REFERENCE / "tables" / f"{name}.md").read_text()
    csv = pd.read_csv(REFERENCE / "tables" / f"{name}.csv")
    runs = pd.read_csv(REFERENCE / "runs.csv")
    repro = tables.catalogue.REPRO_BY_STEM.get(name)
    check_reads_alone(text, repro_layouts.repro_machine(repro) if repro else sweep_layouts.machine(runs))
    found = md_tables(text)
    if name == "memory":
        peak, act = found
        assert _md_numbers(peak["peak (MiB)"]).tolist() == csv["peak_MiB"].round(1).tolist()
        assert _md_numbers(act["activations (MiB)"]).tolist() == csv["activation_MiB"].round(1).tolist()
        assert np.allclose(_md_numbers(peak["peak ratio: ours"]), csv["peak_ratio_ours"].round(3), equal_nan=True)
    elif name == "speed":
        assert _md_numbers(found[0]["step p50 (ms)"]).tolist() == csv["step_ms_p50"].round(2).tolist()
        assert sweep_layouts.cpu_time(runs) in text
    elif name in ("accuracy", "accuracy_short"):
        mean = found[0]["mean ± std"].str.split(" ± ").str[0]
        assert _md_numbers(mean).tolist() == csv["metric_mean"].round(2).tolist()
    elif name == "headline":
        col = next(c for c in found[0].columns if c.startswith("peak memory saved"))
        saved = found[0][col].str.split(" %").str[0]
        assert _md_numbers(saved).tolist() == csv["peak_saved_%_ours"].round(0).tolist()
        assert len(found[0]) == len(csv)
    elif name == "fig1":
        mem, diff, thr = found
        assert _md_numbers(mem["ours (MiB)"]).tolist() == csv["ours_MiB"].round(1).tolist()
        assert _md_numbers(mem["paper (MiB)"]).tolist() == csv["paper_MiB"].tolist()
        assert _md_numbers(diff["unexplained: paper − emulated (MiB)"]).tolist() == \
            csv["unexplained_MiB"].round(1).tolist()
        qv = csv[csv["setting"].str.contains("default")]
        assert _md_numbers(thr["FLOP ratio to LoRA (fake tensors)"]).tolist() == qv["flop_ratio"].round(3).tolist()
        assert np.allclose(qv["paper_step_time_ratio"], 288 / qv["paper_img_per_s"])
        gpu = paper_claims.gpu_step_ratios()  # results/gpu/fig1.csv, the committed GPU run (else empty)
        want = [f"{gpu[(s.split(' ')[0], m)]:.3f}" if (s.split(" ")[0], m) in gpu else sweep_layouts.NO_GPU
                for s, m in zip(qv["setting"], qv["spec"])]
        assert thr["GPU step-time ratio to LoRA (ours)"].tolist() == want
    else:  # the generic layout: every numeric column of the CSV, rounded, in one of the parts
        shown = {c: t[c] for t in found for c in t.columns}
        unit = repro_layouts.REPRO_UNITS.get(name, "")
        names = {c: table_layout.header(c, unit if pd.api.types.is_float_dtype(csv[c]) and "ratio" not in c else "")
                 for c in csv.columns}
        assert {names[c] for c in csv.columns if pd.api.types.is_float_dtype(csv[c])} <= set(shown)
        for col in [c for c in csv.columns if pd.api.types.is_float_dtype(csv[c])]:
            want = csv[col].map(lambda v, col=col: float(table_layout.format_value(col, v)) if pd.notna(v) else np.nan)
            assert np.allclose(_md_numbers(shown[names[col]]), want, equal_nan=True), col


def test_fig1_gpu_column_reads_the_gpu_run(tmp_path):
    """The GPU column of Fig. 1's throughput part: results/gpu/fig1.csv's p50 step time over LoRA's, per setting."""
    gpu = pd.DataFrame({"config": ["fig1-qkv"] * 3 + ["fig1-all"], "status": ["ok"] * 4,
                        "method": ["lora", "lora+checkpointing", "lora+lowmembp", "lora"],
                        "step_ms_p50": [100.0, 130.0, 101.0, 90.0]})
    gpu.to_csv(tmp_path / "fig1.csv", index=False)
    assert paper_claims.gpu_step_ratios(tmp_path) == pytest.approx(
        {("lora_qv", "lora"): 1.0, ("lora_qv", "lora+checkpointing"): 1.3, ("lora_qv", "lora+lowmembp"): 1.01,
         ("lora_all", "lora"): 1.0})
    df = pd.read_csv(REFERENCE / "repro" / "fig1.csv")
    parts = repro_layouts.fig1_layout(df, table_layout.Footnotes(), tmp_path)
    thr = parts[-1].table.set_index(parts[-1].table["method"].str.replace(r" \[\d+\]$", "", regex=True))
    assert thr.loc["LoRA + checkpointing (every block)", "GPU step-time ratio to LoRA (ours)"] == "1.300"
    assert thr.loc["LoRA + Mesa (GELU and LayerNorm)", "GPU step-time ratio to LoRA (ours)"] == sweep_layouts.NO_GPU
    assert paper_claims.gpu_step_ratios(tmp_path / "none") == {}


def test_headers_carry_units():
    assert table_layout.header("peak_MiB_b8") == "peak b8 (MiB)"
    assert table_layout.header("paper_share_%") == "paper share (%)"
    assert table_layout.header("ours_saving_pct") == "ours saving (%)"
    assert table_layout.header("real_base", "2·b·s·d B") == "real base (2·b·s·d B)"
    assert table_layout.header("slope_vs_full_ft") == "slope vs full ft"


def test_split_columns_keeps_keys_and_the_limit():
    wide = pd.DataFrame([[f"v{i}" for i in range(23)]], columns=[f"c{i}" for i in range(23)])
    parts = table_layout.split_columns(wide, ["c0", "c1"])
    assert [len(p.table.columns) for p in parts] == [10, 10, 7]
    assert all(list(p.table.columns[:2]) == ["c0", "c1"] for p in parts)
    assert [c for p in parts for c in p.table.columns[2:]] == [f"c{i}" for i in range(2, 23)]
    with pytest.raises(ValueError, match="wider than 10"):
        table_layout.Layout("t", "m", "", [table_layout.Part("", wide)]).check()


@pytest.mark.slow
def test_flop_ratio_of_a_paper_setting_is_the_fig1_reproductions():
    """The FLOP ratio beside a sweep row's paper claim (paper_claims.flop_ratio) is the one the fig1 reproduction counts
    for the same setting (ViT-B/16, LoRA r4 on qkv, batch 64, fp16): two code paths, one number."""
    fig1 = pd.read_csv(REFERENCE / "repro" / "fig1.csv").set_index(["setting", "spec"])
    want = fig1.loc[("lora_qv (default)", "lora+checkpointing"), "flop_ratio"]
    got = paper_claims.flop_ratio("vit-b16", "lora+checkpointing", "lora", 64, "fp16", "qkv", 4)
    assert got == pytest.approx(want, rel=1e-9) and got > 1.2
    assert np.isnan(paper_claims.flop_ratio("vit-mnist", "lowmembp", "baseline", 8, "fp32"))  # a stand-in: no estimate


def test_run_by_snakemake_finds_the_gpu_results(tmp_path):
    """Under Snakemake's ``script:`` the scripts' folder comes as ``workflow/rules/../scripts`` (unresolved): the
    fig1 table still finds results/gpu/fig1.csv and fills its GPU column, as when run by hand."""
    import runpy
    from types import SimpleNamespace

    assert (ROOT / "results" / "gpu" / "fig1.csv").is_file()
    out = {e: str(tmp_path / f"fig1.{e}") for e in ("md", "csv", "html")}
    sm = SimpleNamespace(scriptdir=str(ROOT / "workflow" / "rules" / ".." / "scripts"),
                         params=SimpleNamespace(kind="repro", name="fig1", title=None),
                         input=[str(ROOT / "results" / "reference" / "repro" / "fig1.csv")],
                         output=SimpleNamespace(**out))
    runpy.run_path(str(ROOT / "workflow" / "scripts" / "tables.py"), init_globals={"snakemake": sm})
    text = Path(out["md"]).read_text()
    assert sweep_layouts.NO_GPU not in text
    (thr,) = [t for t in md_tables(text) if "GPU step-time ratio to LoRA (ours)" in t.columns]
    assert thr["GPU step-time ratio to LoRA (ours)"].iloc[0] == "1.000"


def test_headline_names_each_rows_device_and_never_sets_a_cpu_time_against_a_gpu_time():
    runs = _paper_runs()
    gpu = "NVIDIA H100 80GB HBM3"
    runs = runs.assign(device="cpu (x86_64, 1 threads)")
    runs.loc[runs["method"] == "lora+lowmembp", "device"] = gpu  # its compared cells (lora) ran on a CPU
    h = table_maths.headline_table(runs, paper_claims.load_claims()).set_index("method")
    assert h.loc["lora+lowmembp", "device"] == gpu and h.loc["lowmembp", "device"] == "cpu"
    assert pd.isna(h.loc["lora+lowmembp", "step_time_change_%_ours"])
    assert f"lora+lowmembp ran on {gpu}, lora on cpu" in h.loc["lora+lowmembp", "notes"]
    assert pd.notna(h.loc["lowmembp", "step_time_change_%_ours"])  # both on the CPU: compared
    shown = sweep_layouts.headline_display(h.reset_index())
    assert any(x.endswith(f"({gpu})") for x in shown["task / model"]) and any(x.endswith("(cpu)")
                                                                               for x in shown["task / model"])
    runs.loc[:, "device"] = gpu  # all on the GPU: compared again, each row says where
    h = table_maths.headline_table(runs, paper_claims.load_claims()).set_index("method")
    assert pd.notna(h.loc["lora+lowmembp", "step_time_change_%_ours"])


def test_speed_table_sets_no_cpu_time_against_a_gpu_time():
    runs = _paper_runs().assign(device="cpu (x86_64, 1 threads)")
    runs.loc[runs["method"] == "lora+lowmembp", "device"] = "NVIDIA H100 80GB HBM3"
    spd = table_maths.speed_table(runs, paper_claims.load_claims())
    gpu_rows = spd[spd["method"] == "lora+lowmembp"]
    assert len(gpu_rows) and gpu_rows["time_ratio_ours"].isna().all()
    assert gpu_rows["time_ratio_ours_p20/p80"].isna().all()
    assert spd[spd["method"] == "lowmembp"]["time_ratio_ours"].notna().any()  # both on the CPU: compared


def test_by_hand_command_line_says_its_usage_and_writes_a_repro_table(tmp_path):
    """``python workflow/scripts/tables.py``: no arguments -> usage and exit 2; ``repro NAME CSV OUTDIR`` writes the
    table's three files."""
    import os
    import subprocess

    script = ROOT / "workflow" / "scripts" / "tables.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bare = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert bare.returncode == 2 and "usage: python workflow/scripts/tables.py" in bare.stderr
    csv = tmp_path / "fig1.csv"
    csv.write_text((ROOT / "results" / "reference" / "repro" / "fig1.csv").read_text())
    made = subprocess.run([sys.executable, str(script), "repro", "fig1", str(csv), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert made.returncode == 0, made.stderr
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"fig1.md", "fig1.csv", "fig1.html"}

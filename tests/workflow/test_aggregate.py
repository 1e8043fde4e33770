"""Aggregation turns a damaged record into an `invalid` row (its cell from the path, the reason, the path); tables and
figures leave such rows out and say how many (workflow/scripts/aggregate.py, tables.py, plots.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))

DAMAGE = {
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "a JSON list": lambda text: json.dumps([json.loads(text)]),
    "missing fields": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "run"}),
    "a field of the wrong type": lambda text: json.dumps({**json.loads(text), "status": 3}),
}


def _record(path: Path, method: str, seed: int, value: float) -> Path:
    from experiments.record import error_record, write

    rec = error_record({"task": "mnist5k", "model": "vit-mnist", "method": method, "batch_size": 8, "seed": seed,
                        "dtype": "fp32", "steps": 3}, None, "2026-01-01T00:00:00+00:00", status="ok",
                       metric={"name": "accuracy", "value": value, "split": "test (64)"})
    return write(rec, path)


def _cell(root: Path, method: str, seed: int = 0) -> Path:
    return root / "results" / "runs" / "mnist5k" / "vit-mnist" / method / "bs8" / f"seed{seed}.json"


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_record_becomes_an_invalid_row_with_its_cell_path_and_reason(tmp_path, damage):
    import aggregate

    good = _record(_cell(tmp_path, "baseline"), "baseline", 0, 0.5)
    bad = _record(_cell(tmp_path, "lowmembp", 1), "lowmembp", 1, 0.6)
    bad.write_text(DAMAGE[damage](bad.read_text()))
    df = aggregate.aggregate([good, bad]).set_index("method")
    assert df.loc["baseline", "status"] == "ok" and df.loc["baseline", "metric_value"] == 0.5
    row = df.loc["lowmembp"]
    assert row["status"] == "invalid" and row["record"] == str(bad) and str(bad) in row["message"]
    assert (row["task"], row["model"], row["batch_size"], row["seed"]) == ("mnist5k", "vit-mnist", 8, 1)
    assert pd.isna(row["metric_value"])


def test_tables_and_figures_leave_invalid_rows_out_and_count_them(tmp_path):
    import aggregate
    import plots
    import table_maths
    import tables

    paths = [_record(_cell(tmp_path, m, s), m, s, v) for m, s, v in
             [("baseline", 0, 0.5), ("baseline", 1, 0.7), ("lowmembp", 0, 0.9)]]
    paths[1].write_text("{")  # the second baseline seed is damaged
    runs_csv = tmp_path / "runs.csv"
    aggregate.main(str(runs_csv), [str(p) for p in paths])
    out = {name: {ext: str(tmp_path / "t" / f"{name}.{ext}") for ext in ("md", "csv", "html")}
           for name in table_maths.RUN_TABLES}
    tables.write_run_tables(runs_csv, out)
    acc = pd.read_csv(out["accuracy"]["csv"]).set_index("method")
    assert acc.loc["baseline", "seeds"] == 1 and acc.loc["baseline", "metric_mean"] == pytest.approx(50)
    assert acc.loc["baseline", "status"] == "ok"  # the damaged seed is not a status of the cell
    for name in table_maths.RUN_TABLES:
        md = Path(out[name]["md"]).read_text()
        assert "Left out: 1 damaged record(s)" in md and str(paths[1]) in md
        assert "Left out: 1 damaged record(s)" in Path(out[name]["html"]).read_text()
    log = tmp_path / "fig.log"
    plots.main(runs_csv, "accuracy", tmp_path / "acc.png", log)
    assert (tmp_path / "acc.png").read_bytes()[:4] == b"\x89PNG" and "1 invalid left out" in log.read_text()


def test_by_hand_a_damaged_record_exits_1_and_the_csv_is_written(tmp_path, capsys):
    import aggregate

    good = _record(_cell(tmp_path, "baseline"), "baseline", 0, 0.5)
    out = tmp_path / "runs.csv"
    assert aggregate.cli([str(out), str(good)]) == 0
    bad = _record(_cell(tmp_path, "lowmembp", 1), "lowmembp", 1, 0.6)
    bad.write_text("{")
    assert aggregate.cli([str(out), str(good), str(bad)]) == 1
    assert "1 of 2 record(s) could not be read" in capsys.readouterr().err
    assert list(pd.read_csv(out)["status"]) == ["ok", "invalid"]

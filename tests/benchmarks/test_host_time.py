"""benchmarks/host_time.py: the host time per call of ours beside the native op, its table and CSV (a tiny run)."""
import csv

import pytest

from script_loader import load_script

host_time = load_script("benchmarks/host_time.py")


def test_tiny_run_writes_the_table_and_csv(tmp_path):
    assert host_time.main(["--ops", "regelu2,ms-layernorm", "--dtypes", "fp32", "--rounds", "3", "--calls", "2",
                           "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "host_time.csv")))
    # 2 ops x 2 shapes x (fwd, fwd+bwd) x (ours, native)
    assert len(rows) == 16 and {r["impl"] for r in rows} == {"ours", "native"}
    ours = [r for r in rows if r["impl"] == "ours"]
    assert all(float(r["host_us"]) > 0 and r["over_native_us"] != "" and float(r["ratio_best"]) > 0 for r in ours)
    assert all(float(r["host_low"]) <= float(r["host_us"]) <= float(r["host_high"]) for r in rows)
    md = (tmp_path / "host_time.md").read_text()
    assert "| regelu2 | 1x8 | fp32 | fwd+bwd |" in md and "median of 3 rounds x 2 calls" in md


def test_bad_arguments_exit_2():
    for argv in (["--ops", "nope"], ["--dtypes", "fp64"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as e:
            host_time.parse_args(argv)
        assert e.value.code == 2

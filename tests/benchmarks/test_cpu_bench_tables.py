"""The CPU benchmarks write their table as the pipeline writes its own (benchmarks/bench_tables.py): the CSV holds
the figures the Markdown shows, the Markdown reads alone (title, machine line with the load, the command) and each
part is a snippets section a docs page can include."""
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from script_loader import load_script
from backends import force_backend

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    return load_script(f"benchmarks/{name}.py")


def test_cpu_ops_writes_a_table_that_reads_alone(tmp_path, monkeypatch):
    force_backend(monkeypatch, None)
    argv = ["--ops", "ms-rmsnorm", "--dtypes", "fp32", "--threads", "1", "--rounds", "1", "--out", str(tmp_path),
            "--malloc", "default"]  # in this process: pytest's worker keeps glibc's own thresholds
    assert _load("cpu_ops").main(argv) == 0
    md = (tmp_path / "cpu_ops.md").read_text()
    csv = pd.read_csv(tmp_path / "cpu_ops.csv")
    assert len(csv) == 1 and csv.loc[0, "op"] == "ms-rmsnorm" and csv.loc[0, "threads"] == 1
    lines = md.splitlines()
    assert lines[0].startswith("# CPU forward + backward") and lines[2].startswith("Machine: ")
    assert re.search(r"load average \(1 min\) [\d.]+–[\d.]+ during the run", lines[2])
    assert "Command: `PYTHONPATH=$PWD python benchmarks/cpu_ops.py" in md
    assert "Allocation: glibc's default malloc thresholds" in md
    assert "<!-- --8<-- [start:threads-1] -->" in md and "<!-- --8<-- [end:threads-1] -->" in md
    row = next(line for line in lines if line.startswith("| ms-rmsnorm 512x4096"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == [f"{csv.loc[0, c]:.2f}" for c in ("native_ms", "ours_ms", "ref_ms")]
    assert cells[5] == f"{csv.loc[0, 'ours/native']:.2f}"
    assert abs(csv.loc[0, "ours/native"] - csv.loc[0, "ours_ms"] / csv.loc[0, "native_ms"]) < 1e-9


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_cpu_ops_holds_freed_memory_by_default_and_says_so(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LOWMEMBP_BACKEND", None)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_ops.py"), "--ops", "ms-rmsnorm", "--dtypes", "fp32",
                    "--threads", "1", "--rounds", "1", "--no-ref", "--out", str(tmp_path)], check=True, env=env,
                   capture_output=True)
    md = (tmp_path / "cpu_ops.md").read_text()
    assert "Allocation: freed memory held for reuse (glibc mmap threshold 32 MiB" in md

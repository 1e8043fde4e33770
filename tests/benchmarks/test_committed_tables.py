"""The committed GPU-run tables are what the code writes from the committed data (so they cannot drift from it),
and every committed result table is one a person reads: at most 10 columns, figures rounded."""
import json
import re
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "results" / "gpu"
REFERENCE = ROOT / "results" / "reference"
MAX_COLUMNS = 10


def _summary(run: Path) -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # gpu_run_summary's own imports are siblings
    try:
        paper = load_script("benchmarks/gpu_run.py").PAPER_FIG1
        summary = load_script("benchmarks/gpu_run_summary.py")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return summary.render_summary(run, json.loads((run / "machine.json").read_text()), paper)


@pytest.mark.parametrize("run, copy", [(GPU, "gpu_run.md"), (GPU / "rerun", "gpu_rerun.md")])
def test_the_gpu_run_summaries_are_written_from_the_committed_data(run, copy):
    text = _summary(run)
    assert (run / "summary.md").read_text() == text, \
        f"python benchmarks/gpu_run_summary.py {run.relative_to(ROOT)} writes it again"
    assert (REFERENCE / "benchmarks" / copy).read_text() == text, f"copy {run / 'summary.md'} there"


def test_the_gpu_check_report_is_written_from_its_json(tmp_path):
    report = json.loads((GPU / "gpu_check" / "gpu_check.json").read_text())
    load_script("benchmarks/gpu_check.py").write_report(tmp_path, report["meta"], report["rows"])
    text = (tmp_path / "gpu_check.md").read_text()
    assert (GPU / "gpu_check" / "gpu_check.md").read_text() == text
    assert (REFERENCE / "benchmarks" / "gpu_check.md").read_text() == text


def _widths(text: str) -> list[int]:
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [len(re.split(r"(?<!\\)\|", line.strip())) - 2 for line in rows]


def test_every_committed_result_table_reads():
    files = sorted(REFERENCE.rglob("*.md")) + [GPU / "summary.md", GPU / "rerun" / "summary.md",
                                               GPU / "gpu_check" / "gpu_check.md"]
    wide = {str(f.relative_to(ROOT)): max(_widths(f.read_text())) for f in files
            if _widths(f.read_text()) and max(_widths(f.read_text())) > MAX_COLUMNS}
    assert not wide, f"tables wider than {MAX_COLUMNS} columns: {wide}"
    long = {str(f.relative_to(ROOT)): m.group(0) for f in files
            for m in [re.search(r"(?<![\w.])\d+\.\d{7,}", f.read_text())] if m}
    assert not long, f"unrounded figures: {long}"
    assert _widths("| a | b \\| c |\n|---|---|\n") == [2, 2]

"""The figures the README and the docs quote in their text come from the result files they cite: each claim below is
the text a page must hold, computed from its source under results/ (so a new run that changes a figure fails here
until the pages say the new one). Tables are included from results/reference instead (tests/test_docs.py)."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "results" / "reference"
GPU = ROOT / "results" / "gpu"


def _match(path: Path, pattern: str) -> re.Match:
    m = re.search(pattern, path.read_text())
    assert m, f"{path.relative_to(ROOT)}: no {pattern!r}"
    return m


def _sweep_minutes() -> tuple[str, str, int]:
    """(training jobs' minutes, reproductions' minutes, their sum rounded) of the default sweep's reference run."""
    m = _match(REFERENCE / "MACHINE.md", r"training jobs ran from .*?: (\d+\.\d) min; reproductions (\d+\.\d) min")
    return m.group(1), m.group(2), round(float(m.group(1)) + float(m.group(2)))


def _evidence_minutes() -> int:
    return round(float(_match(REFERENCE / "evidence" / "evidence.md", r"(\d+(?:\.\d)?) min of wall time").group(1)))


def _copy_range() -> str:
    rows = json.loads((GPU / "gpu_check" / "gpu_check.json").read_text())["rows"]
    pct = [r["pct_copy"] for r in rows if r.get("pct_copy") is not None]
    return f"{min(pct):.0f}-{max(pct):.0f} %"


def _fig1(run: Path, config: str) -> tuple[float, float]:
    """(LowMemoryBP's img/s / LoRA's, its step time / LoRA's) in ``run``'s fig1.csv, configuration ``config``."""
    rows = {r["method"]: r for r in csv.DictReader(open(run / "fig1.csv")) if r["config"] == config}
    ours, lora = rows["lora+lowmembp"], rows["lora"]
    return (float(ours["throughput"]) / float(lora["throughput"]),
            float(ours["step_ms_p50"]) / float(lora["step_ms_p50"]))


def _estimator_range() -> tuple[float, float]:
    ratios = [float(r["ratio"]) for r in csv.DictReader(open(GPU / "estimator_error.csv")) if r["ratio"]]
    return min(ratios), max(ratios)


# (pages, the text they must hold) — each text computed from the result file the page cites
CLAIMS = [
    (["README.md", "docs/getting-started.md"], lambda: f"about {_sweep_minutes()[2]} minutes on"),
    (["README.md", "docs/getting-started.md", "docs/pipeline.md"],
     lambda: f"{_sweep_minutes()[0]} min of training jobs"),
    (["README.md", "docs/getting-started.md", "docs/pipeline.md"],
     lambda: f"{_sweep_minutes()[1]} min of reproductions"),
    (["README.md", "docs/pipeline.md"], lambda: f"took {_evidence_minutes()} min on 2 shared CPU cores"),
    (["README.md", "docs/performance/cpu.md"], lambda: f"{_copy_range()} of the device's copy bandwidth"),
    (["README.md", "docs/performance/cpu.md"], lambda: f"{_fig1(GPU, 'fig1-qkv')[0]:.3f}×"),
    (["README.md", "docs/performance/cpu.md", "docs/gpu-run.md"],
     lambda: f"{_fig1(GPU / 'rerun', 'fig1-qkv')[0]:.3f}×"),
    (["README.md", "docs/gpu-run.md"], lambda: f"{_fig1(GPU, 'fig1-qkv')[1]:.3f}"),
    (["docs/gpu-run.md"], lambda: f"{_fig1(GPU, 'fig1-qkv')[0]:.3f}× / {_fig1(GPU, 'fig1-all')[0]:.3f}×"),
    (["docs/gpu-run.md"], lambda: f"{_fig1(GPU / 'rerun', 'fig1-all')[0]:.3f}×"),
    (["docs/measuring.md", "docs/gpu-run.md"], lambda: "{:.3f}-{:.3f}".format(*_estimator_range())),
    (["README.md"], lambda: f"within {100 * (_estimator_range()[1] - 1):.1f} % of the CUDA allocator's peak"),
]


@pytest.mark.parametrize("pages, text", CLAIMS, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(CLAIMS)])
def test_a_quoted_figure_is_its_sources(pages, text):
    expected = text()
    for page in pages:
        body = " ".join((ROOT / page).read_text().split())  # a figure may sit across a line break
        assert expected in body, f"{page} should say {expected!r} (computed from the result file it cites)"


def test_the_reproductions_page_lists_every_reproduction_of_the_config():
    names = yaml.safe_load((ROOT / "config" / "repro.yaml").read_text())["repro"]["names"]
    page = (ROOT / "docs" / "reproductions" / "index.md").read_text()
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", page, flags=re.M)
    assert sorted(listed) == sorted(names)


def test_no_page_quotes_the_figures_the_results_do_not_hold():
    """Figures that were once quoted and that no committed result holds."""
    stale = {"README.md": ["about 15 minutes", "about an hour", "45-115 %", "0.84×"],
             "docs/getting-started.md": ["about 15 minutes"], "docs/pipeline.md": ["about 15 minutes", "about an hour"],
             "docs/performance/cpu.md": ["45-115 %", "0.84×"], "docs/gpu-run.md": ["60 MB L2"]}
    found = [(page, t) for page, texts in stale.items() for t in texts if t in (ROOT / page).read_text()]
    assert not found, found

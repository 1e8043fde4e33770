"""The result notebooks execute top to bottom (nbclient) on the reference result set kept in git, and fall back to
it when the pipeline has not been run."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.pipeline  # the full suite only: executes the notebooks on the reference results (~75 s)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REFERENCE = ROOT / "results" / "reference"
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
sys.path.insert(0, str(ROOT / "notebooks"))


def test_the_notebooks_are_there():
    assert {p.stem for p in NOTEBOOKS} == {"memory", "speed", "accuracy", "paper_comparison", "planner"}


def test_reference_set_is_real_and_labelled():
    """The reference set is a pipeline output (records validate; the machine that made it is named)."""
    runs = pd.read_csv(REFERENCE / "runs.csv")
    machine = (REFERENCE / "MACHINE.md").read_text()
    assert "command" in machine.lower() and "device" in machine.lower()
    assert len(runs) > 0 and set(runs["status"]) <= {"ok", "oom", "error"}
    assert runs["device"].notna().all() and runs["torch"].notna().all()
    for t in ["memory", "speed", "accuracy", "fig1", "block_breakdown"]:
        assert (REFERENCE / "tables" / f"{t}.csv").exists(), t


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_on_the_reference_set(nb, tmp_path):
    import nbformat
    from run_notebook import execute

    out = tmp_path / nb.name
    executed = execute(nb, REFERENCE, out, timeout=300)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
    assert "results/reference" in text or str(REFERENCE) in text  # says which data it shows
    assert nbformat.read(out, as_version=4).cells


def test_fallback_to_reference_when_nothing_was_run(tmp_path, monkeypatch):
    import resultset

    monkeypatch.delenv("LOWMEMBP_RESULTS", raising=False)
    monkeypatch.setattr(resultset, "ROOT", tmp_path)  # a fresh clone: no results/runs.csv
    where, label = resultset.results_dir()
    assert where == REFERENCE and "reference" in label
    monkeypatch.setenv("LOWMEMBP_RESULTS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="snakemake"):
        resultset.results_dir()


def test_ratio_to_reference_pairs_lora_with_lora():
    import resultset

    df = pd.DataFrame({"task": ["t"] * 4, "model": ["m"] * 4, "batch_size": [8] * 4,
                       "method": ["baseline", "lowmembp", "lora", "lora+lowmembp"], "v": [10.0, 7.0, 8.0, 6.0]})
    r = resultset.ratio_to_reference(df, "v")
    assert r.isna()[0] and r[1] == pytest.approx(0.7) and r[2] == pytest.approx(0.8) and r[3] == pytest.approx(0.75)


@pytest.mark.parametrize("nb", [p for p in NOTEBOOKS if p.stem in ("memory", "speed", "accuracy", "paper_comparison")],
                         ids=lambda p: p.stem)
def test_executed_notebook_shows_its_plots_and_says_what_it_answers(nb, tmp_path):
    """The executed copy holds the figures as image/png outputs (inline backend, no Agg), and the notebook opens
    with a title and two sentences on what it answers."""
    import nbformat
    from run_notebook import execute

    source = nbformat.read(nb, as_version=4)
    assert not any('matplotlib.use("Agg")' in c.source for c in source.cells)
    first = source.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    body = first.source.split("\n", 1)[1]
    assert body.count(". ") + body.strip().endswith(".") >= 2, body
    executed = execute(nb, REFERENCE, tmp_path / nb.name, timeout=300)
    images = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{nb.name}: no image/png output"

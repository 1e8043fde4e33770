"""workflow/scripts/capacity.py: a method the planner could not estimate is marked "not estimated" with the reason
(never drawn as a batch of 0 in the table); when nothing could be estimated the script fails with the reasons."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow" / "scripts"))

GPUS = ["24GiB", "40GiB"]


def use_fake_planner(monkeypatch, statuses: dict):
    """Stand-ins for the planner and the paper-model zoo (the real ones take minutes): one row per method, ``ok``
    (batch 8 in 24 GiB, 16 in 40 GiB) or not estimated with the reason given."""
    def make_plan(model, **kw):
        rows = []
        for method, why in statuses.items():
            if why is None:
                rows.append({"method": method, "status": "ok", "largest_batch": 8, "peak_bytes": 3 * 2**30,
                             "weights": "bf16", "largest_batch_by_gpu": {"40GiB": 16}, "largest_batch_how": "checked"})
            else:
                rows.append({"method": method, "status": "not estimated", "reason": why})
        return SimpleNamespace(rows=rows, settings={"seq_len": 128, "dtype": "bf16"}, sources={"margin": "5 %"})
    monkeypatch.setitem(sys.modules, "lowmembp.plan", SimpleNamespace(make_plan=make_plan))
    monkeypatch.setitem(sys.modules, "lowmembp.estimator.step",
                        SimpleNamespace(MODELS={"bert-large": SimpleNamespace(batch_size=32)}))


def test_a_method_not_estimated_is_named_with_its_reason(monkeypatch, tmp_path, caplog):
    import capacity

    use_fake_planner(monkeypatch, {"baseline": None, "tokentune": "no fake step"})
    df = capacity.capacity({"bert-large": {}}, ["baseline", "tokentune"], GPUS)
    assert "tokentune not estimated: no fake step" in caplog.text
    assert df.set_index(["method", "gpu"])["largest_batch"].fillna(-1).to_dict() == {
        ("baseline", "24GiB"): 8, ("baseline", "40GiB"): 16, ("tokentune", "24GiB"): -1, ("tokentune", "40GiB"): -1}
    out = tmp_path / "capacity"
    capacity.write(df, f"{out}.csv", f"{out}.md", f"{out}.png", GPUS)
    text = Path(f"{out}.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| bert")]
    assert rows == [["bert-large", "baseline", "bf16", "3", "8", "16"],
                    ["bert-large", "tokentune", "-", "not estimated", "not estimated", "not estimated"]]
    assert "Not estimated: bert-large tokentune: no fake step" in text


def test_nothing_estimated_is_a_failure_with_the_reasons(monkeypatch):
    import capacity

    use_fake_planner(monkeypatch, {"baseline": "torch too old", "lora": "no peft"})
    with pytest.raises(RuntimeError, match="nothing could be estimated: bert-large baseline: torch too old; "
                                           "bert-large lora: no peft"):
        capacity.capacity({"bert-large": {}}, ["baseline", "lora"], GPUS)

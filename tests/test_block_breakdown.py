"""benchmarks/block_breakdown.py on fake tensors: the ViT-B/16 block matches the paper's accounting per op kind."""
import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "block_breakdown.py"


@pytest.fixture(scope="module")
def bb():
    spec = importlib.util.spec_from_file_location("block_breakdown", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vit_block_breakdown(bb, capsys):
    base, conv, unit, r = bb.run("vit_b16", "vit", 1, None, "bf16", 1)
    b = {k: v / unit for k, v in base["per_block"].items()}
    c = {k: v / unit for k, v in conv["per_block"].items()}
    # paper: GELU input 4 -> 0.5 (2-bit codes), LayerNorm inputs 4 -> 0 (only rstd), linear inputs 7 unchanged
    assert b["act"] == pytest.approx(4.0, abs=0.01) and c["act"] == pytest.approx(0.5, abs=0.01)
    assert b["norm"] == pytest.approx(4.0, abs=0.05) and c["norm"] < 0.05
    assert b["linear"] == pytest.approx(c["linear"]) == pytest.approx(7.0, abs=0.01)
    saving = 1 - sum(c.values()) / sum(b.values())
    assert 0.36 < saving < 0.45
    lines = bb.table("vit_b16", "vit", base, conv, unit, r)
    assert any("39.47 %" in ln for ln in lines)


def test_theory_numbers(bb):
    tb, tc = bb.theory("vit", 4.0)
    assert 1 - sum(tc.values()) / sum(tb.values()) == pytest.approx(0.3947, abs=1e-4)
    tb, tc = bb.theory("llama", 2.7)
    assert 1 - sum(tc.values()) / sum(tb.values()) == pytest.approx(0.2919, abs=1e-4)

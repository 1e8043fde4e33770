"""experiments.repro.estimator_error: its numbers are the estimator's and the CPU allocator's, and the table in the
docs (results/reference) holds the same numbers the functions give."""
from pathlib import Path

import pandas as pd
import pytest

from experiments.repro.estimator_error import FAMILIES, KiB, TINY_OPTIONS, allocator_peak, estimator_error
from lowmembp.estimator.step import estimate

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference" / "repro" / "estimator-error.csv"


def _estimate(family, method):
    name, kw = FAMILIES[family]
    return estimate(name, method, dtype="fp32", **kw, **TINY_OPTIONS.get(method, {}))["peak"]["bytes"]


def test_rows_are_the_estimate_and_the_allocator_peak():
    df = estimator_error(small=True, families=("bert",))
    assert list(df["method"]) == ["baseline", "lora", "checkpointing"]
    name, kw = FAMILIES["bert"]
    for r in df.itertuples(index=False):
        assert r.estimate_KiB * KiB == _estimate("bert", r.method)
        real = allocator_peak(name, r.method, dtype="fp32", **kw)
        assert r.cpu_allocator_KiB * KiB == real
        assert getattr(r, "_5") == pytest.approx(100 * (r.estimate_KiB - r.cpu_allocator_KiB) / r.cpu_allocator_KiB)
        assert abs(r.estimate_KiB - r.cpu_allocator_KiB) <= 0.05 * r.cpu_allocator_KiB   # within 5 %


def test_the_reference_table_holds_the_functions_numbers():
    ref = pd.read_csv(REFERENCE)
    assert set(ref["family"]) == set(FAMILIES)
    ok = ref.dropna(subset=["estimate_KiB"])
    assert len(ok) >= 3 * len(FAMILIES) and ok["note"].isna().all()
    for family in FAMILIES:   # the estimate is exact and machine-independent: the same to the byte
        row = ok[(ok["family"] == family) & (ok["method"] == "lora")].iloc[0]
        assert row["estimate_KiB"] * KiB == _estimate(family, "lora")
    err = 100 * (ok["estimate_KiB"] - ok["cpu_allocator_KiB"]) / ok["cpu_allocator_KiB"]
    assert (ok["error_%"] - err).abs().max() < 1e-9

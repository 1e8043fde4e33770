"""benchmarks/gpu_check.py: its CPU smoke run passes and reports, a wrong kernel makes it fail, no CUDA exits 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_loader import load_script
from backends import force_backend

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load():
    return load_script("benchmarks/gpu_check.py")


def test_cpu_smoke_runs_every_present_op_and_writes_the_report(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert rows and all(r["ok"] for r in rows)
    ops = {r["op"] for r in rows}
    assert {"regelu2", "resilu2"} <= ops
    for present, names in [("ms_norm", {"ms_layernorm", "ms_rmsnorm"}), ("mesa_quant", {"mesa_quantize"})]:
        if (ROOT / "lowmembp" / "ops" / f"{present}.py").exists():
            assert names <= ops, f"{present} exists but was not checked"
    for op in ("regelu2", "resilu2"):
        dirs = {r["dir"] for r in rows if r["op"] == op}
        assert {"fwd", "bwd", "api", "64b"} <= dirs
        assert {r["dtype"] for r in rows if r["op"] == op} >= {"float32", "bfloat16"}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| regelu2 fwd |" in md and "% of copy" in md


def test_a_wrong_kernel_fails_the_run(tmp_path, monkeypatch):
    gc = _load()
    from lowmembp.ops import approx_act
    force_backend(monkeypatch, "triton")  # main() sets it in smoke mode; restored after the test
    real = approx_act.backward_triton
    monkeypatch.setattr(approx_act, "backward_triton", lambda dy, p, k: real(dy, p, k) * 1.5)
    rc = gc.main(["--cpu-smoke", "--skip-large", "--ops", "approx_act", "--out", str(tmp_path)])
    assert rc == 1
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert {r["dir"] for r in rows if not r["ok"]} >= {"bwd"}
    assert all(r["ok"] for r in rows if r["dir"] == "fwd")


def test_unknown_op_is_a_failure(tmp_path, monkeypatch):
    force_backend(monkeypatch, "triton")
    assert _load().main(["--cpu-smoke", "--ops", "no_such_op", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("ops", ["", "ghost_op"])
def test_nothing_checked_is_a_failure(tmp_path, monkeypatch, capsys, ops):
    """No op named, or every named op skipped (its module absent): nothing was checked, exit 1 with the reason."""
    force_backend(monkeypatch, "triton")
    gc = _load()
    monkeypatch.setitem(gc.CHECKS, "ghost_op", lambda *args: None)  # a check whose lowmembp/ops module is absent
    assert gc.main(["--cpu-smoke", "--ops", ops, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "nothing was checked" in err and "approx_act" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_it_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr

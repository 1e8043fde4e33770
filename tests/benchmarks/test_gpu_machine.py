"""benchmarks/gpu_machine.py: the carried wheels are installed where missing; machine.json names the commit the
tree was sent from, not a copied tree's own .git."""
import importlib
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the full suite only, beside the prepared GPU run's other tests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

gpu_machine = importlib.import_module("gpu_machine")
gpu_run = importlib.import_module("gpu_run")


def _ctx(tmp_path, smoke=False):
    return gpu_run.Ctx(gpu_run.parse_args(["--out", str(tmp_path / "o"), "--third-party", str(tmp_path / "tp")]
                                          + (["--cpu-smoke"] if smoke else [])))


@pytest.mark.parametrize("label", sorted(gpu_machine.CARRIED))
def test_carried_wheels_are_installed_when_missing(label, tmp_path, monkeypatch):
    """liger-kernel and cut-cross-entropy: installed from third_party/wheels when not importable (here made to look
    missing, whether or not they are installed)."""
    import importlib.util
    import zipfile
    module = gpu_machine.CARRIED[label]
    hidden, find = {module}, importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else find(name, *a))
    wheels = tmp_path / "tp" / "wheels"
    wheels.mkdir(parents=True)
    name = f"{module}-0.8.99"
    with zipfile.ZipFile(wheels / f"{name}-py3-none-any.whl", "w") as z:  # a stand-in wheel: pip installs it offline
        z.writestr(f"{module}/__init__.py", "STAND_IN = True\n")
        z.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.8.99\n")
        z.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    ctx = _ctx(tmp_path)
    line = gpu_machine.ensure_liger(ctx) if label == "liger" else gpu_machine.ensure_carried(ctx, label)
    assert line.startswith(f"{label}: installed") and "0.8.99" in line, line
    site = tmp_path / f"lowmembp_{label}_site"
    assert (site / module / "__init__.py").is_file() and str(site) == sys.path[0]
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    hidden.clear()
    assert gpu_machine.ensure_carried(_ctx(tmp_path, smoke=True), label) == f"{module} importable as installed"


def test_machine_json_takes_the_commit_the_tree_was_sent_from(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    monkeypatch.delenv("GPU_RUN_COMMIT", raising=False)
    assert gpu_machine.commit_sent(ctx) is None
    (tmp_path / "tp").mkdir()
    (tmp_path / "tp" / "COMMIT").write_text("abc123 dirty\n")
    got = gpu_machine.commit_sent(ctx)
    assert got["commit"] == "abc123" and got["dirty"] is True and "prepare_gpu_run.sh" in got["how"]
    monkeypatch.setenv("GPU_RUN_COMMIT", "def456")
    got = gpu_machine.commit_sent(ctx)
    assert got["commit"] == "def456" and got["how"] == "$GPU_RUN_COMMIT"
    facts = gpu_machine.machine_facts(ctx, [])
    assert facts["git"]["commit"] == "def456"  # not the copied tree's own .git

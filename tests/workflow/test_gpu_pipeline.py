"""The pipeline on a GPU machine, checked on the CPU: sweeps on generated data (synthetic_data), the GPU smoke sweep's
config, and one GPU per training job (run_cell.py's claim on a machine with several)."""
from __future__ import annotations

import copy
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow"))
import sweep_config  # noqa: E402

SYNTHETIC = {"sweeps": {"vit": {"tasks": [{"task": "cifar100", "model": "vit-b16"}], "methods": ["lora",
                                                                                             "lora+lowmembp"],
                                "batch_sizes": [64], "steps": 5, "dtype": "fp16", "synthetic_data": True}}}


def checked(cfg):
    cfg = sweep_config.fill_defaults(copy.deepcopy(cfg))
    sweep_config.check(cfg, ROOT)
    return cfg


def test_a_synthetic_sweep_passes_its_flag_to_every_cell():
    cfg = checked(SYNTHETIC)
    sw = cfg["sweeps"]["vit"]
    argv = sweep_config.cell_argv(sw, "cifar100", "vit-b16", "lora", 64, 0)
    assert "--synthetic-data" in argv
    plain = sweep_config.cell_argv(dict(sw, synthetic_data=False), "cifar100", "vit-b16", "lora", 64, 0)
    assert "--synthetic-data" not in plain  # a sweep without the key writes the command lines it always did


def test_synthetic_data_on_an_offline_task_is_refused_at_parse_time():
    cfg = copy.deepcopy(SYNTHETIC)
    cfg["sweeps"]["vit"]["tasks"] = [{"task": "mnist5k", "model": "vit-mnist"}]
    with pytest.raises(sweep_config.ConfigError, match="synthetic_data is for the paper tasks"):
        checked(cfg)
    cfg = copy.deepcopy(SYNTHETIC)
    cfg["sweeps"]["vit"]["train_args"] = ["--synthetic-data"]
    with pytest.raises(sweep_config.ConfigError, match="set by the pipeline from synthetic_data"):
        checked(cfg)


def test_the_gpu_smoke_sweep_is_a_few_synthetic_gpu_cells_one_family_each():
    cfg = yaml.safe_load((ROOT / "config" / "gpu-smoke.yaml").read_text())
    cfg = checked(cfg)
    cells = sweep_config.cells(cfg)
    assert 3 <= len(cells) <= 5
    models = {key[1] for key in cells}
    assert models == {"vit-b16", "roberta-base", "llama-7b"}  # one per model family
    for _, sw in cells.values():
        assert sw["synthetic_data"] and sw["resources"]["gpu"] == 1
    assert all(any("lowmembp" in key[2] for key in cells if key[1] == m) for m in models)


def test_claim_gpu_hands_each_job_a_gpu_no_other_job_holds(tmp_path):
    run_cell = load_script("workflow/scripts/run_cell.py")
    a, fa = run_cell.claim_gpu(2, tmp_path)
    b, fb = run_cell.claim_gpu(2, tmp_path)
    c, fc = run_cell.claim_gpu(2, tmp_path)
    assert (a, b, c, fc) == (0, 1, None, None)
    fa.close()  # the job on GPU 0 ended: its GPU is free again
    d, fd = run_cell.claim_gpu(2, tmp_path)
    assert d == 0
    fb.close()
    fd.close()


def test_a_job_on_a_machine_with_several_gpus_sees_only_its_own(tmp_path, monkeypatch):
    """run_cell.py with a stand-in nvidia-smi listing two GPUs and a stand-in interpreter that writes the
    CUDA_VISIBLE_DEVICES it got into the record's place."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\n")
    py = bin_dir / "fakepy"
    py.write_text('#!/bin/sh\nfor a; do last=$a; done\necho "${CUDA_VISIBLE_DEVICES:-unset}" > "$last"\n')
    for f in (smi, py):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_cell = load_script("workflow/scripts/run_cell.py")
    assert run_cell.gpu_count() == 2
    out = tmp_path / "r.json"
    held = run_cell.claim_gpu(2)  # another job holds GPU 0
    assert held[0] == 0
    rc = run_cell.main(["--out", str(out), "--log", str(tmp_path / "log"), "--python", str(py), "--nproc", "1",
                        "--", "--task", "x"])
    assert rc == 0 and out.read_text().strip() == "1"
    held[1].close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # set by the scheduler (SLURM): left as it is
    rc = run_cell.main(["--out", str(out), "--log", str(tmp_path / "log"), "--python", str(py), "--nproc", "1",
                        "--", "--task", "x"])
    assert rc == 0 and out.read_text().strip() == "3"


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [0, 2])
def test_training_cells_claim_a_gpu_exactly_when_the_machine_has_one(gpus, tmp_path):
    """`snakemake -n` of the default sweep with torch seeing ``gpus`` GPUs (a sitecustomize stands in for CUDA): on a
    GPU machine every training cell asks for `gpu=1` (and the run's gpu resource is the GPU count); without CUDA
    none does, as before."""
    import subprocess

    (tmp_path / "sitecustomize.py").write_text(
        f"import torch\ntorch.cuda.is_available = lambda: {gpus > 0}\ntorch.cuda.device_count = lambda: {gpus}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    train = [line for line in text.splitlines() if "resources:" in line and "runtime=30" in line]
    cells = len(sweep_config.cells(sweep_config.fill_defaults(yaml.safe_load((ROOT / "config" / "config.yaml")
                                                                             .read_text()))))
    assert len(train) == cells and all(f"gpu={1 if gpus else 0}," in line for line in train), train[:2]

"""Test set-up: Triton runs through its interpreter on machines without CUDA; `gpu` tests skip there.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The tiers: files whose every test belongs to the full suite only (`pytest -m ""`), by what makes them long on
# 2 cores (times of the full suite on 2 loaded cores, per file). Single slow tests elsewhere carry @pytest.mark.slow.
TIERS = {
    "workflow/test_workflow.py": "pipeline",        # Snakemake dry runs and a tiny pipeline run (~250 s)
    "workflow/test_pipeline_faults.py": "pipeline",  # interrupted and failing pipeline runs (~350 s)
    "workflow/test_notebooks.py": "pipeline",       # executes the notebooks on the reference results (~75 s)
    "models/test_coverage_matrix.py": "slow",       # every method x 20 architectures (~120 s)
    "methods/test_compile_method.py": "slow",       # torch.compile'd models (~80 s)
    "methods/test_methods_compose.py": "slow",      # every pair of methods (~60 s)
    "experiments/test_repro_compiled_budget.py": "slow",
    "experiments/test_repro_compiled_saving.py": "slow",
    "experiments/test_distributed.py": "slow",      # DDP / FSDP in 2 processes
    "ops/test_ops_compile.py": "slow",
    "plan/test_plan_pool.py": "slow",
    "plan/test_plan_fast.py": "slow",
    "benchmarks/test_gpu_run.py": "slow",           # the prepared GPU run's CPU smoke
    "test_readme.py": "slow",                       # runs the README's code blocks
}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath / "tests"
    for item in items:
        try:
            rel = item.path.relative_to(root).as_posix()
        except ValueError:
            continue
        if rel in TIERS:
            item.add_marker(getattr(pytest.mark, TIERS[rel]))
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def triton_backend(monkeypatch):
    """Force the Triton kernels (interpreted on CPU) for the duration of a test."""
    from backends import force_backend  # (here: lowmembp, and triton with it, load after TRITON_INTERPRET is set)
    force_backend(monkeypatch, "triton")
    yield


@pytest.fixture
def torch_backend(monkeypatch):
    """Force the PyTorch reference ops for the duration of a test."""
    from backends import force_backend
    force_backend(monkeypatch, "torch")
    yield

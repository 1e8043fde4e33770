"""Test set-up: Triton runs through its interpreter on machines without CUDA; `gpu` tests skip there.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The tiers: a test file whose every test belongs to the full suite only (`pytest -m ""`) says so where it is
# defined (`pytestmark = pytest.mark.slow` or `.pipeline`); single slow tests carry @pytest.mark.slow.


def pytest_collection_modifyitems(config, items):
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

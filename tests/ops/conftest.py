"""Fixtures of the ops' tests: threads, fresh random generators, and the CPU kernels as built here or portably."""
import ctypes
import os

import pytest
import torch

from lowmembp.ops import cpu_kernels as K
from lowmembp.ops.cpu_kernels import build as KB

from cpp_nodes import use_route


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run the test with torch on one thread, then on two."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run


@pytest.fixture(scope="module")
def portable_library(tmp_path_factory):
    """The kernels built with the portable flags alone (no -march=native: the plain C loops, not the AVX-512 ones;
    fmaf from the C library)."""
    if K.compiler() is None:
        return None
    old_sets = KB._FLAG_SETS
    KB._FLAG_SETS = (K.FLAGS,)
    try:
        return KB._declare(ctypes.CDLL(str(KB._build(tmp_path_factory.mktemp("portable"), K.compiler()))))
    finally:
        KB._FLAG_SETS = old_sets


@pytest.fixture(params=["native", "portable"])
def kernels(request, monkeypatch, portable_library):
    """The C kernels loaded, as this machine builds them or as the portable build (its name returned); a test fails,
    not skips, where a compiler exists and the build does not work."""
    monkeypatch.setattr(KB, "_OFF", False)
    lib = K.library()
    assert lib is not None, f"the C kernels did not build: {K.build_info()['reason']}"
    if request.param == "portable":
        monkeypatch.setitem(KB._state, "lib", portable_library)
    return request.param


@pytest.fixture(params=["node", "python"])
def norm_route(request, monkeypatch):
    """The MS-norms' eager CPU route: the C++ autograd node or the Python route (tests/cpp_nodes.py)."""
    from lowmembp.ops import ms_norm_cpu as MC
    return use_route(monkeypatch, MC, request.param)


@pytest.fixture(params=["node", "python"])
def act_route(request, monkeypatch):
    """approx_act's eager CPU route with grad: the C++ autograd node or the Python route (tests/cpp_nodes.py)."""
    from lowmembp.ops import approx_act_cpu as AC
    return use_route(monkeypatch, AC, request.param)

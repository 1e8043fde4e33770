"""lowmembp.ops.launch.Launcher: the compiled kernel of each signature looked up once, then started directly; and
the adapter to Triton's compiled kernel (lowmembp._compat.triton_compiled_launcher). The CUDA side runs here on
stand-ins for the kernel and its compiled form (what Triton returns from ``kernel[grid](...)``); tests marked gpu
run it for real."""
import contextlib

import pytest
import torch

from lowmembp import _compat
from lowmembp.ops import launch as L


class _Compiled:
    """Stands in for Triton's CompiledKernel: ``run(grid0, grid1, grid2, stream, function, metadata, launch_metadata,
    enter_hook, exit_hook, *args)`` and ``compiled[grid](*args, stream=...)``."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs, self.hooked = [], []

    def run(self, *a):
        self.runs.append(a)

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.hooked.append((grid, stream, args))


class _Kernel:
    """Stands in for a @triton.jit kernel with two runtime parameters and two constexprs."""

    arg_names = ["x_ptr", "n", "KIND", "BLOCK"]

    def __init__(self):
        self.slow, self.compiled = [], []

    def __getitem__(self, grid):
        def run(*args, num_warps, **constexprs):
            self.slow.append((grid, args, constexprs, num_warps))
            c = _Compiled()
            self.compiled.append(c)
            return c
        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(L, "cuda_current_device", lambda: 0)
    monkeypatch.setattr(L, "cuda_raw_stream", lambda index: 77)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(L, "triton_compiled_launcher", _compat.triton_compiled_launcher)


def test_first_launch_compiles_later_ones_start_the_compiled_kernel(fake_cuda):
    k = _Kernel()
    launcher = L.Launcher(k)
    x = torch.empty(64)
    launcher(3, (x, 4096), (1, 512), 8, device=0)
    assert len(k.slow) == 1 and k.slow[0][2] == {"KIND": 1, "BLOCK": 512} and k.slow[0][3] == 8
    launcher(5, (x, 8192), (1, 512), 8, device=0)  # the same signature: n is again a multiple of 16
    assert len(k.slow) == 1 and launcher.direct == 1
    (run,) = k.compiled[0].runs
    assert run == (5, 1, 1, 77, "fn", "meta", None, None, None, x, 8192, 1, 512)


@pytest.mark.parametrize("change", ["n odd", "n one", "n 64-bit", "dtype", "unaligned", "constexpr", "warps",
                                    "device"])
def test_a_new_signature_compiles_again(change, fake_cuda, monkeypatch):
    """Each thing Triton specialises on makes a new signature: the slow launch (which compiles or finds the kernel
    for it), never the compiled kernel of another."""
    k = _Kernel()
    launcher = L.Launcher(k)
    x = torch.empty(64)
    launcher(1, (x, 4096), (1, 512), 8, device=0)
    args, const, warps, dev = (x, 4096), (1, 512), 8, 0
    if change == "n odd":
        args = (x, 4097)
    elif change == "n one":
        args = (x, 1)
    elif change == "n 64-bit":
        args = (x, 2 ** 31 + 16)
    elif change == "dtype":
        args = (x.half(), 4096)
    elif change == "unaligned":
        args = (x[1:], 4096)
    elif change == "constexpr":
        const = (2, 512)
    elif change == "warps":
        warps = 4
    else:
        monkeypatch.setattr(L, "cuda_current_device", lambda: 1)
        dev = 1
    launcher(1, args, const, warps, device=dev)
    assert len(k.slow) == 2 and launcher.direct == 0


def test_another_current_device_takes_the_slow_launch(fake_cuda, monkeypatch):
    k = _Kernel()
    launcher = L.Launcher(k)
    x = torch.empty(64)
    launcher(1, (x, 16), (1, 512), 8, device=0)
    monkeypatch.setattr(L, "cuda_current_device", lambda: 1)  # the tensors' device is not the current one
    launcher(1, (x, 16), (1, 512), 8, device=0)
    assert len(k.slow) == 2 and launcher.direct == 0


def test_cpu_tensors_take_the_interpreter_launch_every_time():
    k = _Kernel()
    launcher = L.Launcher(k)
    x = torch.empty(64)
    for _ in range(3):
        launcher(1, (x, 16), (1, 512), 8)  # device -1: CPU tensors
    assert len(k.slow) == 3 and launcher.direct == 0


def test_compiled_launcher_calls_hooks_through_the_public_launch(monkeypatch):
    """With a launch hook installed (a profiler), the launch goes through ``compiled[grid](*args)``, which calls it."""
    pytest.importorskip("triton")
    from triton import knobs

    c = _Compiled()
    launch = _compat.triton_compiled_launcher(c)
    launch(2, 1, 1, 5, "a", 3)
    assert c.runs == [(2, 1, 1, 5, "fn", "meta", None, None, None, "a", 3)] and not c.hooked
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch(2, 1, 1, 5, "a", 3)
    assert c.hooked == [((2, 1, 1), 5, ("a", 3))] and len(c.runs) == 1


def test_compiled_launcher_refuses_another_triton():
    """A compiled kernel without the expected pieces: None (the caller keeps the ordinary launch)."""
    class Other:
        run = None
    assert _compat.triton_compiled_launcher(Other()) is None
    assert _compat.triton_compiled_launcher(object()) is None


@pytest.mark.gpu
def test_cuda_launches_start_the_compiled_kernel_and_equal_the_reference():
    """On a GPU: the second call of a signature starts the compiled kernel directly, and its result is the
    reference's (the codes bitwise, the gradient bitwise)."""
    from lowmembp.ops import approx_act as A
    from lowmembp.ops import approx_act_triton as AT

    x = (torch.randn(3, 1000, device="cuda") * 3).requires_grad_()
    dy = torch.randn(3, 1000, device="cuda")
    before = AT._FWD.direct
    for _ in range(3):
        y = A.regelu2(x)
        (g,) = torch.autograd.grad(y, x, dy)
    assert AT._FWD.direct - before >= 2
    _, packed_ref = A.forward_reference(x.detach(), "gelu")
    _, packed = A.forward_triton(x.detach(), "gelu")
    assert torch.equal(packed, packed_ref)
    assert torch.equal(g, A.backward_reference(dy, packed_ref, "gelu"))

"""The ops inside a CUDA graph: their forward and backward read nothing back to the host and branch on no data, and
Mesa's rounding seed is drawn on the device while a graph is captured (so that every replay rounds anew).

Here (no GPU) the Triton route runs through Triton's interpreter with a capture simulated (the ops' one question,
``stream_capturing()``, answered yes); wrappers on torch.Tensor's methods record every read of a tensor's value into
Python made by lowmembp's own code (``bool``, ``int``, ``float``, ``item``, ``tolist``: a host synchronisation on a
GPU, and an error while a graph is captured). The tests marked gpu capture real graphs."""
import sys

import pytest
import torch

from backends import force_backend
from lowmembp.ops import backend, mesa_quant
from lowmembp.ops.approx_act import regelu2, resilu2
from lowmembp.ops.mesa_layers import MesaAct, MesaLinear
from lowmembp.ops.ms_norm import ms_layer_norm, ms_rms_norm

_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist")


class HostReads:
    """Records (method, file:line) of every read of a tensor's value into Python whose caller is lowmembp's own code
    (the methods wrapped on torch.Tensor for the block; Triton's interpreter and torch's own reads are left out)."""

    def __init__(self, monkeypatch):
        self.seen, self._mp = [], monkeypatch

    def __enter__(self):
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._mp.setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        self._mp.undo()  # (the test's monkeypatch: everything it set so far is restored here)
        return False

    def _wrap(self, name, original):
        seen = self.seen

        def read(t, *args, **kwargs):
            f = sys._getframe(1)
            while f is not None and "/torch/" in f.f_code.co_filename:
                f = f.f_back
            if f is not None and "/lowmembp/" in f.f_code.co_filename:
                seen.append(f"{name} at {f.f_code.co_filename.split('/lowmembp/')[-1]}:{f.f_lineno}")
            return original(t, *args, **kwargs)
        return read


@pytest.fixture
def captured(monkeypatch):
    """The Triton route (Triton's interpreter here) with a capture simulated."""
    force_backend(monkeypatch, "triton")
    monkeypatch.setattr(backend, "stream_capturing", lambda: True)
    monkeypatch.setattr(mesa_quant, "stream_capturing", lambda: True)


@pytest.mark.parametrize("op", ["regelu2", "resilu2", "ms_layer_norm", "ms_rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowmembp_ops_read_nothing_back(op, dtype, captured, monkeypatch, gen):
    fn = {"regelu2": regelu2, "resilu2": resilu2, "ms_layer_norm": ms_layer_norm, "ms_rms_norm": ms_rms_norm}[op]
    x = (torch.randn(3, 5, 24, generator=gen) * 3).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 24, generator=gen).to(dtype)
    with HostReads(monkeypatch) as reads:
        (g,) = torch.autograd.grad(fn(x), x, dy)
    assert reads.seen == [] and g.shape == x.shape


@pytest.mark.parametrize("layer", ["linear", "act"])
def test_mesa_layers_read_nothing_back_and_draw_the_seed_on_the_device(layer, captured, monkeypatch, gen):
    drawn = []
    draw = mesa_quant.draw_seed_tensor
    monkeypatch.setattr(mesa_quant, "draw_seed_tensor", lambda device=None: drawn.append(device) or draw(device))
    m = MesaLinear.from_linear(torch.nn.Linear(24, 16)) if layer == "linear" else MesaAct("gelu")
    x = (torch.randn(3, 5, 24, generator=gen) * 3).requires_grad_()
    with HostReads(monkeypatch) as reads:
        y = m(x)
        (g,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert reads.seen == [] and g.shape == x.shape
    assert drawn and all(d is not None and torch.device(d) == x.device for d in drawn)  # x's device, not the CPU's


def test_mesa_device_seed_equals_the_int_seed(gen):
    """The kernel reading its seed from a device tensor rounds exactly as with the same seed passed as an int."""
    x = torch.randn(4, 33, 16, generator=gen) * 2
    scale, beta = torch.full((4,), 20.0), torch.full((4,), -3.0)
    q_int = mesa_quant._quantize_triton(x, scale, beta, 4, 4, 12345)
    q_dev = mesa_quant._quantize_triton(x, scale, beta, 4, 4, torch.tensor(12345))
    assert torch.equal(q_int, q_dev)
    assert torch.equal(q_int, mesa_quant.quantize_ref(x, scale, beta, 4, 4, 12345))


def test_outside_a_capture_the_eager_seed_comes_from_the_cpu_generator(monkeypatch, gen):
    """Eager calls draw from torch's CPU generator (torch.manual_seed reproduces a run, and no device launch)."""
    force_backend(monkeypatch, "triton")
    x = torch.randn(2, 8, 16, generator=gen)
    torch.manual_seed(3)
    a = mesa_quant.quantize(x, torch.full((1,), 8.0), torch.full((1,), -4.0), 16, 1)
    torch.manual_seed(3)
    b = mesa_quant.quantize(x, torch.full((1,), 8.0), torch.full((1,), -4.0), 16, 1)
    assert torch.equal(a.codes, b.codes)


@pytest.mark.gpu
def test_cuda_graph_replays_round_differently_and_lowmembp_equals_eager():
    """A captured Mesa quantise rounds with a new seed at every replay; a captured ReGELU2 + MS-LayerNorm step gives
    the eager step's gradient."""
    x = torch.randn(8, 197, 64, device="cuda") * 2
    scale, beta = torch.full((64,), 20.0, device="cuda"), torch.full((64,), -6.0, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        mesa_quant.quantize(x, 255.0 / scale, beta, 1, 64)  # warm-up: compiles the kernel
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q = mesa_quant.quantize(x, 255.0 / scale, beta, 1, 64)
    g.replay()
    first = q.codes.clone()
    g.replay()
    assert not torch.equal(first, q.codes)  # a fresh seed each replay
    xin = torch.randn(16, 197, 768, device="cuda", requires_grad=True)
    dy = torch.randn(16, 197, 768, device="cuda")

    def step():
        return torch.autograd.grad(regelu2(ms_layer_norm(xin)), xin, dy)[0]

    eager = step()
    with torch.cuda.stream(s):
        step()
    torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        out = step()
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

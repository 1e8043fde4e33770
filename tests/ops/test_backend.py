"""lowmembp.ops.backend.eager_backend: where the ops call their kernels through a plain autograd.Function rather than
their torch.library custom op, and that both routes give the same outputs, saved bytes and gradients."""
import pytest
import torch

from lowmembp.ops import approx_act as A
from lowmembp.ops import mesa_quant as Q
from lowmembp.ops import ms_norm as N
from lowmembp.ops.backend import eager_backend
from backends import force_backend

KERNEL_BACKENDS = ["cpu", "triton"]  # triton: Triton's interpreter on CPU tensors (tests/conftest.py sets it)


def _refuse(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"the custom op {name} ran on an eager tensor with a kernel backend")
    return fail


def _reference_then_eager(fn, x, dy, backend, monkeypatch, module, ops):
    """(y_ref, g_ref) through the custom op on the reference, then (y, g, saved) on ``backend`` with ``module``'s
    custom ``ops`` refused: the eager route only."""
    force_backend(monkeypatch, "torch")
    y_ref = fn(x)
    (g_ref,) = torch.autograd.grad(y_ref, x, dy)
    force_backend(monkeypatch, backend)
    for op in ops:
        monkeypatch.setattr(module, op, _refuse(op))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fn(x)
    (g,) = torch.autograd.grad(y, x, dy)
    return y_ref, g_ref, y, g, saved


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_eager_backend_of_plain_tensors(backend, monkeypatch):
    force_backend(monkeypatch, backend)
    x = torch.randn(3, 8)
    assert eager_backend(x) == (None if backend == "torch" else backend)
    assert eager_backend(torch.empty(3, 8, device="meta")) is None
    from lowmembp._compat import FakeTensorMode
    with FakeTensorMode():
        assert eager_backend(torch.empty(3, 8)) is None
    seen = []
    torch.func.vmap(lambda r: seen.append(eager_backend(r)) or r)(x)
    torch.func.grad(lambda r: seen.append(eager_backend(r)) or r.sum())(x)
    assert seen == [None, None]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("kind", ["gelu", "silu"])
def test_act_skips_the_custom_op_and_equals_it(backend, kind, monkeypatch, gen):
    x = (torch.randn(5, 37, generator=gen) * 3).requires_grad_()
    dy = torch.randn(5, 37, generator=gen)
    y_ref, g_ref, y, g, saved = _reference_then_eager(lambda t: A.approx_act(t, kind), x, dy, backend, monkeypatch,
                                                      A, ["_approx_act_fwd", "_approx_act_bwd"])
    assert [t.dtype for t in saved] == [torch.uint8] and saved[0].numel() == A.saved_bytes(x.numel())
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)  # Triton's erf/exp: within fp32 roundings
    assert torch.equal(g, g_ref)  # codes and slopes: bitwise


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_act_double_backward_goes_through_the_custom_op(backend, monkeypatch, gen):
    force_backend(monkeypatch, backend)
    x = torch.randn(4, 16, generator=gen).requires_grad_()
    calls = []
    op = A._approx_act_bwd
    monkeypatch.setattr(A, "_approx_act_bwd", lambda *a: calls.append(1) or op(*a))
    (g,) = torch.autograd.grad(A.regelu2(x).sum(), x, create_graph=True)
    assert calls == [1]
    (g_plain,) = torch.autograd.grad(A.regelu2(x).sum(), x)
    assert calls == [1] and torch.equal(g, g_plain)  # without create_graph: the kernel directly


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("fn", [N.ms_layer_norm, N.ms_rms_norm], ids=["layernorm", "rmsnorm"])
def test_norm_skips_the_custom_op_and_equals_it(backend, fn, monkeypatch, gen):
    x = (torch.randn(6, 40, generator=gen) * 2 + 0.5).requires_grad_()
    dy = torch.randn(6, 40, generator=gen)
    y_ref, g_ref, y, g, saved = _reference_then_eager(fn, x, dy, backend, monkeypatch, N,
                                                      ["_ms_norm_fwd_op", "_ms_norm_bwd_op"])
    assert saved[0] is y and saved[1].shape == (6,)  # the output itself (shared with the next linear) and rstd
    tol = 1e-6 if backend == "triton" else 0  # the CPU fast path is bitwise the reference; Triton within fp32 ulps
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(g, g_ref, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_norm_double_backward_is_refused_on_the_eager_route(backend, monkeypatch, gen):
    force_backend(monkeypatch, backend)
    x = torch.randn(3, 24, generator=gen).requires_grad_()
    (g,) = torch.autograd.grad((N.ms_layer_norm(x) * torch.randn(3, 24, generator=gen)).sum(), x,
                               create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_mesa_skips_the_custom_op_and_equals_it(backend, monkeypatch, gen):
    x = torch.randn(4, 6, 32, generator=gen)
    alpha, beta = torch.full((4,), 5.0), torch.full((4,), -2.5)
    force_backend(monkeypatch, "torch")
    q_ref = Q.quantize(x, alpha, beta, inner=1, groups=4, seed=11)
    x_ref = Q.dequantize(q_ref)
    force_backend(monkeypatch, backend)
    monkeypatch.setattr(Q, "_mesa_quantize_op", _refuse("mesa_quantize"))
    monkeypatch.setattr(Q, "_mesa_dequantize_op", _refuse("mesa_dequantize"))
    q = Q.quantize(x, alpha, beta, inner=1, groups=4, seed=11)
    assert torch.equal(q.codes, q_ref.codes)
    assert torch.equal(Q.dequantize(q), x_ref)


def test_fake_tensors_take_the_custom_op(monkeypatch):
    force_backend(monkeypatch, "cpu")
    from lowmembp._compat import FakeTensorMode
    calls = []
    op = A._approx_act_fwd
    monkeypatch.setattr(A, "_approx_act_fwd", lambda *a: calls.append(1) or op(*a))
    with FakeTensorMode():
        y = A.regelu2(torch.empty(2, 8, requires_grad=True))
    assert calls == [1] and y.shape == (2, 8)


def test_dispatch_modes_see_the_custom_op_whole(monkeypatch):
    """Under a TorchDispatchMode (here the memory tracker's base class) the ops go through their custom op, whose CPU
    implementation is the fast path: the mode sees one op per call and its outputs, not the fast path's inner ops;
    the values are those of the eager route."""
    force_backend(monkeypatch, None)  # the default: the fast path on CPU tensors
    from lowmembp._compat import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 64)
    assert eager_backend(x) == "cpu"
    want = N.ms_layer_norm(x)
    with Seen() as seen:
        assert eager_backend(x) is None
        y = N.ms_layer_norm(x)
    assert torch.equal(y, want)
    assert any("lowmembp.ms_norm_fwd" in op for op in seen.ops)
    assert not any("empty" in op for op in seen.ops)  # the fast path's own allocations stay inside the op

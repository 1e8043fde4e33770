"""CompAct's linear (lowmembp.ops.compact_linear): forward, input and bias gradients exact; the weight gradient an
unbiased estimate whose error falls with the rank; what it saves: x·P, N × r."""
import pytest
import torch
import torch.nn.functional as F

from lowmembp.ops.compact_linear import compact_linear, project, projection


def _case(n=24, d_in=32, d_out=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n // 2, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    b = torch.randn(d_out, generator=g)
    gy = torch.randn(2, n // 2, d_out, generator=g)
    return x, w, b, gy


def _grads(fn, x, w, b, gy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, b.grad


def test_forward_input_and_bias_gradients_are_exact():
    x, w, b, gy = _case()
    ref = _grads(F.linear, x, w, b, gy)
    got = _grads(lambda x, w, b: compact_linear(x, w, b, rank=4, seed=3), x, w, b, gy)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[3], ref[3], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got[2], ref[2], atol=1e-3)  # the weight gradient is an estimate


def test_projection_is_seeded_and_scaled():
    p = projection(512, 64, seed=7, device="cpu")
    assert torch.equal(p, projection(512, 64, seed=7, device="cpu"))
    assert not torch.equal(p, projection(512, 64, seed=8, device="cpu"))
    assert abs(float(p.pow(2).sum(0).mean()) - 512 / 64) < 0.5  # entries of variance 1/r: E[P Pᵀ] = I


def test_weight_gradient_is_unbiased_and_its_error_falls_with_the_rank():
    x, w, b, gy = _case()
    exact = _grads(F.linear, x, w, b, gy)[2]

    def rel_err(rank, seeds):
        gs = [_grads(lambda x, w, b: compact_linear(x, w, b, rank=rank, seed=s), x, w, b, gy)[2] for s in seeds]
        mean = torch.stack(gs).mean(0)
        single = sum(float((g - exact).norm() / exact.norm()) for g in gs) / len(gs)
        return float((mean - exact).norm() / exact.norm()), single

    mean_err, single_err = rel_err(4, range(2000))
    assert mean_err < 0.1 * single_err   # averaging over projections converges to the exact gradient (unbiased)
    assert mean_err < 0.1
    _, single_wide = rel_err(64, range(50))
    assert single_wide < 0.5 * single_err  # a wider projection, a closer gradient (variance ∝ 1/r)


def test_it_saves_the_projection_only_and_linears_of_one_input_can_share_it():
    x, w, b, _ = _case(n=64, d_in=32)
    x.requires_grad_()
    w2 = w.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        z = project(x, 8, seed=1)
        compact_linear(x, w2, None, rank=8, seed=1, z=z)
        compact_linear(x, w2, None, rank=8, seed=1, z=z)
    acts = [t for t in saved if t is not w2]
    assert all(t.shape == (64, 8) for t in acts)
    assert len({t.untyped_storage().data_ptr() for t in acts}) == 1  # one x·P between the two linears


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_under_autocast_it_computes_in_the_autocast_dtype(dtype):
    x, w, b, gy = _case()
    with torch.autocast("cpu", dtype=dtype):
        ref = F.linear(x, w, b)
        got = compact_linear(x, w.requires_grad_(), b.requires_grad_(), rank=4, seed=0)
    assert got.dtype == ref.dtype == dtype
    torch.testing.assert_close(got, ref)
    got.float().backward(gy)
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32

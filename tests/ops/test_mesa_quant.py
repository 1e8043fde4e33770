"""Mesa 8-bit quantisation: Triton kernel vs PyTorch reference, error bound, unbiasedness, clamping, EMA, bytes."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from lowmembp._compat import unset_fake_temporarily
from lowmembp.ops import mesa_quant as mq


def draw_seed() -> int:
    """The reference seed: one draw in [0, 2³¹ − 1) from torch's default CPU generator, as :func:`mq.quantize` draws
    it (on a real CPU tensor with any fake mode unset for the moment, so that it also works while the data are
    fake)."""
    with unset_fake_temporarily():
        return int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item())

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ranges(x, inner, groups):
    mn, mx = mq.group_min_max(x, inner, groups)
    return mx - mn, mn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,mode,groups", [((2, 3, 5, 7), "head", None), ((3, 5, 12), "channel", 4),
                                               ((7, 10), "channel", 8)])
def test_kernel_matches_reference(triton_backend, dtype, shape, mode, groups):
    g = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    inner, G = mq.group_layout(x, mode, groups)
    alpha, beta = _ranges(x, inner, G)
    alpha = alpha * 0.7  # some values fall outside the range: clamping must agree too
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    qt = mq.quantize(x, alpha, beta, inner, G, seed=seed)  # Triton (interpreted)
    ref = mq.quantize_ref(x.contiguous(), 255.0 / alpha, beta, inner, G, seed)
    assert qt.codes.dtype == torch.uint8 and qt.codes.shape == x.shape
    assert torch.equal(qt.codes, ref)
    out = mq.dequantize(qt)
    out_ref = mq.dequantize_ref(ref, alpha / 255.0, beta, inner, G, dtype)
    assert out.dtype == dtype
    if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 stores: one ulp
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=2 ** -7, atol=1e-6)
    else:
        assert torch.equal(out, out_ref)


def test_hash_uniform_is_uniform():
    u = mq.hash_uniform(200_003, seed=12345)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 4 / (12 * 200_003) ** 0.5 * 3
    assert abs(float(u.var()) - 1 / 12) < 2e-3
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert float((hist - 1 / 16).abs().max()) < 0.01
    assert not torch.equal(u[:1000], mq.hash_uniform(1000, seed=12346))


@pytest.mark.parametrize("backend", ["torch_backend", "triton_backend"])
def test_error_bound_within_range(backend, request):
    request.getfixturevalue(backend)
    x = torch.randn(2, 4, 9, 5)
    inner, G = mq.group_layout(x, "head")
    alpha, beta = _ranges(x, inner, G)
    xh = mq.dequantize(mq.quantize(x, alpha, beta, inner, G))
    step = (alpha / 255).view(1, G, 1, 1)
    err = (xh - x).abs()
    assert bool((err <= step * (1 + 1e-5)).all()), float((err / step).max())
    assert float(err.max()) > 0  # it is a lossy code


def test_stochastic_rounding_unbiased():
    torch.manual_seed(0)
    x = torch.rand(3, 64) * 2 - 1
    inner, G = mq.group_layout(x, "channel", 4)
    alpha, beta = _ranges(x, inner, G)
    trials = 400
    acc = torch.zeros_like(x, dtype=torch.float64)
    for s in range(trials):
        acc += mq.dequantize(mq.quantize(x, alpha, beta, inner, G, seed=s)).double()
    mean = acc / trials
    step = float((alpha / 255).max())
    # each estimate is a mean of Bernoulli(frac)·step: std <= step/(2·sqrt(trials)); 5 sigma
    assert float((mean - x.double()).abs().max()) < 5 * step / (2 * trials ** 0.5)
    # deterministic rounding to nearest would have a bias: stochastic rounding must beat it on average
    nearest = (torch.round((x - beta.repeat_interleave(inner)) * (255 / alpha).repeat_interleave(inner)))
    nearest = nearest * (alpha / 255).repeat_interleave(inner) + beta.repeat_interleave(inner)
    assert float((mean - x.double()).abs().mean()) < float((nearest.double() - x.double()).abs().mean())


def test_clamps_outside_the_range():
    x = torch.tensor([[-5.0, 0.0, 0.5, 1.0, 7.0, 300.0]])
    alpha, beta = torch.tensor([1.0]), torch.tensor([0.0])
    qt = mq.quantize(x, alpha, beta, inner=6, groups=1, seed=3)
    assert qt.codes[0, 0] == 0 and qt.codes[0, 1] == 0
    assert int(qt.codes[0, 4]) == 255 and int(qt.codes[0, 5]) == 255  # no uint8 wrap-around
    xh = mq.dequantize(qt)
    assert float(xh[0, 0]) == 0.0 and float(xh[0, 5]) == pytest.approx(1.0)


def test_constant_group_is_exact():
    x = torch.full((2, 8), 3.25)
    inner, G = mq.group_layout(x, "channel", 2)
    alpha, beta = _ranges(x, inner, G)
    assert torch.equal(mq.dequantize(mq.quantize(x, alpha, beta, inner, G)), x)


def test_ema_update_math():
    torch.manual_seed(1)
    q = mq.EMAQuantizer(3, mode="channel")
    batches = [torch.randn(4, 12) * (i + 1) + i for i in range(4)]
    alpha = beta = None
    for i, b in enumerate(batches):
        q.pack(b)
        x3 = b.reshape(-1, 3, 4)
        mn, mx = x3.amin(dim=(0, 2)), x3.amax(dim=(0, 2))
        if i == 0:
            alpha, beta = mx - mn, mn
        else:
            alpha, beta = 0.9 * alpha + 0.1 * (mx - mn), 0.9 * beta + 0.1 * mn
        torch.testing.assert_close(q.alpha, alpha)
        torch.testing.assert_close(q.beta, beta)
    assert int(q.count) == 4
    q.eval()
    q.pack(batches[0] * 100)  # eval: ranges are used, not updated
    torch.testing.assert_close(q.alpha, alpha)


def test_current_batch_included_in_range():
    q = mq.EMAQuantizer(1, mode="channel")
    q.pack(torch.zeros(2, 4))
    x = torch.linspace(0, 10, 8).reshape(2, 4)
    qt = q.pack(x)  # α = 0.9·0 + 0.1·10 = 1: the step uses the updated α
    torch.testing.assert_close(qt.step, torch.tensor([1.0 / 255]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_saved_bytes_one_per_element_plus_group_scalars(dtype):
    x = torch.randn(3, 4, 5, 6).to(dtype)
    inner, G = mq.group_layout(x, "head")
    qt = mq.quantize(x, *_ranges(x, inner, G), inner, G)
    assert qt.nbytes() == x.numel() * 1 + G * 2 * 4
    assert qt.nbytes() < x.numel() * x.element_size()


def test_group_layout_and_errors():
    assert mq.group_layout(torch.zeros(2, 3, 4, 5), "head") == (20, 3)
    assert mq.group_layout(torch.zeros(2, 7, 12), "channel", 8) == (3, 4)  # gcd(12, 8) = 4 groups
    with pytest.raises(ValueError, match="B, H, N, D"):
        mq.group_layout(torch.zeros(2, 3), "head")
    with pytest.raises(ValueError, match="'head' or 'channel'"):
        mq.group_layout(torch.zeros(2, 3), "row")
    with pytest.raises(TypeError, match="unsupported dtype"):
        mq.quantize(torch.zeros(4, dtype=torch.int32), torch.ones(1), torch.zeros(1), 4, 1)
    with pytest.raises(ValueError, match="alpha/beta"):
        mq.quantize(torch.zeros(4, 2), torch.ones(3), torch.zeros(3), 1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_on_gpu_matches_reference(dtype):
    """On the GPU the compiler may fuse (x − β)·s + u into one FMA: codes agree up to one step at rounding ties."""
    torch.manual_seed(0)
    x = (torch.randn(4, 6, 33, 17) * 2).to(dtype).cuda()
    inner, G = mq.group_layout(x, "head")
    alpha, beta = _ranges(x, inner, G)
    qt = mq.quantize(x, alpha, beta, inner, G, seed=77)
    ref = mq.quantize_ref(x.cpu().contiguous(), (255.0 / alpha).cpu(), beta.cpu(), inner, G, 77)
    diff = (qt.codes.cpu().int() - ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
    torch.testing.assert_close(mq.dequantize(qt).cpu(), mq.dequantize_ref(qt.codes.cpu(), qt.step.cpu(),
                               qt.beta.cpu(), inner, G, dtype))
    big = torch.randn(3 * 2**20 + 5, 8, device="cuda", dtype=dtype)  # many programs, a ragged tail
    i2, g2 = mq.group_layout(big, "channel", 8)
    q2 = mq.quantize(big, *_ranges(big, i2, g2), i2, g2)
    assert float((mq.dequantize(q2).float() - big.float()).abs().max()) <= float(q2.step.max()) * 1.01 + 1e-2


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0
        self.biggest = 0  # bytes of the largest tensor an op returned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.biggest = max(self.biggest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_under_fake_tensor_mode(dtype):
    """Shape-only tensors: no ``.item()``, no chunk loop, only the outputs allocated; seeds as on real tensors."""
    shape = (3, 1001, 12)  # 36036 elements: 36036 chunks of 1 if the reference looped on fake tensors
    with FakeTensorMode():
        q = mq.EMAQuantizer(8, mode="channel")  # shrinks to gcd(12, 8) = 4 groups on the first call
        x = torch.randn(shape, dtype=dtype)
        counter = _CountOps()
        with mq.chunk_size(1), counter:
            qt = q.pack(x)
            xh = mq.dequantize(qt)
    assert counter.ops < 60, counter.ops
    assert counter.biggest == x.numel() * x.element_size()  # the dequantised output; no larger temporary
    assert is_fake(qt.codes) and qt.codes.dtype == torch.uint8 and qt.codes.shape == shape
    assert qt.step.shape == qt.beta.shape == (4,) and q.alpha.shape == (4,)
    assert qt.nbytes() == x.numel() + 4 * 2 * 4
    assert xh.shape == shape and xh.dtype == dtype
    assert mq.get_chunk_size() == mq.DEFAULT_CHUNK  # the context manager restored it
    # the seed comes from torch's default generator inside the fake mode as outside
    torch.manual_seed(11)
    outside = draw_seed()
    torch.manual_seed(11)
    with FakeTensorMode():
        assert draw_seed() == outside


def test_chunk_size_does_not_change_codes():
    torch.manual_seed(2)
    x = torch.randn(5, 37) * 4
    inner, G = mq.group_layout(x, "channel", 37)
    alpha, beta = _ranges(x, inner, G)
    torch.manual_seed(9)
    default = mq.quantize(x, alpha, beta, inner, G)
    torch.manual_seed(9)
    with mq.chunk_size(7):
        assert mq.get_chunk_size() == 7
        chunked = mq.quantize(x, alpha, beta, inner, G)
    torch.manual_seed(9)
    explicit = mq.quantize_ref(x, 255.0 / alpha, beta, inner, G, draw_seed(), chunk=x.numel())
    assert torch.equal(default.codes, chunked.codes) and torch.equal(default.codes, explicit)
    assert torch.equal(mq.dequantize_ref(default.codes, default.step, default.beta, inner, G, torch.float32, chunk=3),
                       mq.dequantize(default))
    old = mq.set_chunk_size(100)
    assert mq.set_chunk_size(None) == 100 and mq.get_chunk_size() == mq.DEFAULT_CHUNK == old
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            mq.set_chunk_size(bad)
        with pytest.raises(ValueError, match="positive int"):
            mq.quantize_ref(x, 255.0 / alpha, beta, inner, G, 1, chunk=bad)


def test_channel_groups_fixed_once_trained():
    q = mq.EMAQuantizer(8, mode="channel")
    q.eval()
    q.pack(torch.randn(2, 10))  # eval before any update: may still resize (gcd(10, 8) = 2 groups)
    q.train()
    q.pack(torch.randn(2, 12))  # first update: gcd(12, 8) = 4 groups
    assert q.alpha.shape == (4,)
    with pytest.raises(ValueError, match="after training started"):
        q.pack(torch.randn(2, 10))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 3e38])
def test_non_finite_statistics_do_not_poison_the_ema(bad):
    """One batch with inf / NaN / a range overflowing fp32 leaves the ranges as they were, and warns once."""
    torch.manual_seed(3)
    q = mq.EMAQuantizer(2, mode="channel")
    good = [torch.randn(4, 8) for _ in range(3)]
    q.pack(good[0])
    alpha, beta, count = q.alpha.clone(), q.beta.clone(), int(q.count)
    x = good[1].clone()
    x[1, 2] = bad
    if bad == 3e38:
        x[2, 3] = -3e38  # max − min overflows to inf
    with pytest.warns(RuntimeWarning, match="non-finite statistics"):
        q.pack(x)
    assert torch.equal(q.alpha, alpha) and torch.equal(q.beta, beta) and int(q.count) == count
    assert int(q.skipped) == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per quantiser: no second warning
        q.pack(x)
        qt = q.pack(good[2])  # later steps are healthy
    assert int(q.skipped) == 2 and int(q.count) == count + 1
    assert torch.isfinite(q.alpha).all() and torch.isfinite(q.beta).all()
    xh = mq.dequantize(qt)
    assert torch.isfinite(xh).all()


def test_first_batch_non_finite_leaves_the_quantiser_uninitialised():
    q = mq.EMAQuantizer(1, mode="channel")
    with pytest.warns(RuntimeWarning):
        q.pack(torch.tensor([[float("nan"), 1.0]]))
    assert int(q.count) == 0
    q.pack(torch.tensor([[0.0, 2.0]]))
    assert int(q.count) == 1 and torch.equal(q.alpha, torch.tensor([2.0])) and torch.equal(q.beta, torch.tensor([0.0]))

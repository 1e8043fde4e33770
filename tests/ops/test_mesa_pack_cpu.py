"""Mesa's one-call CPU pack (``EMAQuantizer.pack`` in training mode on the CPU fast path) against its ATen ops.

Each case runs the same sequence of batches through two copies of one quantiser from the same ``torch.manual_seed``:
once with the one-call path, once with it turned off (``group_min_max``, ``ema_update``, ``quantize``), and compares
every buffer, the QTensor's codes, step and β, and the generator's state afterwards, bit for bit.
"""
import contextlib
import copy
import warnings
from unittest import mock

import pytest
import torch

from lowmembp.ops import cpu_kernels
from lowmembp.ops.cpu_kernels import build
from lowmembp.ops import mesa_quant as mq
from backends import force_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = [((2, 3, 5, 7), "head", 3), ((3, 5, 12), "channel", 4), ((7, 10), "channel", 8), ((1, 1, 13), "channel", 1),
           ((5, 3), "channel", 3), ((2, 4, 1, 1), "head", 4)]


@pytest.fixture(autouse=True)
def cpu_backend(monkeypatch):
    force_backend(monkeypatch, "cpu")
    if cpu_kernels.library() is None:
        pytest.skip(f"the C kernels are unavailable here: {cpu_kernels.build_info()['reason']}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as their bit patterns (so that -0.0 and NaN payloads count), other tensors as they are."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    return t


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), f"{what}: {a} != {b}"


def _batches(shape, dtype, kinds, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, kind in enumerate(kinds):
        x = torch.randn(shape, generator=g) * (1 + i) + 0.5 * i
        flat = x.view(-1)
        if kind == "nan":
            flat[flat.numel() // 2] = float("nan")
        elif kind == "inf":
            flat[0], flat[-1] = float("inf"), -float("inf")
        elif kind == "huge":  # the range max - min overflows fp32 (fp16 cannot hold such values: its largest instead)
            big = 65504.0 if dtype == torch.float16 else 3.0e38
            flat[:] = torch.where(torch.arange(flat.numel()) % 2 == 0, big, -big)
        elif kind == "signed-zero":  # a group whose minimum is zero, both +0.0 and -0.0 in it
            flat.abs_()
            flat[0], flat[1 % flat.numel()] = 0.0, -0.0
        elif kind == "const":
            flat[:] = 1.25
        out.append(x.to(dtype))
    return out


def _run(quant: mq.EMAQuantizer, batches, fused: bool, seed: int = 1234):
    """The QTensors, the warnings and the generator state after packing ``batches`` with the path chosen."""
    # the plain path: pack finds no input its one-call CPU path takes (the ATen ops of group_min_max, ema_update
    # and quantize run instead)
    plain = mock.patch.object(mq.EMAQuantizer, "_fusable", lambda self, x: False)
    with contextlib.nullcontext() if fused else plain:
        torch.manual_seed(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qts = [quant.pack(x) for x in batches]
        return qts, [w for w in caught if issubclass(w.category, RuntimeWarning)], torch.get_rng_state()


def _compare(quant: mq.EMAQuantizer, batches, calls_expected: int | None = None, monkeypatch=None):
    fused_q, plain_q = copy.deepcopy(quant), copy.deepcopy(quant)
    calls = []
    if monkeypatch is not None:
        real = cpu_kernels.mesa_pack8_trusted
        def counted(*a, **k):
            calls.append(real(*a, **k))
            return calls[-1]

        monkeypatch.setattr(cpu_kernels, "mesa_pack8_trusted", counted)
    a_qts, a_warn, a_rng = _run(fused_q, batches, True)
    b_qts, b_warn, b_rng = _run(plain_q, batches, False)
    if calls_expected is not None:
        assert len(calls) == calls_expected  # the one-call path did run
    for i, (a, b) in enumerate(zip(a_qts, b_qts)):
        _assert_same(a.codes, b.codes, f"codes of batch {i}")
        _assert_same(a.step, b.step, f"step of batch {i}")
        _assert_same(a.beta, b.beta, f"beta of batch {i}")
        assert (a.inner, a.groups, a.dtype) == (b.inner, b.groups, b.dtype)
    for name in ("alpha", "beta", "count", "skipped"):
        _assert_same(getattr(fused_q, name), getattr(plain_q, name), name)
    assert torch.equal(a_rng, b_rng)  # the same draws from the default generator
    assert len(a_warn) == len(b_warn)
    assert fused_q._warned == plain_q._warned
    return fused_q, a_qts, a_warn, calls


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,mode,groups", LAYOUTS)
def test_sequence_equals_aten_ops(shape, mode, groups, dtype, momentum, monkeypatch):
    kinds = ["normal", "normal", "const", "normal", "normal", "normal"]
    quant = mq.EMAQuantizer(groups, mode, momentum)
    fused_q, qts, warned, _ = _compare(quant, _batches(shape, dtype, kinds), len(kinds), monkeypatch)
    assert int(fused_q.count) == len(kinds) and int(fused_q.skipped) == 0 and not warned
    # an independent check of the last step: the EMA ranges give the QTensor's step as alpha / 255 (alpha >= 1e-12)
    assert torch.equal(qts[-1].step, fused_q.alpha.clamp_min(1e-12) / 255.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", ["nan", "inf", "huge"])
@pytest.mark.parametrize("shape,mode,groups", LAYOUTS[:3])
def test_non_finite_batches_are_skipped_alike(shape, mode, groups, dtype, bad, monkeypatch):
    kinds = ["normal", "normal", bad, "normal", bad, "normal"]
    quant = mq.EMAQuantizer(groups, mode)
    batches = _batches(shape, dtype, kinds)
    fused_q, qts, warned, _ = _compare(quant, batches, len(kinds), monkeypatch)
    if bad == "huge" and dtype == torch.float16:  # ±65504: a finite fp32 range, an ordinary batch
        assert int(fused_q.count) == 6 and int(fused_q.skipped) == 0 and not warned
        return
    assert int(fused_q.count) == 4 and int(fused_q.skipped) == 2
    assert len(warned) == 1  # once per quantiser
    assert "non-finite" in str(warned[0].message)


def test_first_batch_non_finite(monkeypatch):
    """A bad first batch: the ranges stay zero (quantised with the minimum range), the next batch sets them."""
    kinds = ["nan", "normal", "normal", "inf", "normal"]
    fused_q, qts, warned, _ = _compare(mq.EMAQuantizer(4, "channel"), _batches((3, 8), torch.float32, kinds),
                                    len(kinds), monkeypatch)
    assert int(fused_q.count) == 3 and int(fused_q.skipped) == 2 and len(warned) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zero_at_the_minimum(dtype, monkeypatch):
    """A group's minimum is a zero with both signs present: the ATen ops decide its sign, the same bits."""
    kinds = ["signed-zero", "normal", "signed-zero", "normal", "signed-zero"]
    *_, flags = _compare(mq.EMAQuantizer(2, "channel"), _batches((4, 6), dtype, kinds), 5, monkeypatch)
    assert [bool(f & cpu_kernels.PACK8_AMBIGUOUS) for f in flags] == [k == "signed-zero" for k in kinds]


def test_ranges_and_scales_equal_aten_ops():
    """Many groups of one element: the EMA, step and scale of the kernel against ATen's ops on the same ranges."""
    g = torch.Generator().manual_seed(5)
    groups = 4096
    alpha, beta = torch.zeros(groups), torch.zeros(groups)
    count, skipped = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    for i, momentum in enumerate([0.9, 0.9, 0.0, 0.75]):
        x = torch.randn(1, groups, generator=g) * torch.logspace(-14, 6, groups) + i
        a0, b0, c0 = alpha.clone(), beta.clone(), count.clone()
        step, beta_out, scale = torch.empty(groups), torch.empty(groups), torch.empty(groups)
        codes = torch.empty(x.shape, dtype=torch.uint8)
        flags = cpu_kernels.mesa_pack8(x, 1, groups, alpha, beta, count, skipped, momentum, mq._MIN_RANGE, 7,
                                       step, beta_out, scale, codes)
        assert flags == 0
        mn, mx = mq.group_min_max(x, 1, groups)
        assert bool(mq.ema_update(a0, b0, c0, mn, mx, momentum))
        _assert_same(alpha, a0, "alpha")
        _assert_same(beta, b0, "beta")
        _assert_same(count, c0, "count")
        a = a0.clamp_min(mq._MIN_RANGE)
        _assert_same(scale, 255.0 / a, "scale")  # ATen: the reciprocal, times 255
        _assert_same(step, a / 255.0, "step")
        _assert_same(beta_out, b0, "beta_out")
        _assert_same(codes, mq.quantize_ref(x, 255.0 / a, b0, 1, groups, 7), "codes")


def test_eval_mode_and_the_reference_backend(monkeypatch):
    """Eval mode after training packs alike; the one-call path's buffers also match the PyTorch reference backend."""
    batches = _batches((2, 3, 4, 5), torch.float32, ["normal"] * 5)
    quant = mq.EMAQuantizer(3, "head")
    fused_q, qts, _, _ = _compare(quant, batches)
    fused_q.eval()
    plain_q = copy.deepcopy(fused_q)
    a, _, _ = _run(fused_q, batches[:2], True)
    b, _, _ = _run(plain_q, batches[:2], False)
    for qa, qb in zip(a, b):
        assert torch.equal(qa.codes, qb.codes) and torch.equal(qa.step, qb.step) and torch.equal(qa.beta, qb.beta)
    assert int(fused_q.count) == 5  # eval mode does not update
    force_backend(monkeypatch, "torch")  # the reference quantiser, its ATen EMA
    ref_q = mq.EMAQuantizer(3, "head")
    ref, _, _ = _run(ref_q, batches, True)
    for name in ("alpha", "beta", "count", "skipped"):
        _assert_same(getattr(ref_q, name), getattr(quant_after(quant, batches), name), name)
    for qa, qr in zip(qts, ref):
        _assert_same(qa.codes, qr.codes, "codes")
        _assert_same(qa.step, qr.step, "step")


def quant_after(quant: mq.EMAQuantizer, batches) -> mq.EMAQuantizer:
    q = copy.deepcopy(quant)
    _run(q, batches, True)
    return q


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,groups,dtype", [((64, 33, 128), 8, torch.float32), ((4096, 39), 13, torch.bfloat16),
                                                ((2, 3, 40000), 1, torch.float16)])
def test_large_tensor_on_threads(threads, shape, groups, dtype, monkeypatch):
    """Enough elements for the kernels' threads (whose ranges start inside a group pattern, or inside a row):
    per-thread minima and maxima combine to the same ranges; the codes dequantise alike."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batches = _batches(shape, dtype, ["normal", "normal", "nan", "normal"])
        _, qts, _, _ = _compare(mq.EMAQuantizer(groups, "channel"), batches, 4, monkeypatch)
        for qt in qts:
            ref = mq.dequantize_ref(qt.codes, qt.step, qt.beta, qt.inner, qt.groups, qt.dtype)
            _assert_same(mq.dequantize(qt), ref, "dequantised")
    finally:
        torch.set_num_threads(old)


def test_turned_off_without_kernels(monkeypatch):
    """With the C kernels off the ATen ops run (and give the same bits)."""
    monkeypatch.setattr(build, "_OFF", True)
    calls = []
    real = cpu_kernels.mesa_pack8_trusted
    monkeypatch.setattr(cpu_kernels, "mesa_pack8_trusted", lambda *a, **k: calls.append(1) or real(*a, **k))
    quant = mq.EMAQuantizer(2, "channel")
    qts, _, _ = _run(quant, _batches((3, 4), torch.float32, ["normal"] * 2), True)
    assert len(calls) == 2 and int(quant.count) == 2  # called, returned None: the ATen ops updated the ranges

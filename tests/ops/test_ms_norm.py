"""MS-LayerNorm / MS-RMSNorm: math in float64, Triton (interpreter) vs reference, shapes, saved bytes, sharing."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowmembp.ops import ms_norm
from lowmembp.ops.ms_norm import (MSLayerNorm, MSRMSNorm, ms_layer_norm, ms_norm_bwd_ref, ms_norm_bwd_triton,
                                  ms_norm_fwd_ref, ms_norm_fwd_triton, ms_rms_norm)
from backends import force_backend

FN = {"layernorm": ms_layer_norm, "rmsnorm": ms_rms_norm}
EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6}
HALF = (torch.bfloat16, torch.float16)
SHAPES = [(r, n) for r in (0, 1, 3) for n in (1, 7, 33, 100)]


def _x(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    scale = torch.rand(shape[:-1] + (1,), generator=gen, dtype=torch.float64) * 3 + 0.1  # rows of varied scale/shift
    return (base * scale + torch.randn(shape[:-1] + (1,), generator=gen, dtype=torch.float64)).to(dtype)


def _native_f64(kind, x64, eps):
    """Autograd oracle: the library's own norms without affine, in float64."""
    if kind == "layernorm":
        return F.layer_norm(x64, x64.shape[-1:], eps=eps)
    return F.rms_norm(x64, x64.shape[-1:], eps=eps)


def _assert_ulp(a, b, ulps=1):
    """|a - b| within `ulps` units in the last place of a's dtype (at the larger magnitude)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.numel() == 0:
        return
    af, bf = a.double(), b.double()
    mag = torch.maximum(af.abs(), bf.abs())
    _, e = torch.frexp(mag)
    ulp = torch.finfo(a.dtype).eps * torch.pow(2.0, (e - 1).double()).clamp_min(torch.finfo(a.dtype).tiny)
    bad = (af - bf).abs() > ulps * ulp
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than {ulps} ulp: {af[bad][:5]} vs {bf[bad][:5]}"


def _assert_close(a, b, dtype):
    if dtype in HALF:
        _assert_ulp(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


# ------------------------------------------------------------------------------------------------- reference vs math
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(5, 33), (2, 3, 100), (4, 1)])
def test_reference_matches_float64_math(kind, shape):
    eps = EPS[kind]
    x64 = _x(shape, torch.float64)
    x64.requires_grad_(True)
    y_nat = _native_f64(kind, x64, eps)
    g = _x(shape, torch.float64, seed=1)
    dx_nat, = torch.autograd.grad(y_nat, x64, g)
    # the formulas themselves, evaluated in float64 by the reference functions
    y, rstd = ms_norm_fwd_ref(x64.detach(), kind, eps)
    mean = x64.detach().mean(-1, keepdim=True) if kind == "layernorm" else 0.0
    var = ((x64.detach() - mean) ** 2).mean(-1)
    torch.testing.assert_close(rstd, (var + eps).rsqrt().reshape(-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(y, y_nat.detach(), rtol=1e-12, atol=1e-12)
    dx = ms_norm_bwd_ref(g, y, rstd, kind, torch.float64)
    torch.testing.assert_close(dx, dx_nat, rtol=1e-10, atol=1e-10)
    # the fp32 op (statistics in fp32) against the float64 oracle
    x32 = x64.detach().float().requires_grad_(True)
    y32 = FN[kind](x32, eps)
    dx32, = torch.autograd.grad(y32, x32, g.float())
    torch.testing.assert_close(y32.double(), y_nat.detach(), rtol=1e-5, atol=1e-5)
    term = float((rstd.reshape(-1, 1) * g.reshape(-1, shape[-1])).abs().max())  # size of the terms that cancel
    torch.testing.assert_close(dx32.double(), dx_nat, rtol=1e-4, atol=1e-5 * term)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HALF)
def test_half_inputs_track_float64(kind, dtype):
    eps = EPS[kind]
    x = _x((6, 96), dtype).requires_grad_(True)
    g = _x((6, 96), dtype, seed=2)
    y = FN[kind](x, eps)
    dx, = torch.autograd.grad(y, x, g)
    assert y.dtype == dtype and dx.dtype == dtype
    x64 = x.detach().double().requires_grad_(True)
    y64 = _native_f64(kind, x64, eps)
    dx64, = torch.autograd.grad(y64, x64, g.double())
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)  # output rounded once from fp32 statistics
    # backward uses the *rounded* y, so its error is of the order of the output rounding times the row scale
    torch.testing.assert_close(dx.double(), dx64, rtol=4 * tol, atol=4 * tol * float(dx64.abs().max()))


# -------------------------------------------------------------------------------------- Triton (interpreter) vs ref
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{n}" for r, n in SHAPES])
def test_triton_kernels_match_reference(triton_backend, kind, dtype, shape):
    eps = EPS[kind]
    x = _x(shape, dtype, seed=shape[1])
    y_t, r_t = ms_norm_fwd_triton(x, kind, eps)
    y_r, r_r = ms_norm_fwd_ref(x, kind, eps)
    assert y_t.dtype == dtype and r_t.dtype == torch.float32 and r_t.shape == (shape[0],)
    _assert_close(y_t, y_r, dtype)
    torch.testing.assert_close(r_t, r_r, rtol=1e-6, atol=0)
    g = _x(shape, dtype, seed=7)
    _assert_close(ms_norm_bwd_triton(g, y_r, r_r, kind, dtype), ms_norm_bwd_ref(g, y_r, r_r, kind, dtype), dtype)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_autograd_path_matches_torch_path(monkeypatch, kind, dtype):
    x = _x((2, 5, 48), dtype, seed=3)
    results = {}
    for backend in ("torch", "triton"):
        force_backend(monkeypatch, backend)
        assert (ms_norm.backend_for(x) == "triton") == (backend == "triton")
        xi = x.clone().requires_grad_(True)
        y = FN[kind](xi)
        (y.float() * torch.arange(48.0)).sum().backward()  # a non-uniform, broadcast (stride-0) upstream gradient
        results[backend] = (y.detach(), xi.grad)
    _assert_close(results["triton"][0], results["torch"][0], dtype)
    # backward inputs differ by the forward's one-ulp store difference, so compare the gradients in float64
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    dx_t, dx_r = results["triton"][1].double(), results["torch"][1].double()
    torch.testing.assert_close(dx_t, dx_r, rtol=tol, atol=tol * float(dx_r.abs().max()))  # terms cancel: scale atol


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_non_contiguous_inputs(monkeypatch, backend, kind):
    force_backend(monkeypatch, backend)
    base = _x((6, 40), seed=4)
    views = [base[:, ::2],                                  # column stride 2
             base[:, 3:23],                                 # row stride 40, unit column stride
             base.view(6, 2, 20).transpose(0, 1)]           # leading dims permuted
    for v in views:
        assert not v.is_contiguous()
        xv = v.clone().requires_grad_(False)  # same values, contiguous copy as the expectation
        a = v.detach().requires_grad_(True)
        y = FN[kind](a)
        y.backward(torch.ones_like(y) * 0.5 + y.detach())
        xc = xv.contiguous().requires_grad_(True)
        yc = FN[kind](xc)
        yc.backward(torch.ones_like(yc) * 0.5 + yc.detach())
        torch.testing.assert_close(y, yc, rtol=0, atol=0)
        torch.testing.assert_close(a.grad, xc.grad, rtol=0, atol=0)


def test_zero_rows_and_empty_gradients():
    for kind in ("layernorm", "rmsnorm"):
        x = torch.empty(0, 3, 16, requires_grad=True)
        y = FN[kind](x)
        assert y.shape == (0, 3, 16)
        y.sum().backward()
        assert x.grad.shape == x.shape


# ------------------------------------------------------------------------------------------------ saved tensors
def _saved(fn):
    recs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: recs.append(t) or t, lambda t: t):
        out = fn()
    return out, recs


def _storages(tensors):
    """{storage data_ptr: (bytes of the storage, dtype)} over saved tensors, each storage once."""
    return {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), t.dtype) for t in tensors}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                            (torch.float32, torch.bfloat16)])
def test_norm_saves_output_and_rstd_only(monkeypatch, backend, kind, dtype, autocast):
    force_backend(monkeypatch, backend)
    x = _x((3, 4, 20), dtype).requires_grad_(True)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx:
        y, recs = _saved(lambda: FN[kind](x))
    assert y.dtype == (autocast or dtype)
    st = _storages(recs)
    assert x.untyped_storage().data_ptr() not in st
    assert y.untyped_storage().data_ptr() in st
    assert sum(b for b, _ in st.values()) == y.numel() * y.element_size() + 12 * 4
    rstd = [t for t in recs if t.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()]
    assert len(rstd) == 1 and rstd[0].dtype == torch.float32 and rstd[0].numel() == 12


def _pair_storages(norm_fn, consumers, x, autocast):
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()

    def run():
        with ctx:
            h = norm_fn(x)
            return h, [lin(h) for lin in consumers]
    (h, _), recs = _saved(run)
    params = {p.untyped_storage().data_ptr() for lin in consumers for p in lin.parameters()}
    # activation-sized: at least 2 bytes per element of h (any supported dtype); weights and their casts are smaller
    big = {p: v for p, v in _storages(recs).items() if p not in params and v[0] >= h.numel() * 2}
    return h, big


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(10, 24), (2, 5, 24)])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
def test_norm_linear_pair_saves_norm_output_once(kind, shape, autocast):
    torch.manual_seed(0)
    consumers = [nn.Linear(24, 6), nn.Linear(24, 6, bias=False), nn.Linear(24, 6)]  # e.g. q, k, v
    x = _x(shape).requires_grad_(True)
    h, big = _pair_storages(FN[kind], consumers, x, autocast)
    # activation-sized storages saved: exactly one, the norm's output; nothing of the norm's input
    assert list(big) == [h.untyped_storage().data_ptr()]
    assert x.untyped_storage().data_ptr() not in big
    # the same harness sees the extra tensor when the library norm is used (so the check can fail)
    native = {"layernorm": lambda t: F.layer_norm(t, t.shape[-1:]), "rmsnorm": lambda t: F.rms_norm(t, t.shape[-1:])}
    _, big_native = _pair_storages(native[kind], consumers, x, autocast)
    assert len(big_native) >= 2 or x.untyped_storage().data_ptr() in big_native


def test_autocast_dtype_and_gradient_dtype():
    x = _x((4, 16)).requires_grad_(True)
    lin = nn.Linear(16, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ms_layer_norm(x)
        out = lin(y)
    assert y.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    y_plain = ms_layer_norm(x.detach())
    assert y_plain.dtype == torch.float32
    _assert_ulp(y.detach(), y_plain.to(torch.bfloat16))


def test_fake_tensor_mode_uses_reference(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    force_backend(monkeypatch, "triton")
    with FakeTensorMode():
        x = torch.randn(3, 7, 33, requires_grad=True)
        y = ms_rms_norm(x)
        y.sum().backward()
        assert y.shape == x.shape and x.grad.shape == x.shape


# ------------------------------------------------------------------------------------------------ modules, errors
def test_modules_match_functions_and_native():
    x = _x((3, 2, 12))
    ln, rms = MSLayerNorm(12), MSRMSNorm((12,), eps=1e-5)
    torch.testing.assert_close(ln(x), nn.LayerNorm(12, elementwise_affine=False)(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rms(x), ms_rms_norm(x, 1e-5), rtol=0, atol=0)
    torch.testing.assert_close(rms(x), F.rms_norm(x, (12,), eps=1e-5), rtol=1e-6, atol=1e-6)
    assert MSLayerNorm(torch.Size([12])).normalized_shape == (12,)
    assert "(12,), eps=1e-05" in repr(ln) and "(12,), eps=1e-05" in repr(rms)
    assert ln.weight is None and ln.bias is None and list(ln.parameters()) == []


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.uint8])
def test_unsupported_dtype_raises(dtype):
    x = torch.ones(2, 8, dtype=dtype)
    for fn in (ms_layer_norm, ms_rms_norm, MSLayerNorm(8), MSRMSNorm(8)):
        with pytest.raises(TypeError, match="unsupported dtype"):
            fn(x)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="last dimension"):
        MSLayerNorm(8)(torch.ones(2, 7))
    with pytest.raises(ValueError, match="int or a 1-tuple"):
        MSLayerNorm((4, 8))
    with pytest.raises(ValueError, match="0-d"):
        ms_layer_norm(torch.tensor(1.0))
    with pytest.raises(ValueError, match="kind"):
        ms_norm_fwd_ref(torch.ones(2, 3), "batchnorm", 1e-5)


# ------------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(197 * 4, 768), (37, 4096), (5, 100), (3, 20000)])
def test_cuda_kernels_match_reference(kind, dtype, shape):
    x = _x(shape, dtype).cuda()
    g = _x(shape, dtype, seed=5).cuda()
    y_t, r_t = ms_norm_fwd_triton(x, kind, EPS[kind])
    y_r, r_r = ms_norm_fwd_ref(x, kind, EPS[kind])
    # GPU stores round to nearest; the GPU's sqrt/divide are within a few fp32 ulp
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y_t.float(), y_r.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(r_t, r_r, rtol=1e-5, atol=0)
    dx_t = ms_norm_bwd_triton(g, y_r, r_r, kind, dtype).double()
    dx_r = ms_norm_bwd_ref(g, y_r, r_r, kind, dtype).double()
    torch.testing.assert_close(dx_t, dx_r, rtol=tol, atol=tol * float(dx_r.abs().max()))
    assert ms_norm.backend_for(x) == "triton" and shape[1] <= ms_norm.MAX_TRITON_N


@pytest.mark.gpu
def test_cuda_64bit_row_offsets():
    n = 4096
    rows = (2**31) // n + 64  # element offsets past 2**31
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    y, rstd = ms_norm_fwd_triton(x, "rmsnorm", 1e-6)
    y_r, r_r = ms_norm_fwd_ref(x[-64:], "rmsnorm", 1e-6)
    torch.testing.assert_close(y[-64:].float(), y_r.float(), rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(rstd[-64:], r_r, rtol=1e-5, atol=0)
    dx = ms_norm_bwd_triton(y, y, rstd, "rmsnorm", torch.bfloat16)
    dx_r = ms_norm_bwd_ref(y[-64:], y[-64:], rstd[-64:], "rmsnorm", torch.bfloat16)
    torch.testing.assert_close(dx[-64:].float(), dx_r.float(), rtol=1.6e-2, atol=1.6e-2)


# ----------------------------------------------------------------------------------- unsupported autograd features
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_double_backward_raises_naming_the_op(kind, torch_backend):
    x = _x((3, 8)).requires_grad_()
    (g,) = torch.autograd.grad(FN[kind](x).pow(3).sum(), x, create_graph=True)
    op = "ms_layer_norm" if kind == "layernorm" else "ms_rms_norm"
    with pytest.raises(RuntimeError, match=f"{op}: double backward .* is not supported.*torch.nn.functional"):
        g.sum().backward()


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_torch_func_gradient_transforms_raise_and_vmap_works(kind, torch_backend):
    fn = FN[kind]
    x = _x((3, 8))
    op = "ms_layer_norm" if kind == "layernorm" else "ms_rms_norm"
    for transform in (lambda: torch.func.grad(lambda t: fn(t).pow(2).sum())(x),
                      lambda: torch.func.jacrev(fn)(x[0]), lambda: torch.func.jacfwd(fn)(x[0])):
        with pytest.raises(RuntimeError, match=f"{op}: torch.func gradient transforms"):
            transform()
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=f"{op}: forward-mode AD"):
        fn(fwAD.make_dual(x, torch.ones_like(x)))
    with pytest.warns(UserWarning):  # no batching rule: torch's per-sample fallback, correct but slow
        batched = torch.func.vmap(fn)(x)
    torch.testing.assert_close(batched, torch.stack([fn(r) for r in x]))

"""The CPU fast paths (approx_act, ms_norm, mesa_quant) equal the PyTorch references bit for bit, and the dispatch
picks them on CPU tensors.

Every comparison is of bits (fp32 / fp16 / bf16 viewed as integers; NaN payloads included): forward outputs, the
saved codes (and flag byte), rstd, the 8-bit codes, and the gradients. The block sizes are shrunk so that small
tensors cross many block boundaries (and the ragged ends); one and two threads.
"""
import copy
import os
from unittest import mock

import pytest
import torch

from lowmembp.ops.backend import backend_for
from lowmembp.ops import approx_act as A
from lowmembp.ops import approx_act_cpu as AC
from lowmembp.ops import mesa_quant as Q
from lowmembp.ops import mesa_quant_cpu as QC
from lowmembp.ops import ms_norm as M
from lowmembp.ops import ms_norm_cpu as MC

from bitwise import assert_same
from backends import force_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["small-blocks", "default-blocks"])
def blocks(request, monkeypatch):
    if request.param == "small-blocks":
        monkeypatch.setattr(AC, "_CPU_BLOCK", 64)
        monkeypatch.setattr(MC, "_CPU_BLOCK", 96)
        monkeypatch.setattr(QC, "_CPU_BLOCK", 80)
    return request.param


def randn(shape, dtype, gen, scale=3.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------ approx_act
ACT_SHAPES = [(1,), (3,), (5,), (4, 7), (2, 3, 333), (1001,), (70003,)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", A.KINDS)
def test_act_equals_reference(kind, dtype, threads, blocks, gen):
    for shape in ACT_SHAPES:
        x = randn(shape, dtype, gen)
        y0, p0 = A.forward_reference(x, kind)
        y1, p1 = A.forward_cpu(x, kind)
        assert_same(y1, y0, f"{kind} {shape} forward")
        assert_same(p1, p0, f"{kind} {shape} codes")
        dy = randn(shape, dtype, gen, 1.0)
        assert_same(A.backward_cpu(dy, p0, kind), A.backward_reference(dy, p0, kind), f"{kind} {shape} backward")
        y2, p2 = A.forward_cpu(x, kind, with_codes=False)
        assert_same(y2, y0, f"{kind} {shape} forward without codes")
        assert p2.numel() == 0


@pytest.mark.parametrize("bits_", [1, 3, 4])
def test_act_other_bits_equal_reference(bits_, gen):
    x = randn((2, 1001), torch.float32, gen)
    y0, p0 = A.forward_reference(x, "gelu", bits=bits_)
    y1, p1 = A.forward_cpu(x, "gelu", bits=bits_)
    assert_same(y1, y0)
    assert_same(p1, p0)
    dy = randn(x.shape, torch.float32, gen)
    assert_same(A.backward_cpu(dy, p0, "gelu", bits_), A.backward_reference(dy, p0, "gelu", bits_))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gelu", "silu", "relu2"])
def test_act_non_finite_equal_reference(kind, dtype, blocks, gen):
    x = randn((3, 1001), dtype, gen)
    x[0, 5], x[1, 700], x[2, 1000] = float("nan"), float("inf"), float("-inf")
    for inp in (x, x[1:].clone(), x[2:].clone()):  # NaN + ±inf, +inf only, −inf only
        y0, p0 = A.forward_reference(inp, kind)
        y1, p1 = A.forward_cpu(inp, kind)
        assert_same(y1, y0, "forward")
        assert_same(p1, p0, "codes and flag")
        dy = randn(inp.shape, dtype, gen, 1.0)
        assert_same(A.backward_cpu(dy, p0, kind), A.backward_reference(dy, p0, kind), "backward")
    dy = randn(x.shape, dtype, gen, 1.0)
    dy[0, 0], dy[0, 1] = float("nan"), float("inf")
    p = A.forward_reference(x, kind)[1]
    assert_same(A.backward_cpu(dy, p, kind), A.backward_reference(dy, p, kind), "non-finite dy")


def _saved_and_grad(fn, x, dy):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fn(x)
    (gx,) = torch.autograd.grad(y, x, dy)
    return y, saved, gx


def _fast_path_and_reference(fn, x, dy, owner, names, python: bool, node: str, monkeypatch):
    """fn's forward and gradient on the CPU fast path equal the reference's; the dispatch took the Python route
    (``owner``'s functions ``names``, the forward's and the backward's, called) where ``python``, else the C++ node
    named ``node``. Returns the saved tensors of both (fast path, reference)."""
    force_backend(monkeypatch, "cpu")
    with mock.patch.object(owner, names[0], wraps=getattr(owner, names[0])) as f, \
            mock.patch.object(owner, names[1], wraps=getattr(owner, names[1])) as b:
        y1, s1, g1 = _saved_and_grad(fn, x, dy)
    assert f.called == b.called == python, "the dispatch did not take the CPU fast path"
    assert (y1.grad_fn.name() == node) != python
    force_backend(monkeypatch, "torch")
    y0, s0, g0 = _saved_and_grad(fn, x, dy)
    assert_same(y1, y0, "forward")
    assert_same(g1, g0, "gradient")
    return s1, s0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn", [A.regelu2, A.resilu2], ids=["regelu2", "resilu2"])
def test_act_autograd_equals_reference(fn, dtype, threads, blocks, act_route, gen, monkeypatch):
    base = randn((6, 9, 101), dtype, gen)
    for x in (base, base.transpose(0, 2), base[:, ::2]):  # contiguous and two non-contiguous views
        x = x.detach().requires_grad_()
        dy = randn(x.shape, dtype, gen, 1.0)
        python = act_route == "python" or AC._NODE[0] is None  # else the C++ node (tests/ops/test_cpu_ext.py)
        s1, s0 = _fast_path_and_reference(fn, x, dy, A, ("_fwd_cpu", "_bwd_cpu"), python,
                                          "lowmembp::ApproxActBackward", monkeypatch)
        assert len(s1) == len(s0) == 1
        assert_same(s1[0], s0[0], "saved codes")


# ------------------------------------------------------------------------------------------------ ms_norm
NORM_SHAPES = [(1, 7), (5, 1), (3, 768), (200, 33), (4, 5, 129), (70, 4096)]


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16], ids=["input", "fp32", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", M.KINDS)
def test_norm_equals_reference(kind, dtype, out_dtype, threads, blocks, gen):
    for shape in NORM_SHAPES:
        x = (randn(shape, torch.float32, gen, 2.0) + 0.5).to(dtype)
        for xin in (x, x.transpose(0, -1).contiguous().transpose(0, -1)):  # contiguous, and a column-major copy
            y0, r0 = M.ms_norm_fwd_ref(xin, kind, 1e-5, out_dtype)
            y1, r1 = M.ms_norm_fwd_cpu(xin, kind, 1e-5, out_dtype)
            assert_same(y1, y0, f"{kind} {shape} forward")
            assert_same(r1, r0, f"{kind} {shape} rstd")
            g = randn(shape, dtype, gen, 1.0)
            assert_same(M.ms_norm_bwd_cpu(g, y0, r0, kind, dtype), M.ms_norm_bwd_ref(g, y0, r0, kind, dtype),
                        f"{kind} {shape} backward")


def _model_grads(model, batch, logits):
    out = logits(model, batch)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    model.zero_grad(set_to_none=True)
    (out * w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["lowmembp", "mesa"])
@pytest.mark.parametrize("name", ["vit", "llama"])
def test_model_step_equals_reference(name, method, monkeypatch):
    """A tiny model converted with the method, its LayerNorm / RMSNorm γ and β perturbed first (so the folded affine
    is not the identity): logits and every gradient bit for bit the same under the fast path and the reference."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import build, logits

    import lowmembp

    torch.manual_seed(0)
    model, inputs = build(name)
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__:
                for p in m.parameters(recurse=False):
                    p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.3)
    model = lowmembp.apply(model, method)
    model.train()
    batch = inputs()
    results = {}
    for backend in ("cpu", "torch"):
        force_backend(monkeypatch, backend)
        m = copy.deepcopy(model)
        torch.manual_seed(1)  # Mesa draws its rounding seeds from torch's generator
        results[backend] = _model_grads(m, batch, logits)
    (o1, g1), (o0, g0) = results["cpu"], results["torch"]
    assert_same(o1, o0, "logits")
    assert g1.keys() == g0.keys() and g1
    for k in g0:
        assert_same(g1[k], g0[k], k)


# ------------------------------------------------------------------------------------------------ mesa_quant
MESA_CASES = [  # shape, group mode, groups asked
    ((2, 3, 17, 8), "head", 3), ((8, 19, 96), "channel", 8), ((3, 5, 6), "channel", 4), ((2, 7), "channel", 1),
    ((1, 3, 1000), "channel", 3), ((999, 4), "channel", 4), ((5, 3, 8), "channel", 2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mesa_equals_reference(dtype, threads, blocks, gen):
    for shape, mode, wanted in MESA_CASES:
        x = randn(shape, dtype, gen)
        inner, groups = Q.group_layout(x, mode, wanted)
        mn, mx = Q.group_min_max(x, inner, groups)
        mx = mx + 0.1 * (mx - mn)  # some values outside the range (clamped), some within
        scale, step, beta = 255.0 / (mx - mn).clamp_min(1e-12), (mx - mn) / 255.0, mn.clone()
        seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
        for s in (seed, 0, 2**31 - 2):
            q0 = Q.quantize_ref(x, scale, beta, inner, groups, s)
            assert_same(Q.quantize_cpu(x, scale, beta, inner, groups, s), q0, f"{shape} codes, seed {s}")
            for out in (dtype, torch.float32):
                assert_same(Q.dequantize_cpu(q0, step, beta, inner, groups, out),
                            Q.dequantize_ref(q0, step, beta, inner, groups, out), f"{shape} dequantised")


def test_mesa_hash_equals_reference(gen):
    n = 5000
    for start in (0, 123, 2**32 - 2000, 2**33 + 7):
        for seed in (0, 1, 2**31 - 2):
            u = torch.empty(n)
            h, t = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
            QC._hash_uniform_into(u, h, t, QC._golden_ramp(n), start, seed)
            assert_same(u, Q.hash_uniform(n, seed, start=start), f"start {start} seed {seed}")


def test_mesa_public_functions_dispatch(gen, monkeypatch):
    x = randn((4, 33, 64), torch.bfloat16, gen)
    inner, groups = Q.group_layout(x, "channel", 4)
    mn, mx = Q.group_min_max(x, inner, groups)
    out = {}
    for backend in ("cpu", "torch"):
        force_backend(monkeypatch, backend)
        with mock.patch.object(Q, "quantize_cpu", wraps=Q.quantize_cpu) as qc, \
                mock.patch.object(Q, "dequantize_cpu", wraps=Q.dequantize_cpu) as dc:
            qt = Q.quantize(x, mx - mn, mn, inner, groups, seed=42)
            out[backend] = (qt.codes, Q.dequantize(qt))
        assert qc.called == dc.called == (backend == "cpu")
    assert_same(out["cpu"][0], out["torch"][0], "codes")
    assert_same(out["cpu"][1], out["torch"][1], "dequantised")


# ------------------------------------------------------------------------------------------------ dispatch
def test_backend_for_picks_cpu_by_default_and_when_asked(monkeypatch):
    x = torch.ones(3)
    force_backend(monkeypatch, None)
    assert backend_for(x) == "cpu"  # the default on CPU tensors
    assert backend_for(torch.empty(3, device="meta")) == "torch"  # no data: the reference (its fake shapes)
    force_backend(monkeypatch, "torch")
    assert backend_for(x) == "torch"
    force_backend(monkeypatch, "cpu")
    assert backend_for(x) == "cpu"
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        backend_for(torch.empty(3, device="meta"))
    force_backend(monkeypatch, "fast")
    with pytest.raises(ValueError, match="'cpu'"):
        backend_for(x)


@pytest.mark.parametrize("fn", [M.ms_layer_norm, M.ms_rms_norm], ids=["layernorm", "rmsnorm"])
def test_norm_dispatch_takes_fast_path(fn, threads, blocks, norm_route, gen, monkeypatch):
    x = randn((70, 40), torch.bfloat16, gen).requires_grad_()
    g = randn(x.shape, torch.bfloat16, gen, 1.0)
    python = norm_route == "python" or MC._NODE[0] is None  # else the C++ node (tests/ops/test_cpu_ext_norm.py)
    s1, s0 = _fast_path_and_reference(fn, x, g, M, ("ms_norm_fwd_cpu", "ms_norm_bwd_cpu"), python,
                                      "lowmembp::MSNormBackward", monkeypatch)
    assert len(s1) == len(s0) == 2
    assert_same(s1[1], s0[1], "rstd")


def test_fast_paths_leave_non_cpu_tensors_to_the_reference(monkeypatch):
    """The public CPU functions hand a tensor that is not on the CPU (here the meta device, which has no data) to
    the reference rather than its pointer to C: the norms' shapes and dtypes come back; the activation's reference
    reads values (its finiteness check), which a meta tensor has not: its error, not a C kernel's read."""
    called = mock.Mock(side_effect=AssertionError("a C kernel was called on a meta tensor"))
    from lowmembp.ops import cpu_kernels as K
    for name in ("layer_norm_fwd_trusted", "norm_bwd_rows_trusted", "codes2_trusted", "slopes2_trusted"):
        monkeypatch.setattr(K, name, called)
    for dtype in DTYPES:
        x = torch.empty(6, 40, dtype=dtype, device="meta")
        for kind in M.KINDS:
            y, r = M.ms_norm_fwd_cpu(x, kind, 1e-5)
            assert y.is_meta and y.shape == x.shape and r.is_meta
            assert M.ms_norm_bwd_cpu(x, y, r, kind, dtype).shape == x.shape
        with pytest.raises(RuntimeError, match="meta"):
            A.forward_cpu(x, "gelu")
        with pytest.raises(RuntimeError, match="meta"):
            A.backward_cpu(x, torch.zeros(61, dtype=torch.uint8, device="meta"), "gelu")
    called.assert_not_called()

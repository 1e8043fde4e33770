"""ReGELU2 / ReSiLU2: reference against float64 math, Triton (interpreter) against reference, saved bytes, errors."""
import math

import pytest
import torch

from lowmembp.ops import approx_act as A
from lowmembp.ops import approx_act_reference as AR
from lowmembp.ops import approx_act_triton as AT
from backends import force_backend

KINDS = {"gelu": (AR._GELU, A.regelu2, A.ReGELU2, A.REGELU2_C, A.REGELU2_A),
         "silu": (AR._SILU, A.resilu2, A.ReSiLU2, A.RESILU2_C, A.RESILU2_A)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1,), (3,), (5, 7), (0,), (2, 3, 33), (4, 0, 3)]
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _rand(shape, dtype, scale=4.0, gen=None):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _exact64(kind, x):
    x = x.double()
    if kind == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return x / (1.0 + torch.exp(-x))


def _fp32(v):
    return float(torch.tensor(v, dtype=torch.float32))


def _codes64(x, c):
    """Direct thresholding in float64 against the fp32-rounded constants (the op's documented comparison)."""
    x = x.double()
    return sum((x > _fp32(ci)).to(torch.uint8) for ci in c)


def _ulp(v, dtype):
    """One unit in the last place of |v| in `dtype` (subnormals included), as float64."""
    fi, m = torch.finfo(dtype), MANTISSA[dtype]
    v = v.double().abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(v)) - m).clamp_min(fi.tiny * 2.0 ** -m)


def _assert_within_ulps(a, b, dtype, ulps=1.0, atol=0.0):
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return
    tol = ulps * _ulp(torch.maximum(a.abs(), b.abs()), dtype) + atol
    bad = (a - b).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than {ulps} ulp: {a[bad][:5]} vs {b[bad][:5]}"


def _lib_atol(kind, x):
    """Absolute allowance for a library's fp32 activation against the float64 math.

    1e-6 for every kind, plus, for the erf GELU, the error of the library's fp32 erf carried by ``0.5·x``:
    ``0.5·|x|·2**-20``. ATen's vectorised GELU uses its own erf approximation, which differs between CPU builds
    (on an AVX-512 Intel Xeon, over a 4M-point sweep of [-12, 12]: up to 1.21e-6 absolute, at x ≈ ±3.5; the error
    over |x|/2 peaks at 7.5e-7 ≈ 0.78·2**-20); the formula ``0.5·x·(1 + erf(x/√2))`` with ``torch.erf`` stays within
    4.4e-7 there.
    """
    atol = torch.full(x.shape, 1e-6, dtype=torch.float64)
    return atol + 0.5 * x.double().abs() * 2.0 ** -20 if kind == "gelu" else atol


class _SavedLog:
    """Records every tensor autograd saves (through torch.autograd.graph.saved_tensors_hooks)."""

    def __init__(self):
        self.saved = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.saved.append(t)
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


# --------------------------------------------------------------------------------------------------- constants
@pytest.mark.parametrize("kind", KINDS)
def test_constants_satisfy_published_constraints(kind):
    _, _, _, c, a = KINDS[kind]
    assert math.isclose(sum(a), 1.0, abs_tol=1e-12)
    assert abs(sum(ai * ci for ai, ci in zip(a, c))) < 1e-12
    assert c[0] < c[1] < c[2]
    s = A.slopes(a)
    assert s == pytest.approx((0.0, a[0], a[0] + a[1], 1.0), abs=1e-12)


@pytest.mark.parametrize("kind,half_width", [("gelu", 6.07), ("silu", 38.2)])
def test_constants_are_a_minimum_of_the_design_objective(kind, half_width):
    """Re-minimising ∫(h − Σ a_i·max(x − c_i, 0))² from the published values must not move them materially."""
    np = pytest.importorskip("numpy")
    optimize = pytest.importorskip("scipy.optimize")
    special = pytest.importorskip("scipy.special")
    _, _, _, c, a = KINDS[kind]
    x = np.linspace(-half_width, half_width, 20001)
    h = 0.5 * x * (1 + special.erf(x / math.sqrt(2))) if kind == "gelu" else x * special.expit(x)

    def full(p):  # eliminate a3 (Σ a = 1) and c3 (Σ a·c = 0)
        c1, c2, a1, a2 = p
        a3 = 1 - a1 - a2
        return (c1, c2, -(a1 * c1 + a2 * c2) / a3), (a1, a2, a3)

    def objective(p):
        cc, aa = full(p)
        approx = sum(ai * np.maximum(x - ci, 0) for ai, ci in zip(aa, cc))
        return np.trapezoid((h - approx) ** 2, x)

    p0 = np.array([c[0], c[1], a[0], a[1]])
    assert np.allclose(full(p0)[0], c, atol=1e-9)  # the published c3 follows from the constraints
    res = optimize.minimize(objective, p0, method="Nelder-Mead", options=dict(xatol=1e-8, fatol=1e-14, maxiter=3000))
    c_opt, a_opt = full(res.x)
    assert res.fun <= objective(p0)
    assert (objective(p0) - res.fun) / res.fun < 1e-3, "published constants are far from the objective's minimum"
    assert np.max(np.abs(np.array(c_opt) - c)) < 0.05
    assert np.max(np.abs(np.array(a_opt) - a)) < 5e-3
    # and a visibly worse point is worse: the objective does discriminate
    assert objective(p0 * np.array([1.1, 1, 1.1, 1])) > objective(p0) * 1.01


# -------------------------------------------------------------------------------------- reference against math
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_forward_matches_float64_math(kind, dtype):
    x = _rand((37, 11), dtype)
    y, _ = A.forward_reference(x, KINDS[kind][0])
    assert y.dtype == dtype and y.shape == x.shape
    exact = _exact64(kind, x)
    # fp32 compute of 0.5·x·(1+erf) cancels for x ≪ 0 (see _lib_atol); otherwise ≤ 2 ulp of dtype
    _assert_within_ulps(y, exact, dtype, ulps=2.0, atol=_lib_atol(kind, x))


@pytest.mark.parametrize("kind", KINDS)
def test_codes_match_float64_thresholding(kind):
    k, _, _, c, _ = KINDS[kind]
    x = _rand((9, 13), torch.float32)
    # put values exactly on and next to every (fp32-rounded) breakpoint
    edges = []
    for ci in c:
        t = torch.tensor(_fp32(ci), dtype=torch.float32)
        edges += [torch.nextafter(t, torch.tensor(-1e9)), t, torch.nextafter(t, torch.tensor(1e9))]
    x = torch.cat([x.reshape(-1), torch.stack(edges)])
    got = A.codes_reference(x, c)
    assert torch.equal(got, _codes64(x, c))
    assert set(got.unique().tolist()) == {0, 1, 2, 3}
    # away from the breakpoints the float64 constants give the same codes
    far = x[torch.stack([(x.double() - ci).abs() > 1e-5 for ci in c]).all(0)]
    direct = sum((far.double() > ci).to(torch.uint8) for ci in c)
    assert torch.equal(A.codes_reference(far, c), direct)


def test_pack_layout_is_lsb_first_four_per_byte():
    codes = torch.tensor([1, 2, 3, 0, 3, 1], dtype=torch.uint8)
    packed = A.pack_codes(codes)
    assert packed.tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 1 << 2]
    assert torch.equal(A.unpack_codes(packed, 6), codes)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 1001])
def test_pack_unpack_roundtrip(n):
    codes = torch.randint(0, 4, (n,), dtype=torch.uint8)
    packed = A.pack_codes(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 3) // 4
    assert torch.equal(A.unpack_codes(packed, n), codes)
    # bit layout against a per-element loop
    for i in range(min(n, 40)):
        assert (int(packed[i // 4]) >> (2 * (i % 4))) & 3 == int(codes[i])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1001])
def test_reference_forward_codes_are_packed_thresholds(kind, n):
    k, _, _, c, _ = KINDS[kind]
    x = _rand((n,), torch.float32)
    _, packed = A.forward_reference(x, k)
    assert torch.equal(packed[:-1], A.pack_codes(_codes64(x, c)))
    assert packed[-1] == 0  # the flag byte: no NaN
    assert A.forward_reference(x, k, with_codes=False)[1].numel() == 0
    # every code 3 (all bits set, the int32 lane's sign bit included) and every code 0
    assert A.forward_reference(torch.full((n,), 50.0), k)[1][:-1].tolist() == [255] * (n // 4) + [
        (1 << 2 * (n % 4)) - 1] * (n % 4 > 0)
    assert A.forward_reference(torch.full((n,), -50.0), k)[1][:-1].tolist() == [0] * ((n + 3) // 4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_backward_is_dy_times_slope_of_code(kind, dtype, torch_backend):
    k, fn, _, c, a = KINDS[kind]
    x = _rand((6, 17), dtype).requires_grad_()  # 102 elements: a partial last code byte
    dy = _rand((6, 17), dtype, scale=1.0)
    (dx,) = torch.autograd.grad(fn(x), x, dy)
    s64 = torch.tensor([0.0, *a], dtype=torch.float64).cumsum(0)  # (0, a1, a1+a2, a1+a2+a3), not via A.slopes
    expected = dy.double() * s64[_codes64(x.detach(), c).long()]
    assert dx.dtype == dtype
    # the op multiplies by the fp32-rounded slope (as the kernel does): half an ulp for that, half for the product
    _assert_within_ulps(dx, expected, dtype, ulps=1.5)


# ---------------------------------------------------------------------------------- Triton against reference
def _run_autograd(fn, x, dy):
    """Forward + backward through the public function; returns y, dx and the packed codes autograd saved."""
    x = x.detach().requires_grad_()
    with _SavedLog() as log:
        y = fn(x)
    (dx,) = torch.autograd.grad(y, x, dy) if x.numel() else (torch.zeros_like(x),)
    assert len(log.saved) == 1, f"saved {len(log.saved)} tensors, expected only the packed codes"
    return y.detach(), dx, log.saved[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + ["noncontig"])
def test_triton_matches_reference(kind, dtype, shape, monkeypatch):
    pytest.importorskip("triton")
    k, fn, _, _, _ = KINDS[kind]
    if shape == "noncontig":
        x = _rand((10, 7), dtype).t()
        dy = _rand((10, 7), dtype, scale=1.0).t()
        assert not x.is_contiguous()
    else:
        x, dy = _rand(shape, dtype), _rand(shape, dtype, scale=1.0)
    force_backend(monkeypatch, "torch")
    y0, dx0, p0 = _run_autograd(fn, x, dy)
    force_backend(monkeypatch, "triton")
    y1, dx1, p1 = _run_autograd(fn, x, dy)
    assert torch.equal(p0, p1), "packed codes differ"
    assert y1.shape == x.shape and y1.dtype == dtype and dx1.dtype == dtype
    if dtype == torch.float32:
        _assert_within_ulps(y1, y0, dtype, ulps=2.0, atol=_lib_atol(kind, x))  # erf/exp of two libraries
        assert torch.equal(dx1, dx0)
    else:  # the interpreter truncates fp32 -> bf16 stores: one ulp (a GPU rounds and matches exactly)
        _assert_within_ulps(y1, y0, dtype, ulps=1.0, atol=1e-6)
        _assert_within_ulps(dx1, dx0, dtype, ulps=1.0)


_INF, _NAN = float("inf"), float("nan")
_SPECIAL_X = [-_INF, _INF, _NAN, -100.0, 100.0, 0.0, -0.0, 1e-40, -90.0]


def _special_expected(kind):
    """f(-inf) = -0, f(+inf) = +inf, f(NaN) = NaN by the definition's limits; finite inputs from float64 math."""
    x = torch.tensor(_SPECIAL_X, dtype=torch.float64)
    y = _exact64(kind, x)
    y[:3] = torch.tensor([-0.0, _INF, _NAN], dtype=torch.float64)
    return y.float()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: inf * 0, exp overflow
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", KINDS)
def test_special_values_follow_the_mathematics(kind, backend, monkeypatch):
    """Expected values written from the definition, not from F.gelu / F.silu (whose vectorised CPU path returns NaN
    for +inf in torch 2.14.1 on some CPUs): the result must not depend on the CPU's vector unit."""
    force_backend(monkeypatch, backend)
    k = KINDS[kind][0]
    x = torch.tensor(_SPECIAL_X)
    expected = _special_expected(kind)
    y, packed = (A.forward_triton if backend == "triton" else A.forward_reference)(x, k)
    # fp32 compute: exp(90) overflows, so SiLU(-90) = -7.4e-38 comes out as -0 (an absolute error of 1e-37)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-37, equal_nan=True)
    codes = A.unpack_codes(packed[:-1], x.numel())
    c = KINDS[kind][3]
    assert codes.tolist() == [0, 3, 0] + _codes64(x[3:], c).tolist()  # -inf lowest, +inf top, NaN code 0
    assert int(packed[-1]) == AR.NAN_FLAG


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_reference_on_special_values(kind, triton_backend):
    k = KINDS[kind][0]
    x = torch.tensor(_SPECIAL_X)
    y0, p0 = A.forward_reference(x, k)
    y1, p1 = A.forward_triton(x, k)
    assert torch.equal(p0, p1)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-44, equal_nan=True)
    for dy in (torch.ones_like(x), torch.tensor([1.0, _NAN, 2.0, _INF, -_INF, 1.0, 0.0, 1.0, 1.0])):
        torch.testing.assert_close(A.backward_triton(dy, p1, k), A.backward_reference(dy, p0, k), rtol=0, atol=0,
                                   equal_nan=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_inputs_give_non_finite_gradients(kind, backend, monkeypatch):
    """NaN in → NaN gradient (as F.gelu / F.silu); +inf → f'(+inf) = 1, -inf → f'(-inf) = 0 when no NaN is present."""
    force_backend(monkeypatch, backend)
    fn = KINDS[kind][1]
    x = torch.tensor([_NAN, 0.5, 2.0, -1.0], requires_grad=True)
    (g,) = torch.autograd.grad(fn(x), x, torch.ones(4))
    assert torch.isnan(g[0])
    assert torch.isfinite(g[1:]).all()
    x = torch.tensor([_INF, -_INF, 0.5, 50.0], requires_grad=True)
    (g,) = torch.autograd.grad(fn(x), x, torch.ones(4))
    assert g[0] == 1.0 and g[1] == 0.0 and g[3] == 1.0
    # a NaN upstream gradient stays NaN, also where the slope is 0
    x = torch.tensor([-50.0, 50.0], requires_grad=True)
    (g,) = torch.autograd.grad(fn(x), x, torch.tensor([_NAN, _NAN]))
    assert torch.isnan(g).all()


# --------------------------------------------------------------------------------------------- saved bytes
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1,), (3,), (5, 7), (0,), (4, 9, 6)])
def test_saves_only_ceil_n_over_4_bytes_and_a_flag(backend, kind, shape, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
    force_backend(monkeypatch, backend)
    fn = KINDS[kind][1]
    x = _rand(shape, torch.bfloat16).requires_grad_()
    with _SavedLog() as log:
        fn(x * 1)  # a non-leaf input, as inside a model
    n = x.numel()
    assert len(log.saved) == 1, [(t.dtype, tuple(t.shape)) for t in log.saved]  # `x * 1` saves no tensor
    (codes,) = log.saved
    assert codes.dtype == torch.uint8 and codes.numel() == (n + 3) // 4 + 1 == A.saved_bytes(n, 2)
    assert codes.untyped_storage().nbytes() == (n + 3) // 4 + 1


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_saves_nothing_and_matches(kind, torch_backend):
    fn = KINDS[kind][1]
    x = _rand((5, 7), torch.float32)
    with _SavedLog() as log:
        with torch.no_grad():
            y = fn(x.clone().requires_grad_())
        y2 = fn(x)
    assert log.saved == []
    assert torch.equal(y, y2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fake_tensors_take_the_reference_and_save_the_same_bytes(device, triton_backend):
    """Paper-scale memory estimates run models on fake tensors: no kernel launch, same saved bytes, no cache
    poisoning."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(64, 197, 3072, device=device, dtype=torch.bfloat16, requires_grad=True)
        with _SavedLog() as log:
            y = A.regelu2(x)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert y.shape == dx.shape == x.shape and dx.dtype == torch.bfloat16
    assert [(t.dtype, t.numel()) for t in log.saved] == [(torch.uint8, 64 * 197 * 3072 // 4 + 1)]
    monkey = torch.randn(7, requires_grad=True)  # real tensors afterwards still work
    with pytest.MonkeyPatch.context() as mp:
        force_backend(mp, "torch")
        (g,) = torch.autograd.grad(A.regelu2(monkey), monkey, torch.ones(7))
    assert torch.equal(g, A.backward_reference(torch.ones(7), A.forward_reference(monkey.detach(), AR._GELU)[1], 0))


# ------------------------------------------------------------------------------------------ modules and errors
@pytest.mark.parametrize("kind", KINDS)
def test_module_equals_function(kind):
    _, fn, mod, _, _ = KINDS[kind]
    x = _rand((3, 8), torch.float32)
    m = mod()
    assert list(m.parameters()) == []
    assert torch.equal(m(x), fn(x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64])
def test_unsupported_dtype_raises_clear_error(kind, bad):
    fn = KINDS[kind][1]
    with pytest.raises(TypeError, match="unsupported dtype"):
        fn(torch.zeros(5, dtype=bad))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        fn([1.0, 2.0])


_AOT = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lowmembp.ops import approx_act_triton as AT
div16 = lambda sig: {(i,): [["tt.divisibility", 16]] for i, a in enumerate(sig) if sig[a][0] == "*" or a[0] == "n"}
for arch in (80, 90):
    for dt in ("fp32", "bf16"):
        sig = dict(x_ptr="*" + dt, y_ptr="*" + dt, code_ptr="*u8", t_ptr="*fp32", ws_ptr="*i32", n="i64",
                   nbytes="i64", KIND="constexpr", BITS="constexpr", NT="constexpr", NEG_ZERO="constexpr",
                   UNBOUNDED="constexpr", WRITE_CODES="constexpr", BLOCK="constexpr", TILES="constexpr")
        more = arch == 90 and dt == "fp32"  # the other kinds / bits once: each compile costs seconds
        for kind, bits in ((0, 2), (3, 2)) + (((1, 3), (5, 4), (4, 1)) if more else ()):
            const = dict(KIND=kind, BITS=bits, NT=2 ** bits - 1, NEG_ZERO=kind < 4, UNBOUNDED=kind == 5,
                         WRITE_CODES=True, BLOCK=512, TILES=4)
            k = triton.compile(ASTSource(AT._act_fwd_kernel, sig, const, div16(sig)),
                               target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8))
            assert "ld.global.v" in k.asm["ptx"], "forward loads are not vectorised"
            assert "atom.global" in k.asm["ptx"], "the flag byte's ticket is not an atomic"
        sig = dict(dy_ptr="*" + dt, code_ptr="*u8", s_ptr="*fp32", dx_ptr="*" + dt, n="i32",
                   nbytes="i32", BITS="constexpr", NS="constexpr", BLOCK="constexpr")
        for bits in (1, 2, 3, 4) if more else (2,):
            k = triton.compile(ASTSource(AT._act_bwd_kernel, sig, dict(BITS=bits, NS=2 ** bits, BLOCK=512),
                                         div16(sig)), target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8))
            assert "ld.global.v" in k.asm["ptx"], "backward loads are not vectorised"
print("compiled")
"""


def test_kernels_compile_for_cuda_without_a_gpu():
    """Ahead-of-time compile to sm_80/sm_90 cubin (needs no GPU): catches lowering errors the interpreter cannot."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    proc = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and ("TypeError" in proc.stderr and "ASTSource" in proc.stderr or "GPUTarget" in proc.stderr
                            and "ImportError" in proc.stderr):
        pytest.skip(f"this triton's ahead-of-time API differs: {proc.stderr.splitlines()[-1]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_beyond_2_to_31_elements(kind):
    """64-bit offsets: elements past 2**31 come out right (needs ~9 GB of GPU memory)."""
    k = KINDS[kind][0]
    n = 2 ** 31 + 4099
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_(0, 4)
    y, packed = A.forward_triton(x, k)
    s = n - 8195  # a multiple of 4: the tail starts on a whole code byte (4 two-bit codes a byte)
    y_ref, p_ref = A.forward_reference(x[s:], k)
    _assert_within_ulps(y[s:], y_ref, torch.bfloat16, ulps=1.0, atol=1e-6)
    # both forwards return the packed codes followed by one flag byte (NaN / +inf seen): the codes are [:-1]
    assert packed.numel() == A.saved_bytes(n) and p_ref.numel() == A.saved_bytes(n - s)
    assert torch.equal(A.unpack_codes(packed[s // 4:-1], n - s), A.unpack_codes(p_ref[:-1], n - s))
    assert int(packed[-1]) == int(p_ref[-1]) == 0  # normal samples: no NaN, no +inf


# ------------------------------------------------------------------------------------ every kind, every bit width
ALL = [(k, b) for k in A.KINDS for b in A.BITS]
_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _exact64_any(kind, x):
    x = x.double()
    if kind in ("gelu", "silu"):
        return _exact64(kind, x)
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_PI * (x + 0.044715 * x ** 3)))
    if kind == "quick_gelu":
        return x / (1.0 + torch.exp(-1.702 * x))
    r = torch.clamp(x, min=0.0)
    return r if kind == "relu" else r * r


@pytest.mark.parametrize("kind", A.KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kind_forward_matches_float64_math(kind, dtype, torch_backend):
    x = _rand((37, 11), dtype)
    y = A.approx_act(x, kind, 2)
    exact = _exact64_any(kind, x)
    _assert_within_ulps(y, exact, dtype, ulps=2.0 if dtype == torch.float32 else 1.0, atol=_lib_atol(kind, x))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kind", A.KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kind_forward_matches_float64_math_on_a_dense_sweep(kind, dtype, backend, monkeypatch):
    """[-12, 12] at 1.2e-4 spacing, through the reference and the CPU fast path: a CPU-dependent library error
    shows on every run, not only when the random inputs above happen to land on it."""
    force_backend(monkeypatch, backend)
    x = torch.linspace(-12, 12, 200_001, dtype=torch.float64).to(dtype)
    y = A.approx_act(x, kind, 2)
    _assert_within_ulps(y, _exact64_any(kind, x), dtype, ulps=2.0 if dtype == torch.float32 else 1.0,
                        atol=_lib_atol(kind, x))


@pytest.mark.parametrize("kind,bits", ALL)
def test_every_kind_and_bits_backward_is_dy_times_slope_of_code(kind, bits, torch_backend):
    c, a = A.constants(kind, bits)
    x = _rand((5, 13), torch.float32).requires_grad_()  # 65 elements: a partial last group of 8
    dy = _rand((5, 13), torch.float32, scale=1.0)
    (dx,) = torch.autograd.grad(A.approx_act(x, kind, bits), x, dy)
    s64 = torch.tensor([0.0, *a], dtype=torch.float64).cumsum(0)
    codes = _codes64(x.detach(), c)
    assert int(codes.max()) <= 2 ** bits - 1
    _assert_within_ulps(dx, dy.double() * s64[codes.long()], torch.float32, ulps=1.5)


@pytest.mark.parametrize("bits", A.BITS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 17, 1001])
def test_pack_unpack_roundtrip_any_bits(bits, n):
    codes = torch.randint(0, 2 ** bits, (n,), dtype=torch.uint8)
    packed = A.pack_codes(codes, bits)
    assert packed.numel() == (n * bits + 7) // 8
    assert torch.equal(A.unpack_codes(packed, n, bits), codes)
    stream = sum(int(v) << (bits * i) for i, v in enumerate(codes.tolist()))  # the little-endian bit stream
    assert packed.tolist() == [(stream >> (8 * j)) & 0xFF for j in range(packed.numel())]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind,bits", ALL)
def test_triton_matches_reference_every_kind_and_bits(kind, bits, triton_backend):
    x = torch.cat([_rand((203,), torch.float32), torch.tensor(_SPECIAL_X)])
    c32 = A._consts32(kind, bits)[0]
    x = torch.cat([x, torch.tensor(c32)])  # values exactly on the breakpoints
    for dt in (torch.float32, torch.bfloat16):
        # the interpreter flushes subnormal bf16 to 0 when it widens them (a GPU does not): none in bf16
        xd = torch.where(x.abs() < torch.finfo(torch.float32).tiny, 0.0, x).to(dt) if dt == torch.bfloat16 else x
        y0, p0 = A.forward_reference(xd, kind, True, bits)
        y1, p1 = A.forward_triton(xd, kind, True, bits)
        assert torch.equal(p0, p1), "codes differ"
        assert p0.numel() == A.saved_bytes(x.numel(), bits)
        if dt == torch.float32:
            torch.testing.assert_close(y1, y0, rtol=4e-6, atol=1e-6, equal_nan=True)
        dy = _rand(x.shape, dt, scale=1.0)
        d1, d0 = A.backward_triton(dy, p1, kind, bits), A.backward_reference(dy, p0, kind, bits)
        assert torch.equal(torch.isnan(d1), torch.isnan(d0)) and torch.equal(torch.isinf(d1), torch.isinf(d0))
        if dt == torch.float32:
            torch.testing.assert_close(d1, d0, rtol=0, atol=0, equal_nan=True)
        else:  # the interpreter truncates fp32 -> bf16 stores: one ulp (a GPU rounds and matches exactly)
            ok = torch.isfinite(d0)
            _assert_within_ulps(d1[ok], d0[ok], dt, ulps=1.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_relu2_plus_inf_gives_an_infinite_gradient(backend, monkeypatch):
    force_backend(monkeypatch, backend)
    x = torch.tensor([_INF, 1.0, -_INF, -2.0], requires_grad=True)
    y = A.approx_act(x, "relu2", 2)
    assert y[0] == _INF and y[2] == 0.0
    (g,) = torch.autograd.grad(y, x, torch.ones(4))
    assert g[0] == _INF and torch.isfinite(g[1:]).all() and g[2] == 0.0  # relu2'(+inf) = inf, relu2'(-inf) = 0


def test_double_backward_is_the_same_linear_map(torch_backend):
    """dx = dy·s[code] is linear in dy: its derivative in dy is s[code], in x it is 0 (h̃'' = 0 a.e.)."""
    x = _rand((4, 9), torch.float32).requires_grad_()
    dy = _rand((4, 9), torch.float32, scale=1.0).requires_grad_()
    (dx,) = torch.autograd.grad(A.regelu2(x), x, dy, create_graph=True)
    v = _rand((4, 9), torch.float32, scale=1.0)
    (gdy,) = torch.autograd.grad(dx, dy, v)
    s64 = torch.tensor([0.0, *A.REGELU2_A], dtype=torch.float64).cumsum(0)
    _assert_within_ulps(gdy, v.double() * s64[_codes64(x.detach(), A.REGELU2_C).long()], torch.float32, ulps=1.5)


@pytest.mark.parametrize("kind,bits", [("gelu", 2), ("silu", 2), ("gelu_tanh", 2), ("quick_gelu", 3),
                                       ("relu", 1), ("relu2", 4)])
def test_make_approx(kind, bits):
    m = A.make_approx(kind, bits)
    assert f"kind={kind}" in repr(m) and f"bits={bits}" in repr(m)
    assert (type(m).__name__ == {"gelu": "ReGELU2", "silu": "ReSiLU2"}.get(kind, "ApproxAct")) or bits != 2
    x = _rand((3, 8), torch.float32).requires_grad_()
    assert torch.equal(m(x), A.approx_act(x, kind, bits))
    with _SavedLog() as log:
        m(x)
    assert [t.numel() for t in log.saved] == [A.saved_bytes(24, bits)] == [(24 * bits + 7) // 8 + 1]


def test_make_approx_errors():
    with pytest.raises(ValueError, match="gelu, gelu_tanh, quick_gelu, silu, relu, relu2"):
        A.make_approx("tanh")
    with pytest.raises(ValueError, match="bits must be one of"):
        A.make_approx("gelu", 5)
    assert type(A.make_approx("gelu")) is A.ReGELU2 and type(A.make_approx("silu", 2)) is A.ReSiLU2


def test_package_level_names():
    from lowmembp.ops import (ApproxAct, MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2, derive, make_approx,  # noqa
                              ms_layer_norm, ms_rms_norm, regelu2, resilu2)
    import lowmembp.ops as ops
    assert {"regelu2", "resilu2", "ms_layer_norm", "ms_rms_norm", "make_approx", "derive"} <= set(ops.__all__)
    assert regelu2 is A.regelu2 and callable(derive)


def test_torch_func_gradient_transforms_and_forward_ad_raise(torch_backend):
    x = _rand((3, 8), torch.float32)
    for transform in (lambda: torch.func.grad(lambda t: A.regelu2(t).sum())(x),
                      lambda: torch.func.jacrev(A.resilu2)(x[0]), lambda: torch.func.jacfwd(A.regelu2)(x[0])):
        with pytest.raises(RuntimeError, match=r"approx_act\((gelu|silu), bits=2\): torch.func gradient transforms"):
            transform()
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        A.regelu2(fwAD.make_dual(x, torch.ones_like(x)))
    torch.testing.assert_close(torch.func.vmap(A.regelu2)(x), A.regelu2(x))  # vmap alone works


@pytest.mark.parametrize("kind", ["gelu", "relu2"])
@pytest.mark.parametrize("special", ["none", "nan", "inf", "both"])
def test_triton_forward_over_several_tiles_and_programs(kind, special, monkeypatch, gen):
    """The GPU's launch shape through the interpreter: programs of several tiles (the flags gathered over the tiles,
    one ticket per program, the last program writing the flag byte), on an odd length that ends mid-tile. The codes,
    output and flag byte equal the reference's, and the workspace is back at zero for the next call."""
    monkeypatch.setattr(AT, "_launch_cfg", lambda groups: (16, 3, 4))  # 384 elements a program
    x = torch.randn(1, 1283, generator=gen) * 4
    if special in ("nan", "both"):
        x[0, 700] = float("nan")
    if special in ("inf", "both"):
        x[0, 1281] = float("inf")
    y, packed = A.forward_triton(x, kind)
    y_ref, p_ref = A.forward_reference(x, kind)
    assert torch.equal(packed, p_ref)  # codes and the flag byte
    fin = torch.isfinite(x)
    assert torch.equal(y[~fin], y_ref[~fin]) or torch.equal(y[~fin].isnan(), y_ref[~fin].isnan())
    # Triton's fp32 erf / exp against the library's: within 0.5·|x|·2⁻²⁰ (+ a rounding), as the other Triton tests
    assert ((y - y_ref)[fin].abs() <= 0.5 * x[fin].abs() * 2.0 ** -20 + 1e-7).all()
    assert all(int(v) == 0 for v in AT._WORKSPACE.values() for v in v)

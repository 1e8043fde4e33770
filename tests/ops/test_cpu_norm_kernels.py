"""The MS-norms' C kernels (lowmembp.ops.cpu_kernels: layer_norm_fwd, row_sums, norm_bwd_rows, norm_prod, norm_bwd,
cast) and the CPU fast path built on them (ms_norm_fwd_cpu / ms_norm_bwd_cpu) equal the PyTorch references
(ms_norm_fwd_ref / ms_norm_bwd_ref), ATen's LayerNorm and ATen's row sums bit for bit. The backward runs both ways:
whole in C, row by row, with ATen's summation order replicated ("rows"), and as two C passes around ATen's own sums
("passes", where the replica is off). The LayerNorm forward runs whole in C with ATen's arithmetic (the variant the
probe finds), and as C casts around ATen's fp32 norm where no variant is found.

Every comparison is of bits. Inputs are fresh random values, in every dtype pair the fast path takes, with rows of
1, 3, 7, 768, 4096 and 5000 elements and 1, 3 and 1576 rows, some mixed with NaN, ±inf and values whose products
overflow; on one thread and on two, with the native and the portable build of the kernels, and without them
(``LOWMEMBP_CPU_KERNELS=0``, no compiler). The LayerNorm forward is compared with ``torch.native_layer_norm`` on
rows of every length the probe uses, with large means, tiny and huge scales, constant rows, signed zeros,
subnormals and non-finite values, for several eps.
"""
import itertools
import warnings
from unittest import mock

import pytest
import torch

from lowmembp.ops import cpu_kernels as K
from lowmembp.ops import ms_norm as M
from lowmembp.ops import ms_norm_cpu as MC
from lowmembp.ops.cpu_kernels import build as KB
from lowmembp.ops.cpu_kernels import ms_norm as KN

from bitwise import assert_same
from backends import force_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAVE_CC = K.compiler() is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler ($CC, cc, gcc or clang) on this machine")
WIDTHS = (1, 3, 7, 768, 4096, 5000)
# (rows, width): every width with 1 and 3 rows, 1576 rows of the narrower ones
SHAPES = [(r, n) for n in WIDTHS for r in (1, 3)] + [(1576, n) for n in (1, 3, 7, 768)]


def rows_of(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def with_specials(t: torch.Tensor, gen, count: int = 6) -> torch.Tensor:
    """``t`` with ``count`` random elements set to NaN, ±inf, ±max of its dtype and 0."""
    info = torch.finfo(t.dtype)
    vals = torch.tensor([float("nan"), float("inf"), float("-inf"), info.max, -info.max, 0.0], dtype=t.dtype)
    flat = t.reshape(-1)
    k = min(count, flat.numel())
    flat[torch.randperm(flat.numel(), generator=gen)[:k]] = vals[torch.randint(len(vals), (k,), generator=gen)]
    return t


@pytest.fixture(params=["rows", "passes"])
def bwd_path(request, monkeypatch):
    """The backward whole in C (ATen's row sums replicated, where the probe finds them) or as two C passes around
    ATen's own row sums (the replica turned off)."""
    if request.param == "rows":
        assert K.library() is None or K.aten_sum_width() in K.SUM_WIDTHS, "ATen's CPU sum is not replicated here"
    else:
        monkeypatch.setattr(KN, "aten_sum_width", lambda: None)
    return request.param


@pytest.fixture(params=["whole", "casts"])
def fwd_path(request, monkeypatch):
    """The LayerNorm forward whole in C (ATen's arithmetic, where the probe finds its variant) or as C casts around
    ATen's fp32 norm (the variant taken away)."""
    if request.param == "whole":
        assert K.library() is None or K.layer_norm_variant() is not None, "ATen's LayerNorm is not replicated here"
    else:
        monkeypatch.setattr(KN, "layer_norm_variant", lambda: None)
    return request.param


def check_bwd(g, y, rstd, kind, dx_dtype, what, expect_kernel=True):
    """The fast path's dx equals the reference's; for finite inputs also that the C passes produced it (the
    reference is not called)."""
    want = M.ms_norm_bwd_ref(g, y, rstd, kind, dx_dtype)
    if expect_kernel:
        with mock.patch.object(MC, "ms_norm_bwd_ref", side_effect=AssertionError("the reference ran")):
            got = M.ms_norm_bwd_cpu(g, y, rstd, kind, dx_dtype)
    else:
        got = M.ms_norm_bwd_cpu(g, y, rstd, kind, dx_dtype)
    assert_same(got, want, what)


# ------------------------------------------------------------------------------------------------ ATen's addcmul
def test_addcmul_probe_says_how_aten_rounds(gen):
    """The probe's answer matches ATen's addcmul on random values: one rounding (fused) or two."""
    fused = K.addcmul_fused()
    assert fused is not None, "ATen's addcmul rounds neither as one fused multiply-add nor as two operations"
    for k in (1, 7, 1000):
        s, a = torch.randn(k, generator=gen), torch.randn(k, generator=gen)
        m = torch.randn(k, generator=gen)
        want = (s.double() - a.double() * m.double()).float() if fused else s - a * m
        got = torch.addcmul(s, a, m, value=-1.0)
        # one rounding from float64 is two roundings in rare ties; the random values have none with near certainty
        assert_same(got, want, f"addcmul of {k} elements, fused={fused}")


# -------------------------------------------------------------------------------------------------- the backward
@needs_cc
@pytest.mark.parametrize("g_dtype, y_dtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("kind", M.KINDS)
def test_bwd_equals_reference(kind, g_dtype, y_dtype, threads, bwd_path, gen, monkeypatch):
    """Every dtype pair of g and y, every dx dtype, every shape; the C passes ran (no fallback)."""
    monkeypatch.setattr(KB, "_OFF", False)
    for (rows, n), dx_dtype in itertools.product(SHAPES, DTYPES):
        if rows * n > 10**5 and dx_dtype != y_dtype:  # the big shapes: the dx dtype of y
            continue
        g, y = rows_of((rows, n), g_dtype, gen, 2.0), rows_of((rows, n), y_dtype, gen)
        rstd = torch.rand(rows, generator=gen) + 0.5
        check_bwd(g, y, rstd, kind, dx_dtype, f"{kind} {rows}x{n} g {g_dtype} y {y_dtype} dx {dx_dtype}")


@needs_cc
@pytest.mark.parametrize("kind", M.KINDS)
def test_bwd_small_blocks_and_portable_build_equal_reference(kind, kernels, threads, bwd_path, gen, monkeypatch):
    """Many block boundaries (blocks of 64 elements) and the portable build (no vector instructions)."""
    monkeypatch.setattr(MC, "_KERNEL_BLOCK", 64)
    for (rows, n), (g_dtype, y_dtype, dx_dtype) in itertools.product(
            [(3, 7), (50, 13), (5, 768), (2, 5000)], [(torch.float32,) * 3, (torch.bfloat16,) * 3,
                                                      (torch.float16,) * 3, (torch.bfloat16, torch.float32,
                                                                             torch.float16)]):
        g, y = rows_of((rows, n), g_dtype, gen, 2.0), rows_of((rows, n), y_dtype, gen)
        rstd = torch.rand(rows, generator=gen) + 0.5
        check_bwd(g, y, rstd, kind, dx_dtype, f"{kernels} {kind} {rows}x{n} {g_dtype} {y_dtype} {dx_dtype}")


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", M.KINDS)
def test_bwd_non_finite_and_overflow_equal_reference(kind, dtype, threads, bwd_path, gen, monkeypatch):
    """NaN, ±inf, ±max in g and in y (products that overflow, rows whose sums are inf or NaN): the same bits."""
    monkeypatch.setattr(KB, "_OFF", False)
    for rows, n in [(1, 1), (3, 7), (3, 768), (1, 5000), (40, 768)]:
        for where in ("g", "y", "both"):
            g, y = rows_of((rows, n), dtype, gen, 2.0), rows_of((rows, n), dtype, gen)
            if where in ("g", "both"):
                with_specials(g, gen)
            if where in ("y", "both"):
                with_specials(y, gen)
            rstd = torch.rand(rows, generator=gen) + 0.5
            for dx_dtype in DTYPES:
                check_bwd(g, y, rstd, kind, dx_dtype, f"{kind} {rows}x{n} {dtype} specials in {where}",
                          expect_kernel=False)
    big = torch.full((2, 768), torch.finfo(dtype).max, dtype=dtype)  # finite inputs, every product overflows
    check_bwd(big, big, torch.ones(2), kind, dtype, f"{kind} all max", expect_kernel=False)


@needs_cc
def test_bwd_kernel_calls_equal_reference_steps(kernels, gen):
    """The kernels called directly: norm_prod is the reference's gf * yf (and gf), norm_bwd its addcmul, sub_ and
    mul_ from the row sums."""
    rows, n = 5, 333
    for g_dtype, y_dtype, dx_dtype in itertools.product(DTYPES, DTYPES, DTYPES):
        g, y = rows_of((rows, n), g_dtype, gen, 2.0), rows_of((rows, n), y_dtype, gen)
        rstd = torch.rand(rows, generator=gen) + 0.5
        gf, yf = g.float(), y.float()
        prod, gcopy = torch.empty(rows * n + 3), torch.empty(rows * n + 3)
        assert K.norm_prod(g, y, prod, gcopy)
        assert_same(prod[:rows * n].view(rows, n), gf * yf, "g * y")
        assert_same(gcopy[:rows * n].view(rows, n), gf, "fp32 g")
        sgy, sg = (gf * yf).sum(-1), gf.sum(-1)
        for mean in (True, False):
            dx = torch.empty((rows, n), dtype=dx_dtype)
            assert K.norm_bwd(g, y, sgy, sg if mean else None, rstd, dx) == 0
            want = torch.addcmul(gf, yf, sgy.div(n)[:, None], value=-1.0)
            if mean:
                want.sub_(gf.mean(-1, keepdim=True))
            assert_same(dx, want.mul_(rstd[:, None]).to(dx_dtype), f"dx {g_dtype} {y_dtype} {dx_dtype} mean={mean}")
    nan = torch.full((2, 4), float("nan"))
    assert K.norm_bwd(nan, nan, torch.zeros(2), None, torch.ones(2), torch.empty(2, 4)) == 1, "a NaN not reported"


# ------------------------------------------------------------------------------------------- ATen's row sums
def _spread(shape, gen):
    """Random fp32 values over 60 binades, both signs: any other summation order gives other bits."""
    return torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-30, 30, shape, generator=gen).float())


@needs_cc
def test_row_sums_equal_aten_sum(kernels, threads, gen):
    """The replica of ATen's cascade sum, at the probed width, equals ``x.sum(-1)`` on fresh rows of every length up
    to 80 and of lengths around the cascade's levels (16 and 256 groups of four vectors); the other widths do not."""
    width = K.aten_sum_width()
    assert width in K.SUM_WIDTHS, "no vector width replicates this torch's CPU sum"
    others = set(K.SUM_WIDTHS) - {width}
    differs = dict.fromkeys(others, False)
    for n in [*range(1, 81), 127, 333, 768, 1023, 1031, 4100, 11008, 16391, 32768]:
        x = _spread((3, n), gen)
        assert_same(K.row_sums(x, width), x.sum(-1), f"{n} elements, width {width}")
        for w in others:
            differs[w] |= not torch.equal(K.row_sums(x, w).view(torch.int32), x.sum(-1).view(torch.int32))
    assert all(differs.values()), f"a wrong width gave ATen's bits on every row: {differs}"
    z = torch.tensor([[-0.0] * 20, [-0.0, 1.0, -1.0] + [0.0] * 17])  # ATen adds the row sum to a zero: +0.0
    assert_same(K.row_sums(z, width), z.sum(-1), "signed zeros")


@needs_cc
@pytest.mark.parametrize("kind", M.KINDS)
def test_bwd_rows_called_directly_and_one_long_row(kind, kernels, threads, gen):
    """norm_bwd_rows called directly equals the reference; a single row of 32768 elements (which ATen sums over
    threads in two passes, another order) goes around the replica and still equals it."""
    for g_dtype, y_dtype, dx_dtype in [(torch.float32,) * 3, (torch.bfloat16, torch.float16, torch.float32)]:
        g, y = rows_of((7, 1001), g_dtype, gen, 2.0), rows_of((7, 1001), y_dtype, gen)
        rstd = torch.rand(7, generator=gen) + 0.5
        dx = torch.empty((7, 1001), dtype=dx_dtype)
        assert K.norm_bwd_rows(g, y, rstd, dx, kind == "layernorm") == 0
        assert_same(dx, M.ms_norm_bwd_ref(g, y, rstd, kind, dx_dtype), f"{kind} {g_dtype} {y_dtype} {dx_dtype}")
    g, y = _spread((1, 32768), gen), rows_of((1, 32768), torch.float32, gen)
    check_bwd(g, y, torch.ones(1), kind, torch.float32, f"{kind} one row of 32768")


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("kind", M.KINDS)
def test_bwd_rows_sums_straight_from_g_and_y(kind, dtype, kernels, threads, gen):
    """g and y of one dtype (the native build's sums straight from them, cascade_sums8, where ATen's width is 8):
    rows of every length around the cascade's vectors, groups and levels (16 and 256 groups of four vectors) equal the
    reference, for every dx dtype (fp32 g spread over 60 binades: another summation order gives other bits)."""
    for n in (8, 9, 15, 16, 31, 32, 33, 63, 64, 65, 100, 511, 512, 513, 1000, 8191, 8192, 8193, 16391, 32768):
        g = _spread((2, n), gen) if dtype == torch.float32 else rows_of((2, n), dtype, gen, 2.0)
        y = rows_of((2, n), dtype, gen)
        rstd = torch.rand(2, generator=gen) + 0.5
        for dx_dtype in DTYPES:
            dx = torch.empty((2, n), dtype=dx_dtype)
            assert K.norm_bwd_rows(g, y, rstd, dx, kind == "layernorm") == 0
            assert_same(dx, M.ms_norm_bwd_ref(g, y, rstd, kind, dx_dtype), f"{kernels} {kind} {n} {dtype} {dx_dtype}")


# --------------------------------------------------------------------------------------------------- the forward
@needs_cc
@pytest.mark.parametrize("x_dtype, out_dtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("kind", M.KINDS)
def test_fwd_equals_reference(kind, x_dtype, out_dtype, threads, fwd_path, gen, monkeypatch):
    """LayerNorm whole in C ("whole", where the probe finds ATen's variant) or the C casts around ATen's fp32 norm
    ("casts", as RMSNorm always): y and rstd equal the reference's, with and without special values; LayerNorm's
    whole C forward produced them for finite inputs (the reference did not run)."""
    monkeypatch.setattr(KB, "_OFF", False)
    own = kind == "layernorm" and fwd_path == "whole"
    for rows, n in SHAPES + [(3, 768)]:
        x = rows_of((rows, n), x_dtype, gen, 3.0)
        special = (rows, n) == (3, 768)
        if special:
            with_specials(x, gen)
        y0, r0 = M.ms_norm_fwd_ref(x, kind, 1e-5, out_dtype)
        if own and not special:
            with mock.patch.object(MC, "ms_norm_fwd_ref", side_effect=AssertionError("the reference ran")):
                y1, r1 = M.ms_norm_fwd_cpu(x, kind, 1e-5, out_dtype)
        else:
            y1, r1 = M.ms_norm_fwd_cpu(x, kind, 1e-5, out_dtype)
        assert_same(y1, y0, f"{kind} {rows}x{n} y")
        assert_same(r1, r0, f"{kind} {rows}x{n} rstd")


@needs_cc
@pytest.mark.parametrize("kind", M.KINDS)
def test_fwd_small_blocks_and_portable_build_equal_reference(kind, kernels, threads, fwd_path, gen, monkeypatch):
    monkeypatch.setattr(MC, "_KERNEL_BLOCK_FWD", 64)
    for (rows, n), (x_dtype, out_dtype) in itertools.product(
            [(3, 7), (50, 13), (5, 768), (2, 5000)],
            [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
             (torch.float32, torch.float32)]):
        x = rows_of((rows, n), x_dtype, gen, 3.0)
        y0, r0 = M.ms_norm_fwd_ref(x, kind, 1e-5, out_dtype)
        y1, r1 = M.ms_norm_fwd_cpu(x, kind, 1e-5, out_dtype)
        assert_same(y1, y0, f"{kernels} {kind} {rows}x{n} {x_dtype} {out_dtype} y")
        assert_same(r1, r0, f"{kernels} {kind} {rows}x{n} {x_dtype} {out_dtype} rstd")


@needs_cc
def test_cast_rounds_as_aten(kernels, gen):
    x = torch.cat([torch.randn(5000, generator=gen) * 1e3, torch.tensor([65504.0, 65520.0, 1e39, -0.0, 2**-140])])
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(x.numel(), dtype=dtype)
        assert K.cast(x, out) == 0
        assert_same(out, x.to(dtype), f"fp32 to {dtype}")
        back = torch.empty(x.numel())
        assert K.cast(out, back) == 0
        assert_same(back, out.float(), f"{dtype} to fp32")
    assert K.cast(torch.tensor([1.0, float("nan")]), torch.empty(2, dtype=torch.bfloat16)) == 1
    assert K.cast(x, torch.empty(x.numel())) is None  # fp32 to fp32: not a cast it does


# --------------------------------------------------------------------------------------- ATen's LayerNorm forward
def _native_ln(x: torch.Tensor, eps: float):
    """The reference's fp32 LayerNorm of the rows of x: ``native_layer_norm(x.float(), [n], None, None, eps)``'s y
    and rstd (one per row)."""
    y, _, r = torch.native_layer_norm(x.float(), x.shape[-1:], None, None, eps)
    return y, r.reshape(-1)


def _c_ln(x: torch.Tensor, eps: float, y_dtype=torch.float32, threads=None, variant=None):
    """lmbp_layer_norm_fwd's y (in y_dtype) and rstd of the rows of x, and its NaN bit."""
    y, r = torch.empty(x.shape, dtype=y_dtype), torch.empty(x.shape[0])
    bit = K.layer_norm_fwd(x, eps, y, r, threads=threads, variant=variant)
    return y, r, bit


def _check_ln(x: torch.Tensor, eps: float, what: str, y_dtype=torch.float32):
    """The C forward of x equals the reference's y (rounded to y_dtype) and rstd; where some y is NaN it says so."""
    want_y, want_r = _native_ln(x, eps)
    y, r, bit = _c_ln(x, eps, y_dtype)
    if bit:
        assert bool(want_y.isnan().any() or want_r.isnan().any()), f"{what}: a NaN reported where ATen has none"
        return
    assert not want_y.isnan().any(), f"{what}: a NaN of ATen's not reported"
    assert_same(r, want_r, f"{what} rstd")
    assert_same(y, want_y.to(y_dtype), f"{what} y")


@needs_cc
def test_layer_norm_probe_finds_the_variant_and_no_other_matches(gen):
    """The probe finds a variant on this machine, and on fresh rows (the probe's kind of rows, other values) every
    other variant of the C replica gives other bits than ATen somewhere: the comparisons can fail."""
    found = K.layer_norm_variant()
    assert found is not None, "no variant of the C replica gives this torch's CPU native_layer_norm"
    cases = []
    for x in K.layer_norm_probe_rows(gen):
        want_y, want_r = _native_ln(x, 1e-5)
        cases.append((x, want_y.view(torch.int32), want_r.view(torch.int32)))
    cases.sort(key=lambda c: c[0].numel())  # the small ones first: most variants differ there already

    def matches(variant):
        for x, want_y, want_r in cases:
            y, r, bit = _c_ln(x, 1e-5, threads=1, variant=variant)
            if bit or not torch.equal(y.view(torch.int32), want_y) or not torch.equal(r.view(torch.int32), want_r):
                return False
        return True

    assert matches(found), f"the probed variant ({found}) differs from ATen on fresh rows"
    same = [str(v) for v in K.layer_norm_variants() if v != found and matches(v)]
    assert not same, f"other variants give ATen's bits on every row too: {same}"


@needs_cc
def test_layer_norm_fwd_equals_native_on_every_length(kernels, threads, gen):
    """fp32 rows of every length the probe uses (1, 3 rows; 1576 rows of some), values with varied means and
    scales: y and rstd are ATen's, on one thread and on two, in the native and the portable build."""
    for n in KN._LN_PROBE_LENGTHS:
        for rows in (1, 3):
            scale = float(2.0 ** torch.randint(-10, 10, (), generator=gen))
            x = torch.randn(rows, n, generator=gen) * scale + torch.randn(rows, 1, generator=gen) * scale * 8
            _check_ln(x, 1e-5, f"{kernels} {rows}x{n}")
    for n in (1, 7, 100, 768, 1025):
        _check_ln(torch.randn(1576, n, generator=gen) * 3 + 1, 1e-5, f"{kernels} 1576x{n}")


@needs_cc
@pytest.mark.parametrize("eps", [1e-5, 1e-6, 0.0])
def test_layer_norm_fwd_special_rows_equal_native(eps, kernels, gen):
    """Large means, tiny and huge scales, constant rows (variance 0), signed zeros, subnormals, NaN and ±inf (the
    kernel reports a NaN result), for three eps: ATen's bits wherever the result is a number."""
    cases = {
        "mean 1e4": lambda r, n: 1e4 + torch.randn(r, n, generator=gen),
        "mean -3e7": lambda r, n: -3e7 + torch.randn(r, n, generator=gen) * 10,
        "scale 1e-30": lambda r, n: torch.randn(r, n, generator=gen) * 1e-30,
        "scale 1e-20 mean 1e-18": lambda r, n: torch.randn(r, n, generator=gen) * 1e-20 + 1e-18,
        "scale 1e18": lambda r, n: torch.randn(r, n, generator=gen) * 1e18,
        "scale 1e30 (variance overflows)": lambda r, n: torch.randn(r, n, generator=gen) * 1e30,
        "constant": lambda r, n: torch.full((r, n), 0.7) * torch.randn(r, 1, generator=gen),
        "zeros of both signs": lambda r, n: torch.where(torch.rand(r, n, generator=gen) < 0.5, -0.0, 0.0),
        "-0 and one value": lambda r, n: torch.full((r, n), -0.0).index_fill_(1, torch.tensor([n // 2]), 1.5),
        "subnormals": lambda r, n: torch.randn(r, n, generator=gen) * 2.0 ** -140,
        "subnormals and normals": lambda r, n: torch.randn(r, n, generator=gen) * 2.0 ** -126 * (
            torch.rand(r, n, generator=gen) < 0.5) + torch.randn(r, n, generator=gen) * 2.0 ** -140,
    }
    for (name, make), n in itertools.product(cases.items(), (1, 3, 8, 37, 768, 5000)):
        _check_ln(make(3, n).float(), eps, f"{kernels} {name} {n} eps {eps}")
    for n in (1, 5, 768):
        for special in (float("nan"), float("inf"), float("-inf")):
            x = torch.randn(3, n, generator=gen)
            x[1, n // 2] = special
            y, r, bit = _c_ln(x, eps)
            assert bit == 1, f"{kernels} {special} in a row of {n}: not reported"
            want_y, want_r = _native_ln(x, eps)
            for row in (0, 2):  # the other rows are ATen's all the same
                assert_same(y[row], want_y[row], f"{kernels} row {row} beside {special}")
                assert_same(r[row], want_r[row], f"{kernels} rstd {row} beside {special}")


@needs_cc
@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_layer_norm_fwd_reads_and_writes_every_dtype(x_dtype, kernels, threads, gen):
    """bf16 / fp16 / fp32 x (ATen's norm of x.float()) and every y dtype (the reference's y.to(dtype)), fresh values
    with means, special values of the 16-bit types (their largest, subnormals)."""
    info = torch.finfo(x_dtype)
    for rows, n in [(1, 1), (3, 7), (5, 37), (3, 768), (2, 5000), (1576, 33)]:
        x = (torch.randn(rows, n, generator=gen) * 3 + torch.randn(rows, 1, generator=gen) * 20).to(x_dtype)
        edge = x.clone()
        flat = edge.reshape(-1)
        k = min(4, flat.numel())
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = torch.tensor([info.tiny / 4, -info.tiny / 2, info.max / 8, -0.0], dtype=x_dtype)[:k]
        for xin, y_dtype in itertools.product((x, edge), DTYPES):
            _check_ln(xin, 1e-5, f"{kernels} {x_dtype} -> {y_dtype} {rows}x{n}", y_dtype)


@needs_cc
def test_layer_norm_one_long_row_is_not_split(threads, gen, monkeypatch):
    """ATen computes each row on one thread (parallel over rows, grain 1): a single row of 32768 elements or more
    has the same bits as the C forward's one-thread row, with torch on two threads as on one; a row of 32768 runs
    the C forward through ms_norm_fwd_cpu (wider rows run the reference)."""
    monkeypatch.setattr(KB, "_OFF", False)
    for n in (32768, 32769, 65536, 100003):
        _check_ln(torch.randn(1, n, generator=gen) * 5 + 3, 1e-5, f"one row of {n}")
    x = (torch.randn(1, 32768, generator=gen) * 2 - 1).to(torch.bfloat16)
    y0, r0 = M.ms_norm_fwd_ref(x, "layernorm", 1e-5)
    with mock.patch.object(MC, "ms_norm_fwd_ref", side_effect=AssertionError("the reference ran")):
        y1, r1 = M.ms_norm_fwd_cpu(x, "layernorm", 1e-5)
    assert_same(y1, y0, "one bf16 row of 32768 y")
    assert_same(r1, r0, "one bf16 row of 32768 rstd")


@needs_cc
def test_layer_norm_native_and_portable_builds_agree_on_every_variant(portable_library, gen, monkeypatch):
    """Every variant gives the same bits in the native build (AVX2 registers for its fused width-8 moments) as in
    the portable one (lane arrays): the vector forms are the lane loops' arithmetic."""
    monkeypatch.setattr(KB, "_OFF", False)
    native = K.library()
    rows = [torch.randn(3, n, generator=gen) * 4 + torch.randn(3, 1, generator=gen) * 30
            for n in (5, 37, 300, 768, 1031, 4100)]
    rows.append(rows[3].to(torch.bfloat16))
    rows.append(rows[4].to(torch.float16))
    for variant in K.layer_norm_variants():
        for x in rows:
            got = []
            for lib in (native, portable_library):
                monkeypatch.setitem(KB._state, "lib", lib)
                got.append(_c_ln(x, 1e-5, torch.bfloat16 if x.dtype == torch.float16 else torch.float32,
                                 variant=variant))
            assert got[0][2] == got[1][2], f"{variant} {tuple(x.shape)} {x.dtype}: NaN bits differ"
            assert_same(got[0][0], got[1][0], f"{variant} {tuple(x.shape)} {x.dtype} y")
            assert_same(got[0][1], got[1][1], f"{variant} {tuple(x.shape)} {x.dtype} rstd")


@needs_cc
def test_layer_norm_fwd_checks_its_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="0-d"):
        K.layer_norm_fwd(torch.tensor(1.0), 1e-5, torch.empty(1), torch.empty(1))
    with pytest.raises(ValueError, match="contiguous"):
        K.layer_norm_fwd(x.t(), 1e-5, torch.empty(8, 3), torch.empty(8))
    with pytest.raises(ValueError, match="at least 3"):
        K.layer_norm_fwd(x, 1e-5, torch.empty(3, 8), torch.empty(2))
    with pytest.raises(ValueError, match="not a variant"):
        K.layer_norm_fwd(x, 1e-5, torch.empty(3, 8), torch.empty(3), variant=K.LayerNormVariant(5, 0))
    assert K.layer_norm_fwd(torch.empty(3, 0), 1e-5, torch.empty(3, 0), torch.empty(3)) is None
    assert K.layer_norm_fwd(x.double(), 1e-5, torch.empty(3, 8), torch.empty(3)) is None


@needs_cc
@pytest.mark.parametrize("shape", [(7,), (2, 3, 5), (3, 1, 4, 37)], ids=str)
def test_kernels_take_rows_of_any_dim(shape, kernels, gen):
    """layer_norm_fwd and norm_bwd_rows read the last dim of a contiguous 1-D, 3-D or 4-D tensor as rows: the same
    bits as the 2-D call on its rows (and as the reference)."""
    n = shape[-1]
    x = torch.randn(shape, generator=gen) * 3 + 1
    rows = x.numel() // n
    y, r = torch.empty(shape), torch.empty(rows)
    y2, r2 = torch.empty(rows, n), torch.empty(rows)
    assert K.layer_norm_fwd(x, 1e-5, y, r) == 0
    assert K.layer_norm_fwd(x.reshape(rows, n), 1e-5, y2, r2) == 0
    assert_same(y.reshape(rows, n), y2, f"{kernels} {shape} y")
    assert_same(r, r2, f"{kernels} {shape} rstd")
    g = torch.randn(shape, generator=gen)
    for is_ln in (True, False):
        dx, dx2 = torch.empty(shape), torch.empty(rows, n)
        assert K.norm_bwd_rows(g, y, r, dx, is_ln) == 0
        assert K.norm_bwd_rows(g.reshape(rows, n), y2, r2, dx2, is_ln) == 0
        assert_same(dx.reshape(rows, n), dx2, f"{kernels} {shape} dx")
        kind = "layernorm" if is_ln else "rmsnorm"
        assert_same(dx, M.ms_norm_bwd_ref(g, y, r, kind, torch.float32), f"{kernels} {shape} dx vs reference")


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_ms_layer_norm_autograd_equals_reference(dtype, threads, gen, monkeypatch):
    """ms_layer_norm under LOWMEMBP_BACKEND=cpu (the C forward, then the C backward from its y and rstd) equals it
    under the reference backend: the output and the gradient, bit for bit."""
    monkeypatch.setattr(KB, "_OFF", False)
    for shape in [(3, 7), (2, 5, 768), (1576, 96)]:
        x = ((torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype))
        dy = torch.randn(shape, generator=gen).to(dtype)
        out = {}
        for backend in ("torch", "cpu"):
            force_backend(monkeypatch, backend)
            xg = x.clone().requires_grad_()
            y = M.ms_layer_norm(xg, 1e-5)
            (g,) = torch.autograd.grad(y, xg, dy)
            out[backend] = (y.detach(), g)
        assert_same(out["cpu"][0], out["torch"][0], f"{dtype} {shape} y")
        assert_same(out["cpu"][1], out["torch"][1], f"{dtype} {shape} gradient")


# ---------------------------------------------------------------------------------------------- the fallbacks
def _eager_cases(gen):
    for kind, (rows, n), dtype in itertools.product(M.KINDS, [(3, 7), (40, 768), (1, 5000)], DTYPES):
        x = rows_of((rows, n), dtype, gen, 3.0)
        g = rows_of((rows, n), dtype, gen)
        yield kind, x, g


def test_switched_off_runs_the_eager_ops(threads, gen, monkeypatch):
    monkeypatch.setattr(KB, "_OFF", True)
    assert K.library() is None
    for kind, x, g in _eager_cases(gen):
        y0, r0 = M.ms_norm_fwd_ref(x, kind, 1e-5)
        y1, r1 = M.ms_norm_fwd_cpu(x, kind, 1e-5)
        assert_same(y1, y0, f"{kind} {x.shape} {x.dtype} y")
        assert_same(r1, r0, f"{kind} {x.shape} {x.dtype} rstd")
        for dx_dtype in DTYPES:
            check_bwd(g, y0, r0, kind, dx_dtype, f"{kind} {x.shape} {x.dtype} dx {dx_dtype}")


def test_no_compiler_runs_the_eager_ops(tmp_path, monkeypatch, gen):
    saved = dict(KB._state)
    monkeypatch.setenv("LOWMEMBP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(KB, "_OFF", False)
    monkeypatch.setenv("CC", "lowmembp-no-such-compiler")
    KB._reset()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert K.library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for kind, x, g in _eager_cases(gen):
                y0, r0 = M.ms_norm_fwd_ref(x, kind, 1e-5)
                y1, r1 = M.ms_norm_fwd_cpu(x, kind, 1e-5)
                assert_same(y1, y0, f"{kind} {x.shape} {x.dtype} y")
                assert_same(r1, r0, f"{kind} {x.shape} {x.dtype} rstd")
                check_bwd(g, y0, r0, kind, x.dtype, f"{kind} {x.shape} {x.dtype} dx")
    finally:
        KB._state.update(saved)

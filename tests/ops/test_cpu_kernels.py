"""The CPU fast path's C kernels (lowmembp.ops.cpu_kernels) equal the PyTorch references bit for bit, and the
library is built once, cached, shared by concurrent processes, and replaced by the eager ops where it cannot be built.

Every comparison is of bits (NaN payloads included). The kernels are called directly (their return value says they
ran) and through the fast-path functions; inputs are fresh random values mixed with the special ones: NaN, ±inf, −0,
denormals, the thresholds themselves and their neighbours, values that overflow or round to a tie.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

from lowmembp.ops import approx_act as A
from lowmembp.ops import approx_act_cpu as AC
from lowmembp.ops import cpu_kernels as K
from lowmembp.ops import mesa_quant as Q
from lowmembp.ops import mesa_quant_cpu as QC
from lowmembp.ops.approx_act_reference import _exact_fp32
from lowmembp.ops.cpu_kernels import build as KB

from bitwise import assert_same

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAVE_CC = K.compiler() is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler ($CC, cc, gcc or clang) on this machine")
# 1, 3, 5 elements; 4k + 1; rows of one element; more than one thread's share (K.MIN_PER_THREAD per thread)
SIZES = [(1,), (3,), (5,), (4 * 1001 + 1,), (7, 1), (2 * K.MIN_PER_THREAD + 4 * 333 + 3,)]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache folder and a library not loaded yet; the process's own library state comes back after."""
    saved = dict(KB._state)
    monkeypatch.setenv("LOWMEMBP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(KB, "_OFF", False)
    KB._reset()
    yield tmp_path / "cpu_kernels"
    KB._state.update(saved)


def specials(dtype: torch.dtype, thresholds) -> torch.Tensor:
    """−0, ±denormals, the thresholds in ``dtype`` and their neighbours in it, tiny and huge finite values."""
    info = torch.finfo(dtype)
    t = torch.tensor(thresholds, dtype=torch.float32).to(dtype)
    up, down = torch.full_like(t, float("inf")), torch.full_like(t, float("-inf"))
    vals = [t, torch.nextafter(t, up), torch.nextafter(t, down)]
    tiny = torch.tensor([info.tiny, info.tiny / 4, info.smallest_normal / 1024], dtype=dtype)
    vals += [tiny, -tiny, torch.tensor([-0.0, 0.0, info.max, -info.max, 1.0, -1.0], dtype=dtype)]
    return torch.cat(vals)


def act_input(shape, dtype, gen, t32) -> torch.Tensor:
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    s = specials(dtype, t32)
    flat = x.view(-1)
    k = min(flat.numel(), s.numel())
    pos = torch.randperm(flat.numel(), generator=gen)[:k]
    flat[pos] = s[torch.randperm(s.numel(), generator=gen)[:k]]
    return x


def grad_input(shape, dtype, gen) -> torch.Tensor:
    dy = torch.randn(shape, generator=gen).to(dtype)
    info = torch.finfo(dtype)
    extra = torch.tensor([-0.0, info.max, -info.max, info.tiny / 2, float(torch.finfo(torch.float32).tiny) / 8],
                         dtype=torch.float32).to(dtype)
    flat = dy.view(-1)
    k = min(flat.numel(), extra.numel())
    flat[torch.randperm(flat.numel(), generator=gen)[:k]] = extra[:k]
    return dy


# ------------------------------------------------------------------------------------------ approximate activations
@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", A.KINDS)
def test_codes_and_backward_equal_reference(kind, dtype, threads, kernels, gen):
    t32, s32 = A._consts32(kind, 2)
    for shape in SIZES:
        x = act_input(shape, dtype, gen, t32)
        y0, p0 = A.forward_reference(x, kind)
        n = x.numel()
        nbytes = (n + 3) // 4
        direct = torch.empty(nbytes + 1, dtype=torch.uint8)
        direct[nbytes] = 0
        assert K.codes2(x.reshape(-1), t32, direct) & K.NONFINITE == 0, "a non-finite input that is not there"
        assert_same(direct, p0, f"{kind} {shape} codes (kernel)")
        y1, p1 = A.forward_cpu(x, kind)
        assert_same(y1, y0, f"{kind} {shape} forward")
        assert_same(p1, p0, f"{kind} {shape} codes and flag byte")
        tiny = dtype == torch.bfloat16 and bool(((x.float().abs() < 2**-124) & (x != 0)).any())
        assert K.check(x.reshape(-1)) == (K.TINY_BF16 if tiny else 0)
        y2, p2 = A.forward_cpu(x, kind, with_codes=False)
        assert_same(y2, y0, f"{kind} {shape} forward without codes")
        assert p2.numel() == 0
        dy = grad_input(shape, dtype, gen)
        dx = torch.empty_like(dy)
        ran = K.slopes2(dy.reshape(-1), p0, torch.tensor(s32), dx)
        assert ran in (0, 1)  # 1: a NaN product (±inf · slope 0)
        want = A.backward_reference(dy, p0, kind)
        if ran == 0 or dtype == torch.float32:
            assert_same(dx, want, f"{kind} {shape} backward (kernel)")
        assert_same(A.backward_cpu(dy, p0, kind), want, f"{kind} {shape} backward")


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gelu", "silu", "relu2"])
def test_non_finite_equal_reference(kind, dtype, kernels, gen):
    x = (torch.randn(3, 1001, generator=gen) * 3).to(dtype)
    x[0, 5], x[1, 700], x[2, 1000] = float("nan"), float("inf"), float("-inf")
    t32 = A._consts32(kind, 2)[0]
    for inp in (x, x[1:].clone(), x[2:].clone()):  # NaN + ±inf, +inf only, −inf only
        assert K.codes2(inp.reshape(-1), t32, torch.empty(inp.numel() // 4 + 2, dtype=torch.uint8)) & K.NONFINITE
        assert K.check(inp.reshape(-1)) & K.NONFINITE
        y0, p0 = A.forward_reference(inp, kind)
        y1, p1 = A.forward_cpu(inp, kind)
        assert_same(y1, y0, "forward")
        assert_same(p1, p0, "codes and flag byte")
        dy = grad_input(inp.shape, dtype, gen)
        assert_same(A.backward_cpu(dy, p0, kind), A.backward_reference(dy, p0, kind), "backward with a flag")
    p = A.forward_reference(x[2:].clone(), kind)[1]  # −inf only: flag 0, the kernel's backward
    dy = grad_input((1, 1001), dtype, gen)
    dy[0, 0], dy[0, 1], dy[0, 2], dy[0, 3] = float("nan"), float("inf"), float("-inf"), -float("nan")
    assert_same(A.backward_cpu(dy, p, kind), A.backward_reference(dy, p, kind), "non-finite dy")


@pytest.mark.parametrize("path", ["kernels", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_half_value_equals_reference(dtype, path, monkeypatch):
    """Every finite fp16 / bf16 value, in vectors and in a ragged tail, with the C kernels and with the eager ops: the
    native reduced-precision kernels (and where they differ from the fp32 formula: bf16 below 2⁻¹²⁴) and the codes."""
    if path == "kernels":
        if not HAVE_CC:
            pytest.skip("no C compiler ($CC, cc, gcc or clang) on this machine")
        monkeypatch.setattr(KB, "_OFF", False)
        assert K.library() is not None, K.build_info()["reason"]
    else:
        monkeypatch.setattr(KB, "_OFF", True)
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)]
    for kind in A.KINDS:
        for part in (x, x[(x.view(torch.int16) & 0x7F80) <= 0x100][:9]):  # all, and a few tiny ones alone
            y0, p0 = A.forward_reference(part, kind)
            y1, p1 = A.forward_cpu(part, kind)
            assert_same(y1, y0, f"{kind} forward")
            assert_same(p1, p0, f"{kind} codes")
            assert_same(A.forward_cpu(part, kind, with_codes=False)[0], y0, f"{kind} forward without codes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_native_kernel_probe_and_its_fallback(dtype, gen, monkeypatch):
    """The probe's answer is what the native kernel does on random values, and with the probe saying no for every
    kind (the fp32 formula, cast back) the fast path still gives the reference's bits."""
    x = (torch.randn(4099, generator=gen) * 4).to(dtype)
    for kind in sorted(AC._LOW_PRECISION_NATIVE):
        if AC.native_act_exact(kind, dtype):  # a yes must hold on fresh values too
            assert_same(AC._native_kernel(x, kind), _exact_fp32(x.float(), kind).to(dtype), f"native {kind}")
    monkeypatch.setattr(AC, "native_act_exact", lambda kind, dt: False)
    for kind in A.KINDS:
        y0, p0 = A.forward_reference(x, kind)
        y1, p1 = A.forward_cpu(x, kind)
        assert_same(y1, y0, f"{kind} forward, no native kernel")
        assert_same(p1, p0, f"{kind} codes, no native kernel")


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_input_equals_reference(dtype, kernels, gen):
    base = (torch.randn(6, 9, 101, generator=gen) * 3).to(dtype)
    for x in (base.transpose(0, 2), base[:, ::2], base[..., 1:]):
        y0, p0 = A.forward_reference(x, "gelu")
        y1, p1 = A.forward_cpu(x, "gelu")
        assert_same(y1, y0, "forward")
        assert_same(p1, p0, "codes")
        dy = torch.randn(x.shape[::-1], generator=gen).to(dtype).transpose(0, -1)
        assert_same(A.backward_cpu(dy, p0, "gelu"), A.backward_reference(dy, p0, "gelu"), "backward")


@needs_cc
def test_kernels_take_strided_inputs_and_refuse_strided_outputs(kernels, gen):
    t32 = A._consts32("gelu", 2)[0]
    x = torch.randn(64, 33, generator=gen).t()  # strided: read through a contiguous copy
    out = torch.empty(x.numel() // 4 + 1, dtype=torch.uint8)
    assert K.codes2(x, t32, out) == 0
    assert_same(out[:-1], A.forward_reference(x.contiguous(), "gelu")[1][:-1], "codes of a strided input")
    with pytest.raises(ValueError, match="contiguous CPU torch.uint8 tensor"):
        K.codes2(x, t32, torch.empty(2 * out.numel(), dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="at least"):
        K.codes2(x, t32, out[:10])


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounding_equals_aten(dtype, kernels, gen):
    """fp32 -> fp16 / bf16 as the kernels round equals ATen's conversion on random bit patterns and the edges."""
    raw = torch.randint(-2**31, 2**31 - 1, (1 << 18,), dtype=torch.int64, generator=gen).to(torch.int32)
    x = raw.view(torch.float32)
    x = x[~torch.isnan(x)]
    info = torch.finfo(dtype)
    half_ulps = torch.tensor([info.max, info.tiny, info.tiny * 2 ** -9, 1.0, 3.0], dtype=torch.float32)
    edges = torch.cat([half_ulps, torch.nextafter(half_ulps, torch.full_like(half_ulps, float("inf"))),
                       torch.tensor([float("inf"), float("-inf"), -0.0, 1e-45, 65520.0, 65519.996, 2 ** -25,
                                     2 ** -25 * 1.5, 3 * 2 ** -26])])
    ties = (torch.randint(0, 2**15, (4096,), generator=gen, dtype=torch.int64).to(torch.int32) << 16 | 0x8000)
    for xs in (x, edges, torch.cat([edges, -edges]), ties.view(torch.float32)[~torch.isnan(ties.view(torch.float32))]):
        assert_same(K.round_to(xs, dtype), xs.to(dtype), f"rounding to {dtype}")


# --------------------------------------------------------------------------------------------------------- Mesa
MESA_CASES = [((2, 3, 17, 8), "head", 3), ((8, 19, 96), "channel", 8), ((3, 5, 6), "channel", 4),
              ((2, 7), "channel", 1), ((999, 4), "channel", 4), ((2 * K.MIN_PER_THREAD // 64 + 3, 64), "channel", 8),
              ((1, 1, 2 * K.MIN_PER_THREAD + 5), "channel", 1)]


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mesa_equals_reference(dtype, threads, kernels, gen):
    for shape, mode, wanted in MESA_CASES:
        x = (torch.randn(shape, generator=gen) * 3).to(dtype)
        inner, groups = Q.group_layout(x, mode, wanted)
        mn, mx = Q.group_min_max(x, inner, groups)
        mx = mx + 0.1 * (mx - mn)  # some values outside the range (clamped), some within
        flat = x.view(-1)
        flat[:3] = torch.tensor([float("inf"), float("-inf"), -0.0], dtype=dtype)[: flat.numel()]
        scale, step, beta = 255.0 / (mx - mn).clamp_min(1e-12), (mx - mn) / 255.0, mn.clone()
        seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
        for s in (seed, 0, 2**31 - 2) if x.numel() < K.MIN_PER_THREAD else (seed,):
            q0 = Q.quantize_ref(x, scale, beta, inner, groups, s)
            out = torch.empty(x.numel(), dtype=torch.uint8)
            assert K.quantize8(x.reshape(-1), inner, groups, scale, beta, s, out) == 0
            assert_same(out.view(x.shape), q0, f"{shape} codes (kernel), seed {s}")
            assert_same(Q.quantize_cpu(x, scale, beta, inner, groups, s), q0, f"{shape} codes, seed {s}")
        for o in (dtype, torch.float32):
            want = Q.dequantize_ref(q0, step, beta, inner, groups, o)
            got = torch.empty(x.numel(), dtype=o)
            assert K.dequantize8(q0.reshape(-1), inner, groups, step, beta, got) == 0
            assert_same(got.view(x.shape), want, f"{shape} dequantised (kernel)")
            assert_same(Q.dequantize_cpu(q0, step, beta, inner, groups, o), want, f"{shape} dequantised")


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mesa_nan_equals_reference(dtype, kernels, gen):
    x = (torch.randn(4, 33, 64, generator=gen) * 3).to(dtype)
    x[1, 2, 3] = float("nan")
    inner, groups = Q.group_layout(x, "channel", 4)
    mn, mx = Q.group_min_max(x[0], inner, groups)
    scale, beta = 255.0 / (mx - mn), mn
    assert K.quantize8(x.reshape(-1), inner, groups, scale, beta, 7, torch.empty(x.numel(), dtype=torch.uint8)) == 1
    q0 = Q.quantize_ref(x, scale, beta, inner, groups, 7)
    assert_same(Q.quantize_cpu(x, scale, beta, inner, groups, 7), q0, "codes with a NaN input")
    step = (mx - mn) / 255.0
    step[1] = float("nan")
    for o in (dtype, torch.float32):
        assert_same(Q.dequantize_cpu(q0, step, beta, inner, groups, o),
                    Q.dequantize_ref(q0, step, beta, inner, groups, o), "dequantised with a NaN step")


# ------------------------------------------------------------------------------------------- the eager fallback
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_fallback_equals_reference(dtype, threads, gen, monkeypatch):
    """With the C kernels off, the eager ATen ops (small blocks: many block boundaries) give the same bits."""
    monkeypatch.setattr(KB, "_OFF", True)
    monkeypatch.setattr(AC, "_CPU_BLOCK", 64)
    monkeypatch.setattr(QC, "_CPU_BLOCK", 80)
    for kind in A.KINDS:
        for shape in SIZES[:-1] + [(3, 1001)]:
            x = act_input(shape, dtype, gen, A._consts32(kind, 2)[0])
            y0, p0 = A.forward_reference(x, kind)
            y1, p1 = A.forward_cpu(x, kind)
            assert_same(y1, y0, f"{kind} {shape} forward")
            assert_same(p1, p0, f"{kind} {shape} codes")
            dy = grad_input(shape, dtype, gen)
            assert_same(A.backward_cpu(dy, p0, kind), A.backward_reference(dy, p0, kind), f"{kind} {shape} backward")
    for shape, mode, wanted in MESA_CASES[:5]:
        x = (torch.randn(shape, generator=gen) * 3).to(dtype)
        inner, groups = Q.group_layout(x, mode, wanted)
        mn, mx = Q.group_min_max(x, inner, groups)
        scale, step, beta = 255.0 / (mx - mn).clamp_min(1e-12), (mx - mn) / 255.0, mn.clone()
        q0 = Q.quantize_ref(x, scale, beta, inner, groups, 11)
        assert_same(Q.quantize_cpu(x, scale, beta, inner, groups, 11), q0, f"{shape} codes")
        assert_same(Q.dequantize_cpu(q0, step, beta, inner, groups, dtype),
                    Q.dequantize_ref(q0, step, beta, inner, groups, dtype), f"{shape} dequantised")


# ----------------------------------------------------------------------------------- build, cache and fallback
@needs_cc
def test_built_once_and_reused_from_the_cache(fresh, monkeypatch):
    # a first flag set the compiler refuses: the next one builds, and a later load finds it without a new attempt
    monkeypatch.setattr(KB, "_FLAG_SETS", (K.FLAGS + ("-fno-such-flag-lowmembp",), K.FLAGS))
    compiles = K.build_info()["compiles"]
    lib = K.library()
    assert lib is not None, K.build_info()["reason"]
    info = K.build_info()
    assert info["compiles"] == compiles + 1 and info["path"].parent == fresh
    assert info["seconds"] < 30  # a small C file; the docs state the measured time
    mtime = info["path"].stat().st_mtime_ns
    KB._reset()  # as a new process would: find the file, do not compile
    assert K.library() is not None
    again = K.build_info()
    assert again["compiles"] == info["compiles"] and again["path"] == info["path"]
    assert info["path"].stat().st_mtime_ns == mtime
    assert [p.name for p in fresh.iterdir()] == [info["path"].name]  # no temporary file left behind


@needs_cc
def test_concurrent_first_use_by_two_processes(fresh):
    code = ("import torch; from lowmembp.ops import cpu_kernels as K; x = torch.randn(4097); "
            "out = torch.empty(1025, dtype=torch.uint8); "
            "assert K.codes2(x, (-1.0, 0.0, 1.0), out) == 0, K.build_info()")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    names = sorted(p.name for p in fresh.iterdir())
    assert len(names) == 1 and names[0].endswith(".so"), names


def test_switched_off_runs_the_eager_ops(fresh, monkeypatch, gen):
    monkeypatch.setattr(KB, "_OFF", True)
    assert K.library() is None
    x = (torch.randn(3, 1001, generator=gen) * 3).to(torch.bfloat16)
    assert K.codes2(x.reshape(-1), A._consts32("gelu", 2)[0], torch.empty(800, dtype=torch.uint8)) is None
    y0, p0 = A.forward_reference(x, "gelu")
    y1, p1 = A.forward_cpu(x, "gelu")
    assert_same(y1, y0)
    assert_same(p1, p0)
    dy = torch.randn(x.shape, generator=gen).to(x.dtype)
    assert_same(A.backward_cpu(dy, p1, "gelu"), A.backward_reference(dy, p1, "gelu"))
    assert not fresh.exists()  # nothing was built


def test_no_compiler_warns_once_and_runs_the_eager_ops(fresh, monkeypatch, gen):
    monkeypatch.setenv("CC", "lowmembp-no-such-compiler")
    with pytest.warns(RuntimeWarning, match="C kernels are not available.*no C compiler"):
        assert K.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        assert K.library() is None
        x = (torch.randn(2, 999, generator=gen) * 3)
        y0, p0 = A.forward_reference(x, "silu")
        y1, p1 = A.forward_cpu(x, "silu")
        inner, groups = Q.group_layout(x, "channel", 1)
        mn, mx = Q.group_min_max(x, inner, groups)
        q1 = Q.quantize_cpu(x, 255.0 / (mx - mn), mn, inner, groups, 3)
    assert_same(y1, y0)
    assert_same(p1, p0)
    assert_same(q1, Q.quantize_ref(x, 255.0 / (mx - mn), mn, inner, groups, 3))
    assert "no C compiler" in K.build_info()["reason"]


def test_a_failing_build_warns_and_runs_the_eager_ops(fresh, monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'cc: broken on purpose' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="broken on purpose"):
        assert K.library() is None
    assert not any(fresh.iterdir())  # no partial library left in the cache

"""The C++ autograd node of ReGELU2 / ReSiLU2 on the CPU (lowmembp/ops/cpu_kernels/autograd.cpp, built by
lowmembp.ops.cpu_kernels.autograd_ext): bit for bit the Python route's output, saved bytes and gradients, on fresh
random inputs (odd shapes, views, fp32 / bf16 / fp16, NaN / ±inf, tiny bf16, NaN in dy), its double backward, and the
fallbacks (LOWMEMBP_CPU_EXT=0, no compiler, a failed build) that run the Python route with one warning."""
import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch

from lowmembp.ops import approx_act as A
from lowmembp.ops import approx_act_cpu as AC
from lowmembp.ops.cpu_kernels import autograd_ext as E

from bitwise import assert_same
from backends import force_backend
from cpp_nodes import node_or_skip, run_route

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NODE = "lowmembp::ApproxActBackward"
SHAPES = [(4,), (5,), (1, 8), (3, 7), (2, 3, 13), (8, 17, 64), (3, 1, 1001)]
INF, NAN = float("inf"), float("nan")


@pytest.fixture
def node(monkeypatch):
    """The node set up here (fails where a C++ compiler exists and it does not build; skips without one)."""
    force_backend(monkeypatch, None)
    return node_or_skip(monkeypatch, AC)


_run = functools.partial(run_route, AC)  # (y, saved, dx, grad_fn name) by the node or the Python route


def _inputs(shape, dtype, gen, scale=3.0):
    x = (torch.randn(shape, generator=gen) * scale).to(dtype)
    return x, torch.randn(shape, generator=gen).to(dtype)


def _same_routes(fn, x, dy, monkeypatch, expect_node=True, bits=2):
    y1, s1, g1, n1 = _run(fn, x, dy, False, monkeypatch)
    y0, s0, g0, n0 = _run(fn, x, dy, True, monkeypatch)
    assert (n1 == NODE) == expect_node and n0 != NODE
    assert_same(y1, y0, "forward")
    assert len(s1) == len(s0) == 1 and s1[0].dtype == torch.uint8
    assert s1[0].numel() == A.saved_bytes(x.numel(), bits)
    assert_same(s1[0], s0[0], "saved codes and flag byte")
    assert_same(g1, g0, "gradient")
    return y1, g1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn", [A.regelu2, A.resilu2, A.ReGELU2(), A.ReSiLU2(), lambda t: A.approx_act(t, "silu")],
                         ids=["regelu2", "resilu2", "ReGELU2", "ReSiLU2", "approx_act"])
def test_node_equals_python_route_and_reference(fn, dtype, node, gen, monkeypatch):
    for shape in SHAPES:
        x, dy = _inputs(shape, dtype, gen)
        y, g = _same_routes(fn, x, dy, monkeypatch)
        force_backend(monkeypatch, "torch")  # the reference (the custom op's oracle)
        y_ref, _, g_ref, _ = _run(fn, x, dy, True, monkeypatch)
        force_backend(monkeypatch, None)
        assert_same(y, y_ref, "forward vs reference")
        assert_same(g, g_ref, "gradient vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_views_and_threads(dtype, node, gen, monkeypatch):
    base, _ = _inputs((6, 9, 101), dtype, gen)
    for x in (base.transpose(0, 2), base[:, ::2]):
        _same_routes(A.regelu2, x, torch.randn(x.shape, generator=gen).to(dtype), monkeypatch)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # 2·65536 elements and more: the kernels split the work over threads
        x, dy = _inputs((3, 45001), dtype, gen)
        _same_routes(A.resilu2, x, dy, monkeypatch)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype, node, gen, monkeypatch):
    """NaN / ±inf inputs: the node declines (the Python route's reference path); NaN / inf in dy: the node's dx
    (fp32) or the Python route's (fp16 / bf16 NaN bits); tiny bf16 values: the fp32 formula, as the Python route."""
    for fn in (A.regelu2, A.resilu2):
        x, dy = _inputs((3, 11), dtype, gen)
        for v in (NAN, INF, -INF):
            xs = x.clone()
            xs[1, 3] = v
            _same_routes(fn, xs, dy, monkeypatch, expect_node=False)
        dys = dy.clone()
        dys[0, 0], dys[2, 5], dys[1, 1] = NAN, INF, -INF
        _same_routes(fn, x, dys, monkeypatch)
        if dtype == torch.bfloat16:
            xt = x.clone()
            xt[0, :4] = torch.tensor([2.0 ** -126, -(2.0 ** -130), 2.0 ** -133, 0.0])
            _same_routes(fn, xt, dy, monkeypatch)


def test_fewer_than_four_elements_and_autocast_take_the_python_route(node, gen, monkeypatch):
    for n in (1, 2, 3):
        x, dy = _inputs((n,), torch.float32, gen)
        _same_routes(A.regelu2, x, dy, monkeypatch, expect_node=False)
    x, _ = _inputs((4, 8), torch.float32, gen)
    monkeypatch.setattr(AC, "_NODE", [node])
    assert A.regelu2(x.requires_grad_()).grad_fn.name() == NODE
    with torch.no_grad():
        assert A.regelu2(x).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: the Python route
        assert A.regelu2(x).grad_fn.name() != NODE


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_grad_forward_equals_python_route(dtype, node, gen, monkeypatch):
    """Without a gradient the extension returns y alone (lmbp_check, then the activation): the Python route's bits,
    NaN / ±inf (the Python route then) and tiny bf16 included; fewer than 4 elements too."""
    for fn in (A.regelu2, A.resilu2):
        for shape in [(1,), (3,), *SHAPES]:
            x, _ = _inputs(shape, dtype, gen)
            cases = [x]
            if x.numel() >= 4:
                for value in (NAN, INF):
                    xs = x.clone()
                    xs.view(-1)[2] = value
                    cases.append(xs)
            if dtype == torch.bfloat16 and x.numel() >= 4:
                xt = x.clone()
                xt.view(-1)[:4] = torch.tensor([2.0 ** -126, -(2.0 ** -130), 2.0 ** -133, 0.0])
                cases.append(xt)
            for xc in cases:
                outs = []
                for python in (False, True):
                    monkeypatch.setattr(AC, "_NODE", [None] if python else [node])
                    with torch.no_grad():
                        outs.append(fn(xc.requires_grad_(False)))
                assert_same(outs[0], outs[1], f"no-grad forward {tuple(shape)}")
    calls = []
    monkeypatch.setattr(AC, "_NODE", [node])
    monkeypatch.setattr(A, "_fwd_cpu", lambda *args: calls.append(args))
    x, _ = _inputs((8, 17), dtype, gen)
    for fn in (A.regelu2, A.resilu2):
        assert fn(x).shape == x.shape  # served by the extension: the Python route's forward is not called
    assert not calls


def test_other_kinds_and_bits_take_the_python_route(node, gen, monkeypatch):
    x, dy = _inputs((5, 7), torch.float32, gen)
    for kind, bits in (("gelu", 3), ("gelu_tanh", 2), ("relu", 2)):
        fn = (lambda k, b: lambda t: A.approx_act(t, k, b))(kind, bits)
        _same_routes(fn, x, dy, monkeypatch, expect_node=False, bits=bits)


def test_saved_tensor_hooks_that_replace_the_codes(node, gen, monkeypatch):
    """A pack hook that moves the saved bytes elsewhere (offloading) and an unpack hook that brings them back."""
    x, dy = _inputs((5, 13), torch.bfloat16, gen)
    _, _, g0, _ = _run(A.resilu2, x, dy, True, monkeypatch)
    monkeypatch.setattr(AC, "_NODE", [node])
    xr = x.clone().requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.numel()) or t.clone().numpy(),
                                                  lambda a: torch.from_numpy(a)):
        y = A.resilu2(xr)
    assert packed == [A.saved_bytes(x.numel())] and y.grad_fn.name() == NODE
    (g,) = torch.autograd.grad(y, xr, dy)
    assert_same(g, g0, "gradient through the hooks")


def test_backward_twice_raises_as_torch_does(node, gen, monkeypatch):
    x = torch.randn(4, 8, generator=gen).requires_grad_()
    monkeypatch.setattr(AC, "_NODE", [node])
    y = A.regelu2(x)
    assert y.grad_fn.name() == NODE
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()


def test_double_backward_as_the_python_route(node, gen, monkeypatch):
    """create_graph: dx through the custom op lowmembp::approx_act_bwd, so that its derivative in dy exists and
    equals the Python route's."""
    calls = []
    op = A._approx_act_bwd
    monkeypatch.setattr(A, "_approx_act_bwd", lambda *a: calls.append(1) or op(*a))
    x, dy = _inputs((4, 9), torch.float32, gen)
    v = torch.randn(4, 9, generator=gen)
    out = []
    for python in (False, True):
        dyr = dy.clone().requires_grad_()
        y, _, dx, name = _run(A.regelu2, x, dyr, python, monkeypatch, create_graph=True)
        assert (name == NODE) != python and dx.requires_grad
        (gdy,) = torch.autograd.grad(dx, dyr, v)
        out.append((dx, gdy, len(calls)))
        calls.clear()
    assert out[0][2] == out[1][2] == 2  # dx, then its own backward
    assert_same(out[0][0], out[1][0], "dx with create_graph")
    assert_same(out[0][1], out[1][1], "the double backward")


def test_include_paths_are_cpp_extensions():
    from torch.utils.cpp_extension import include_paths, library_paths
    flags = E._flags()
    assert all(f"-I{p}" in flags for p in include_paths()) and all(f"-L{p}" in flags for p in library_paths())


def _fallback_equals(monkeypatch, gen, match):
    monkeypatch.setattr(AC, "_NODE", [])
    E._reset()
    x, dy = _inputs((3, 8), torch.bfloat16, gen)
    with pytest.warns(RuntimeWarning, match=match):
        y1, s1, g1, n1 = _run(A.regelu2, x, dy, False, monkeypatch)
    assert n1 != NODE and AC._NODE == [None]
    y0, s0, g0, _ = _run(A.regelu2, x, dy, True, monkeypatch)
    assert_same(y1, y0)
    assert_same(s1[0], s0[0])
    assert_same(g1, g0)
    monkeypatch.setattr(AC, "_NODE", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert AC.fwd_node(x.requires_grad_(), "gelu", A._CONSTS32[("gelu", 2)][1]) is None


def test_no_compiler_falls_back_with_one_warning(monkeypatch, gen):
    monkeypatch.setattr(E, "_OFF", False)
    monkeypatch.setattr(E, "compiler", lambda: None)
    try:
        _fallback_equals(monkeypatch, gen, "no C\\+\\+ compiler")
    finally:
        E._reset()


def test_failed_build_falls_back_with_one_warning(monkeypatch, gen, tmp_path):
    bad = tmp_path / "autograd.cpp"
    bad.write_text("#error a build that fails\n")
    monkeypatch.setattr(E, "_OFF", False)
    monkeypatch.setattr(E, "SOURCE", bad)
    monkeypatch.setenv("LOWMEMBP_CACHE_DIR", str(tmp_path / "cache"))
    if E.compiler() is None:
        pytest.skip("no C++ compiler")
    try:
        _fallback_equals(monkeypatch, gen, "a build that fails")
    finally:
        E._reset()


def test_switched_off_builds_nothing_and_warns_nothing():
    code = ("import warnings, torch\nwarnings.simplefilter('error')\n"
            "from lowmembp.ops import approx_act as A, approx_act_cpu as AC\nfrom lowmembp.ops.cpu_kernels import "
            "autograd_ext as E\nx = torch.randn(3, 8, requires_grad=True)\ny = A.regelu2(x)\ny.sum().backward()\n"
            "assert y.grad_fn.name() != 'lowmembp::ApproxActBackward' and AC._NODE == [None]\n"
            "assert E._state['tried'] is False and 'lowmembp_cpu_ext' not in __import__('sys').modules\n"
            "print('ok')\n")
    env = {**os.environ, "LOWMEMBP_CPU_EXT": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_import_builds_nothing(tmp_path):
    code = ("import lowmembp, lowmembp.ops\nfrom lowmembp.ops.cpu_kernels import autograd_ext as E\n"
            "assert E._state['tried'] is False and 'lowmembp_cpu_ext' not in __import__('sys').modules\nprint('ok')\n")
    env = {**os.environ, "LOWMEMBP_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_source_ships_with_the_package():
    import tomllib
    from pathlib import Path
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    globs = meta["tool"]["setuptools"]["package-data"]["lowmembp.ops.cpu_kernels"]
    assert "*.cpp" in globs and E.SOURCE.suffix == ".cpp" and E.SOURCE.is_file()

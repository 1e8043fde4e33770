"""The C++ autograd node of MS-LayerNorm / MS-RMSNorm on the CPU (lowmembp/ops/cpu_kernels/autograd.cpp): bit for bit
the Python route's output, saved tensors (y itself and rstd) and gradients, on fresh random inputs (odd shapes, fp32 /
bf16 / fp16 in and out, rows past the node's limits, NaN / ±inf in x and in g), with saved-tensor hooks that replace y,
create_graph, and the calls it leaves to the Python route (strided, empty, float64, autocast, no grad); the no-grad
forward; and, for both families, Python exceptions raised inside the extension (hooks, callbacks) and
non-reentrant checkpointing, whose early stop is such an exception."""
import functools

import pytest
import torch

from lowmembp.ops import approx_act as A
from lowmembp.ops import approx_act_cpu as AC
from lowmembp.ops import ms_norm as M
from lowmembp.ops import ms_norm_cpu as MC

from bitwise import assert_same
from backends import force_backend
from cpp_nodes import node_or_skip, run_route, set_up_node

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NODE = "lowmembp::MSNormBackward"
SHAPES = [(1, 8), (5,), (3, 7), (2, 3, 13), (8, 17, 64), (3, 1, 1001), (2, 4096)]
FNS = {"layernorm": M.ms_layer_norm, "rmsnorm": M.ms_rms_norm}
INF, NAN = float("inf"), float("nan")


@pytest.fixture
def node(monkeypatch):
    """The node set up here (fails where a C++ compiler exists and it does not build; skips without one)."""
    force_backend(monkeypatch, None)
    return node_or_skip(monkeypatch, MC)


@pytest.fixture
def act_node(monkeypatch, node):
    """The activations' node set up too (the extension is the norms' fixture's)."""
    set_up_node(monkeypatch, AC)
    return node


_run = functools.partial(run_route, MC)  # (y, saved, dx, grad_fn name) by the node or the Python route


def _inputs(shape, dtype, gen):
    x = (torch.randn(shape, generator=gen) * 3 + torch.randn(shape[:-1] + (1,), generator=gen)).to(dtype)
    return x, torch.randn(shape, generator=gen).to(dtype)


def _same_routes(fn, x, g, monkeypatch, expect_node=True, hooks=None):
    y1, s1, d1, n1 = _run(fn, x, g, False, monkeypatch, hooks)
    y0, s0, d0, n0 = _run(fn, x, g, True, monkeypatch, hooks)
    assert (n1 == NODE) == expect_node and n0 != NODE, (n1, n0)
    assert_same(y1, y0, "forward")
    assert len(s1) == len(s0) == 2
    if expect_node:  # y itself (the tensor the next linear saves too), then rstd
        assert s1[0].data_ptr() == y1.data_ptr() and s1[0].dtype == y1.dtype
        assert_same(s1[1], s0[1], "rstd")
    assert_same(d1, d0, "gradient")
    return y1, d1


@pytest.mark.parametrize("out_dtype", ["auto", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_node_equals_python_route_and_reference(kind, dtype, out_dtype, node, gen, monkeypatch):
    fn = functools.partial(FNS[kind], out_dtype=out_dtype)
    for shape in SHAPES:
        x, g = _inputs(shape, dtype, gen)
        if out_dtype == "fp32":
            g = g.float()
        y, dx = _same_routes(fn, x, g, monkeypatch)
        force_backend(monkeypatch, "torch")  # the reference (the custom op's oracle)
        y_ref, _, dx_ref, _ = _run(fn, x, g, True, monkeypatch)
        force_backend(monkeypatch, None)
        assert_same(y, y_ref, "forward vs reference")
        assert_same(dx, dx_ref, "gradient vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_modules_take_the_node(kind, dtype, node, gen, monkeypatch):
    module = M.MSLayerNorm(64) if kind == "layernorm" else M.MSRMSNorm(64)
    x, g = _inputs((4, 9, 64), dtype, gen)
    _same_routes(module, x, g, monkeypatch)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_large_and_long_rows(kind, node, gen, monkeypatch):
    """Past the node's limits: a 16-bit tensor of 16384 elements or more (the node serves LayerNorm's C replica only),
    one row of 32768 (whose backward ATen sums over threads: the callback), rows wider than a block (the
    Python route), several threads."""
    fn = FNS[kind]
    with_replica = MC.cpu_kernels.layer_norm_variant() is not None
    torch.set_num_threads(2)
    cases = [((64, 1000), torch.bfloat16, kind == "layernorm" and with_replica),
             ((64, 1000), torch.float32, True),
             ((1, MC._ATEN_GRAIN), torch.float32, MC._ATEN_GRAIN <= MC._CPU_MAX_N),
             ((2, MC._CPU_MAX_N + 8), torch.float32, False)]
    for shape, dtype, expect_node in cases:
        x, g = _inputs(shape, dtype, gen)
        _same_routes(fn, x, g, monkeypatch, expect_node=expect_node)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_special_values(kind, dtype, node, gen, monkeypatch):
    """NaN / ±inf in x: where the node's forward is LayerNorm's C replica it declines (the reference's bits), where it
    is the reference's own calls it serves; in g: its backward calls the Python route."""
    fn = FNS[kind]
    replica = kind == "layernorm" and MC.cpu_kernels.layer_norm_variant() is not None
    for value in (NAN, INF, -INF):
        x, g = _inputs((3, 7, 33), dtype, gen)
        x[1, 2, 5] = value
        _same_routes(fn, x, g, monkeypatch, expect_node=not replica)
        x, g = _inputs((3, 7, 33), dtype, gen)
        g[0, 4, 1] = value
        _same_routes(fn, x, g, monkeypatch)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_calls_the_node_leaves_to_the_python_route(kind, node, gen, monkeypatch):
    fn = FNS[kind]
    x, g = _inputs((6, 40), torch.float32, gen)
    _same_routes(lambda t: fn(t.t()), x.t().contiguous(), g.t().contiguous().t(), monkeypatch, expect_node=False)
    assert MC.fwd_node(x.double().requires_grad_(), kind, 1e-5, torch.float64) is None  # the API refuses float64
    assert MC.fwd_node(x.double().requires_grad_(), kind, 1e-5, torch.float32) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _same_routes(fn, x, g.bfloat16(), monkeypatch, expect_node=False)
    empty = torch.empty(0, 8, requires_grad=True)
    assert fn(empty).shape == (0, 8)
    with torch.no_grad():
        assert fn(x).grad_fn is None


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_saved_tensor_hooks_that_replace_y(kind, node, gen, monkeypatch):
    """Hooks that hand the backward another y (a strided copy, another dtype): the node's backward takes the Python
    route's function on what the hooks gave, as the Python route does."""
    fn = FNS[kind]
    x, g = _inputs((5, 24), torch.bfloat16, gen)
    strided = (lambda t: t, lambda t: t.t().contiguous().t() if t.dim() == 2 else t)
    _same_routes(fn, x, g, monkeypatch, hooks=strided)
    as_fp32 = (lambda t: t.float() if t.dtype == torch.bfloat16 else t, lambda t: t)
    _same_routes(fn, x, g, monkeypatch, hooks=as_fp32)


def test_y_modified_in_place_raises_as_torch_does(node, gen, monkeypatch):
    x, _ = _inputs((4, 16), torch.float32, gen)
    x.requires_grad_()
    y = M.ms_layer_norm(x)
    assert y.grad_fn.name() == NODE
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_backward_twice_raises_as_torch_does(node, gen, monkeypatch):
    x, g = _inputs((4, 16), torch.float32, gen)
    x.requires_grad_()
    y = M.ms_rms_norm(x)
    y.backward(g)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(g)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_create_graph_as_the_python_route(kind, node, gen, monkeypatch):
    """create_graph: dx through the custom op (the same bits), whose own backward refuses a double backward."""
    fn = FNS[kind]
    x, g = _inputs((3, 20), torch.float32, gen)
    grads = []
    for python in (False, True):
        monkeypatch.setattr(MC, "_NODE", [None] if python else [MC._node_setup()])
        leaf = x.clone().requires_grad_()
        (dx,) = torch.autograd.grad(fn(leaf), leaf, g, create_graph=True)
        grads.append(dx)
        with pytest.raises(RuntimeError, match="double backward"):
            dx.sum().backward()
    assert_same(grads[0], grads[1], "gradient with create_graph")


def test_the_node_shares_y_with_the_next_linear(node, gen):
    """The point of MS-norms: y and the next linear's saved input are one tensor (one storage saved, not two)."""
    x, _ = _inputs((4, 10, 32), torch.float32, gen)
    x.requires_grad_()
    linear = torch.nn.Linear(32, 8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = linear(M.MSLayerNorm(32)(x))
    ptrs = {t.untyped_storage().data_ptr() for t in saved if t.dim() == 3}
    assert len(ptrs) == 1, "y is saved once, by the norm and by the linear"
    out.sum().backward()


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_the_backward_runs_in_cpp_and_calls_python_only_for_a_nan(kind, node, gen, monkeypatch):
    def refuse(*args):
        raise AssertionError("the Python route's backward was called")

    node.set_norm_callback(refuse)
    try:
        for dtype in DTYPES:
            x, g = _inputs((4, 9, 40), dtype, gen)
            x.requires_grad_()
            y = FNS[kind](x)
            assert y.grad_fn.name() == NODE
            y.backward(g)  # in C++: the callback is not called
            g[1, 1, 1] = NAN
            with pytest.raises(AssertionError, match="Python route's backward was called"):
                FNS[kind](x).backward(g)
    finally:
        node.set_norm_callback(MC._node_backward)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_no_grad_forward_equals_python_route(kind, dtype, node, gen, monkeypatch):
    """Without a gradient the extension returns y alone: the Python route's bits (NaN / ±inf included)."""
    for shape in [*SHAPES, (64, 1000)]:
        x, _ = _inputs(shape, dtype, gen)
        xn = x.clone()
        xn.view(-1)[1] = NAN
        for xc in (x, xn):
            outs = []
            for python in (False, True):
                monkeypatch.setattr(MC, "_NODE", [None] if python else [node])
                with torch.no_grad():
                    outs.append(FNS[kind](xc))
            assert_same(outs[0], outs[1], f"no-grad forward {shape}")
    calls = []
    monkeypatch.setattr(MC, "_NODE", [node])
    monkeypatch.setattr(M, "ms_norm_fwd_cpu", lambda *args: calls.append(args))
    assert FNS[kind](torch.randn(4, 8, generator=gen).to(dtype)).shape == (4, 8)  # served by the extension
    assert not calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_without_torchs_fused_kernel(dtype, node, gen, monkeypatch):
    """Where torch has no fused RMSNorm with a shape (torch 2.8) the reference's plain ops run, on both routes."""
    from lowmembp import _compat

    monkeypatch.setattr(_compat, "fused_rms_norm_takes_shape", lambda: False)
    monkeypatch.setattr(MC, "fused_rms_norm_takes_shape", lambda: False)
    for shape in SHAPES:
        x, g = _inputs(shape, dtype, gen)
        _same_routes(M.ms_rms_norm, x, g, monkeypatch)
    monkeypatch.undo()
    MC._node_setup()  # the node's configuration again with this torch's flag


class _Boom(Exception):
    pass


def _boom(*args):
    raise _Boom("from a hook")


ACT_AND_NORMS = {"regelu2": A.regelu2, "resilu2": A.resilu2, **FNS}


@pytest.mark.parametrize("name", list(ACT_AND_NORMS))
def test_python_exceptions_keep_their_type(name, node, act_node, gen):
    """A saved-tensor hook's exception (raised inside the node's C++) and a backward callback's reach the caller as
    themselves, not as a bare RuntimeError (torch.utils.checkpoint's early stop relies on it)."""
    fn = ACT_AND_NORMS[name]
    x, g = _inputs((4, 9, 40), torch.float32, gen)
    x.requires_grad_()
    assert fn(x).grad_fn.name().startswith("lowmembp::")
    with torch.autograd.graph.saved_tensors_hooks(_boom, lambda t: t):
        with pytest.raises(_Boom, match="from a hook"):
            fn(x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _boom):
        y = fn(x)
    with pytest.raises(_Boom, match="from a hook"):
        y.backward(g)
    ext = node
    setter = ext.set_callback if name in ("regelu2", "resilu2") else ext.set_norm_callback
    setter(_boom)
    try:
        with pytest.raises(_Boom, match="from a hook"):  # create_graph: the callback
            torch.autograd.grad(fn(x), x, g, create_graph=True)
    finally:
        (AC._node_setup if name in ("regelu2", "resilu2") else MC._node_setup)()


@pytest.mark.parametrize("early_stop", [True, False])
def test_non_reentrant_checkpoint(early_stop, node, act_node, gen):
    """torch.utils.checkpoint without reentry recomputes the nodes' forward and stops it early by an exception from a
    saved-tensor hook: the gradients equal those without checkpointing."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(24, 48), M.MSLayerNorm(48), torch.nn.Linear(48, 32), A.ReGELU2(),
                                torch.nn.Linear(32, 24), M.MSRMSNorm(24))
    x, g = _inputs((3, 5, 24), torch.float32, gen)
    grads = []
    for ckpt in (False, True):
        leaf = x.clone().requires_grad_()
        block.zero_grad()
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            y = torch.utils.checkpoint.checkpoint(block, leaf, use_reentrant=False) if ckpt else block(leaf)
            assert y.grad_fn is not None
            y.backward(g)
        grads.append([leaf.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*grads):
        assert_same(a, b, "gradient with checkpointing")

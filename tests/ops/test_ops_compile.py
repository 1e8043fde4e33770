"""The ops under torch.compile: custom ops (no graph breaks), compiled = eager, opcheck, saved bytes kept.

CPU inductor (gcc) on tiny shapes. ``torch._dynamo.explain`` counts graph breaks; the ops are ``torch.library``
custom ops, so Dynamo never traces into them (nor into Triton's interpreter).
"""
import pytest
import torch
from torch import nn

from lowmembp.ops import approx_act as A
from lowmembp.ops import mesa_layers as ML
from lowmembp.ops import mesa_quant as mq
from lowmembp.ops import ms_norm as MS
from lowmembp.ops.approx_table import TABLE
from backends import force_backend

pytestmark = pytest.mark.slow  # the full suite only: torch.compile of the ops

ACTS = [("gelu", 2), ("silu", 2), ("relu", 1)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fwd_bwd(op):
    """fn(x) -> (y, dx): the forward (and the loss) compiled, the backward through AOTAutograd's compiled graph."""
    def loss(x):
        y = op(x * 1.5)
        return y, y.float().pow(2).sum()

    def fn(x, compile=False):
        y, l = (torch.compile(loss, fullgraph=True) if compile else loss)(x)
        (g,) = torch.autograd.grad(l, x)
        return y, g
    fn.loss = loss
    return fn


def _breaks(fn, *args):
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_break_count, [str(b.reason) for b in ex.break_reasons]


def _norm_input(shape=(3, 5, 16), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).requires_grad_()


OPS = {
    "regelu2": A.regelu2,
    "resilu2": A.resilu2,
    "approx_relu1": lambda x: A.approx_act(x, "relu", 1),
    "ms_layer_norm": lambda x: MS.ms_layer_norm(x, 1e-5),
    "ms_rms_norm": lambda x: MS.ms_rms_norm(x, 1e-6),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", OPS)
def test_no_graph_breaks_forward_and_backward(name, backend, monkeypatch):
    force_backend(monkeypatch, backend)
    fn = _fwd_bwd(OPS[name])
    n, reasons = _breaks(fn.loss, _norm_input())
    assert n == 0, reasons
    fn(_norm_input(), compile=True)  # the backward graph compiles too (fullgraph forward, AOTAutograd backward)


@pytest.mark.parametrize("name", OPS)
def test_compiled_equals_eager(name, torch_backend):
    x = _norm_input()
    fn = _fwd_bwd(OPS[name])
    y0, g0 = fn(x)
    y1, g1 = fn(x, compile=True)
    if name.startswith("ms_"):
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)
    else:  # the activation forward is the same kernel either way; the gradient is dy · s[code], one multiply
        assert torch.equal(y1, y0)
        # dy = 2·y computed by inductor vs eager may differ in the last bit; the codes (and slopes) must not
        s = torch.tensor(A._consts32(*({"regelu2": ("gelu", 2), "resilu2": ("silu", 2)}.get(name, ("relu", 1))))[1])
        torch.testing.assert_close(g1, g0, rtol=1e-6, atol=0)
        assert torch.equal(g1 == 0, g0 == 0) and s.numel() >= 2


@pytest.mark.parametrize("kind,bits", ACTS)
def test_compiled_codes_are_bitwise_the_eager_codes(kind, bits, torch_backend):
    """The saved codes of a compiled call equal the eager ones (captured through saved-tensor hooks)."""
    x = _norm_input((4, 33))

    def saved_of(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fn(x)
        return y, saved

    y0, s0 = saved_of(lambda t: A.approx_act(t, kind, bits))
    y1, s1 = saved_of(torch.compile(lambda t: A.approx_act(t, kind, bits), fullgraph=True))
    assert torch.equal(y0, y1)
    assert len(s0) == 1 and s0[0].dtype == torch.uint8
    assert [t for t in s1 if t.dtype == torch.uint8], [(t.dtype, t.shape) for t in s1]
    codes1 = [t for t in s1 if t.dtype == torch.uint8][0]
    assert torch.equal(codes1, s0[0])


def _saved_bytes(fn, x):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(x)
    seen, total = set(), 0
    for t in saved:
        key = t.untyped_storage().data_ptr()
        if key not in seen and t.numel():
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return out, total


@pytest.mark.parametrize("name", ["regelu2", "resilu2", "ms_layer_norm", "ms_rms_norm"])
def test_compiled_call_saves_what_eager_saves(name, torch_backend):
    """Inductor keeps our op's saved tensors (codes, or y + rstd): it does not re-save the input to recompute."""
    x = _norm_input((4, 8, 64))
    op = OPS[name]
    fn = (lambda t: op(t * 1.5).sum(-1)) if name.startswith("ms_") else (lambda t: op(t * 1.5))
    _, eager = _saved_bytes(fn, x)
    _, compiled = _saved_bytes(torch.compile(fn, fullgraph=True), x)
    n = x.numel()
    if name.startswith("ms_"):
        assert eager == n * 4 + 4 * 8 * 4  # y fp32 + rstd per row
    else:
        assert eager == A.saved_bytes(n, 2)
    assert compiled == eager, (compiled, eager)  # the same tensors (hooks see what the compiled graph saves)


def test_opcheck_custom_ops():
    x = torch.randn(3, 7, requires_grad=True)
    t32, s32 = A._consts32("gelu", 2)
    checks = [
        (torch.ops.lowmembp.approx_act_fwd, (x, "gelu", list(t32), list(s32), True)),
        (torch.ops.lowmembp.approx_act_fwd, (x.detach().bfloat16(), "relu2", list(A._consts32("relu2", 2)[0])
                                             if ("relu2", 2) in TABLE else [0.0], list(s32[:2]) if ("relu2", 2)
                                             not in TABLE else list(A._consts32("relu2", 2)[1]), True)),
        (torch.ops.lowmembp.approx_act_bwd, (torch.randn(3, 7, requires_grad=True),
                                             A.forward_reference(x.detach(), "gelu")[1], list(s32))),
        (torch.ops.lowmembp.ms_norm_fwd, (torch.randn(4, 9, requires_grad=True), "layernorm", 1e-5, torch.float32)),
        (torch.ops.lowmembp.ms_norm_fwd, (torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True),
                                          "rmsnorm", 1e-6, torch.bfloat16)),
        (torch.ops.lowmembp.mesa_quantize, (torch.randn(4, 6), torch.full((2,), 40.0), torch.full((2,), -3.0), 3, 2,
                                            torch.tensor(5))),
        (torch.ops.lowmembp.mesa_dequantize, (torch.randint(0, 255, (4, 6), dtype=torch.uint8),
                                              torch.full((2,), 0.02), torch.full((2,), -3.0), 3, 2, torch.bfloat16)),
    ]
    y, rstd = MS.ms_norm_fwd_ref(torch.randn(4, 9), "layernorm", 1e-5)
    checks.append((torch.ops.lowmembp.ms_norm_bwd, (torch.randn(4, 9), y, rstd, "layernorm", torch.float32)))
    for op, args in checks:
        res = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in res.values()), (op, res)


# --------------------------------------------------------------------------------------------------------- Mesa
class _MesaBlock(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.ln = ML.MesaLayerNorm.from_layernorm(nn.LayerNorm(c), groups=4)
        self.fc = ML.MesaLinear.from_linear(nn.Linear(c, 2 * c), groups=4)
        self.act = ML.MesaAct("gelu", groups=4)

    def forward(self, x):
        return self.act(self.fc(self.ln(x)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mesa_quantiser_compiles_without_breaks(backend, monkeypatch):
    """The seed is a tensor (no SymInt per call); quantise/dequantise are opaque custom ops (inductor never sees
    the integer hash that failed to vectorise: ``a[i] >> max_shift``)."""
    force_backend(monkeypatch, backend)
    q = mq.EMAQuantizer(4)

    def fn(x):
        qt = q.pack(x)
        return mq.dequantize(qt)

    x = torch.randn(3, 16)
    n, reasons = _breaks(fn, x)
    assert n == 0, reasons
    if backend == "torch":
        compiled = torch.compile(fn, fullgraph=True)
        for _ in range(3):  # new seeds each call, no recompilation error
            xh = compiled(torch.randn(3, 16))
            assert xh.shape == (3, 16) and torch.isfinite(xh).all()


def test_mesa_block_compiles_and_trains_like_eager(torch_backend):
    torch.manual_seed(0)
    block = _MesaBlock()
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = block(x)
    g_eager = torch.autograd.grad(out.pow(2).sum(), [x, block.fc.weight])
    torch.manual_seed(0)
    block2 = _MesaBlock()
    block2.load_state_dict(block.state_dict())
    compiled = torch.compile(block2)
    out2 = compiled(x)
    g_comp = torch.autograd.grad(out2.pow(2).sum(), [x, block2.fc.weight])
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)  # the forward is exact either way
    for a, b in zip(g_comp, g_eager):  # 8-bit inputs with different random rounding: close, not equal
        assert torch.isfinite(a).all()
        assert float((a - b).norm() / b.norm()) < 0.05


def test_dynamic_shapes_compile_once_for_every_op(torch_backend):
    """dynamic=True: the fake implementations take symbolic sizes (codes: ceil(N·bits/8) + 1 bytes)."""
    act = A.make_approx("quick_gelu", 3)
    q = mq.EMAQuantizer(4)

    def fn(x):
        y = act(A.regelu2(MS.ms_rms_norm(x)))
        return y.sum() + mq.dequantize(q.pack(x)).sum().detach()

    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    for rows in (3, 6):
        x = torch.randn(rows, 16, requires_grad=True)
        compiled(x).backward()
        x2 = x.detach().clone().requires_grad_()
        fn(x2).backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)

"""``mesa`` / ``mesa-gelu-ln``: exact forward, exact backward given the dequantised tensors, close gradients with real
8-bit codes, fewer saved bytes; the Mesa layers one by one against torch's own layers; ``mesa_momentum``, the EMA
range λ (default 0.9, docs/design.md#mesa): validated, applied to each range tracker, and the lag it causes when
activations grow fast (a from-scratch model at a high learning rate), which λ = 0 removes."""
import copy

import pytest
import torch
import torch.nn as nn

import lowmembp
from lowmembp.measurement.saved import saved_bytes
from lowmembp.methods.mesa import convert
from lowmembp.methods.registry import method_options
from lowmembp.ops import mesa_layers as ml
from lowmembp.ops import mesa_quant as mq
from lowmembp.ops.mesa_layers import MesaRMSNorm
from lowmembp.ops.mesa_quant import MOMENTUM, EMAQuantizer
from tiny_models import build, logits

FAMILIES = ["vit", "swin", "bert", "llama"]


@pytest.fixture
def lossless(monkeypatch):
    """Make the 8-bit code lossless (save the tensor itself): the backward must then equal autograd's exactly."""
    monkeypatch.setattr(mq.EMAQuantizer, "pack",
                        lambda self, x: mq.QTensor(x.detach().clone(), torch.ones(1), torch.zeros(1), 1, 1, x.dtype))
    monkeypatch.setattr(ml, "dequantize", lambda q: q.codes.to(q.dtype))


def _loss(model, batch):
    return logits(model, batch).float().pow(2).mean()


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for _, p in sorted(model.named_parameters()) if p.grad is not None])


def _pair(name, method, **opts):
    model, inputs = build(name)
    model.train()
    ref = copy.deepcopy(model)
    return ref, lowmembp.apply(model, method, **opts), inputs()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("method,opts", [("mesa", {"mesa_attention": "eager"}), ("mesa", {}), ("mesa-gelu-ln", {})])
def test_backward_exact_given_dequantised(lossless, name, method, opts):
    ref, model, batch = _pair(name, method, **opts)
    _loss(ref, batch).backward()
    _loss(model, batch).backward()
    g0, g1 = _grads(ref), _grads(model)
    assert g0.shape == g1.shape
    assert _rel(g1, g0) < 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_exact_gradients_close_bytes_lower(name):
    ref, model, batch = _pair(name, "mesa", mesa_attention="eager")
    conv = model._mesa_converted
    assert conv["linear"] > 0 and conv["act"] > 0 and conv["norm"] > 0
    assert conv["attention"] == (4 if name == "swin" else 2)  # Swin: window attention too (Mesa's Swin demo)
    y0, y1 = logits(ref, batch), logits(model, batch)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)  # eager vs SDPA attention: fp32 rounding only
    y0.float().pow(2).mean().backward()
    y1.float().pow(2).mean().backward()
    g0, g1 = _grads(ref), _grads(model)
    assert _rel(g1, g0) < 0.15
    assert float(torch.nn.functional.cosine_similarity(g0, g1, dim=0)) > 0.99
    base = saved_bytes(ref, lambda: logits(ref, batch))["total"]
    mesa = saved_bytes(model, lambda: logits(model, batch))["total"]
    gelu_ln = _pair(name, "mesa-gelu-ln")[1]
    partial = saved_bytes(gelu_ln, lambda: logits(gelu_ln, batch))["total"]
    assert mesa < partial < base, (mesa, partial, base)
    assert mesa < 0.7 * base


@pytest.mark.parametrize("name", ["vit", "llama"])
def test_gelu_ln_forward_exact_under_bf16_autocast(name):
    ref, model, batch = _pair(name, "mesa-gelu-ln")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0, y1 = logits(ref, batch), logits(model, batch)
    assert y1.dtype == y0.dtype
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    y0.float().pow(2).mean().backward()
    y1.float().pow(2).mean().backward()
    assert float(torch.nn.functional.cosine_similarity(_grads(ref), _grads(model), dim=0)) > 0.99


def test_eval_and_no_grad_save_nothing_and_match():
    ref, model, batch = _pair("vit", "mesa", mesa_attention="eager")
    ref.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(model, batch), logits(ref, batch), rtol=1e-5, atol=1e-6)
    counts = [int(m.count) for m in model.modules() if isinstance(m, mq.EMAQuantizer)]
    assert counts and all(c == 0 for c in counts)  # eval never updates the ranges


def test_ema_state_updates_and_state_dict_unchanged():
    ref, model, batch = _pair("bert", "mesa", mesa_attention="eager")
    assert set(model.state_dict()) == set(ref.state_dict())  # range buffers are not persistent
    for _ in range(2):
        _loss(model, batch).backward()
    quants = [m for m in model.modules() if isinstance(m, mq.EMAQuantizer)]
    assert quants and all(int(q.count) == 2 for q in quants)
    assert all(float(q.alpha.min()) >= 0 for q in quants)


def test_auto_attention_converts_only_eager():
    for fused in (True, False):
        model, _ = build("vit")
        for blk in model.blocks:
            blk.attn.fused_attn = fused
        lowmembp.apply(model, "mesa")
        assert model._mesa_converted["attention"] == (0 if fused else 2)
    import transformers
    from tiny_models import VOCAB
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=40, vocab_size=VOCAB, attn_implementation="eager")
    llama = transformers.LlamaForCausalLM(cfg)
    assert lowmembp.apply(llama, "mesa")._mesa_converted["attention"] == 2
    bert, _ = build("bert")
    assert lowmembp.apply(bert, "mesa-gelu-ln")._mesa_converted == {"linear": 0, "act": 2, "norm": 5, "attention": 0}


def test_under_lora_base_layer_saves_nothing():
    model, inputs = build("vit")
    model = lowmembp.apply(model, "lora+mesa")
    batch = inputs()
    wrapped = [m for m in model.modules() if isinstance(m, ml.MesaLinear)]
    frozen = [m for m in wrapped if not m.weight.requires_grad]
    assert frozen and len(frozen) < len(wrapped)
    _loss(model, batch).backward()
    assert all(int(m.quant.count) == 0 for m in frozen)  # never quantised: nothing saved for them
    assert all(int(m.quant.count) == 1 for m in wrapped if m.weight.requires_grad)


@pytest.mark.parametrize("other", ["mesa-gelu-ln", "lowmembp", "lowmembp-act", "lowmembp-norm"])
def test_exclusive_combinations(other):
    model, _ = build("vit")
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(model, f"mesa+{other}")


def test_bad_options():
    model, _ = build("vit")
    with pytest.raises(ValueError, match="mesa_attention"):
        lowmembp.apply(model, "mesa", mesa_attention="flash")
    with pytest.raises(ValueError, match="mesa_groups"):
        lowmembp.apply(model, "mesa", mesa_groups=0)


# ------------------------------------------------------------------------------------------------ layers one by one
def _check_layer(ref_mod, mesa_mod, x, tol, autocast=None):
    x0 = x.clone().requires_grad_()
    x1 = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        y0, y1 = ref_mod(x0), mesa_mod(x1)
    assert y0.dtype == y1.dtype
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    g = torch.randn_like(y0)
    y0.backward(g)
    y1.backward(g)
    assert x1.grad.dtype == x0.grad.dtype
    assert _rel(x1.grad.float(), x0.grad.float()) < tol
    return x0.grad, x1.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_against_torch(dtype):
    torch.manual_seed(3)
    lin = nn.Linear(24, 10).to(dtype)
    _check_layer(lin, ml.MesaLinear.from_linear(copy.deepcopy(lin)), torch.randn(3, 5, 24, dtype=dtype), 0.05)
    ln = nn.LayerNorm(24).to(dtype)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5), ln.bias.uniform_(-1, 1)
    _check_layer(ln, ml.MesaLayerNorm.from_layernorm(copy.deepcopy(ln)), torch.randn(3, 5, 24, dtype=dtype) * 2, 0.1)
    for kind, ref in [("gelu", nn.GELU()), ("gelu_tanh", nn.GELU("tanh")), ("silu", nn.SiLU())]:
        _check_layer(ref, ml.MesaAct(kind), torch.randn(4, 7, 16, dtype=dtype) * 3, 0.05)


def test_layers_under_autocast():
    torch.manual_seed(4)
    lin = nn.Linear(16, 12)
    _check_layer(lin, ml.MesaLinear.from_linear(copy.deepcopy(lin)), torch.randn(2, 9, 16), 0.05,
                 autocast=torch.bfloat16)
    ln = nn.LayerNorm(16)
    _check_layer(ln, ml.MesaLayerNorm.from_layernorm(copy.deepcopy(ln)), torch.randn(2, 9, 16), 0.1,
                 autocast=torch.bfloat16)


def test_softmax_matmul_rmsnorm_and_param_grads():
    torch.manual_seed(5)
    a, b = torch.randn(2, 3, 6, 5, requires_grad=True), torch.randn(2, 3, 5, 7, requires_grad=True)
    a1, b1 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    mm = ml.MesaMatMul(3)
    y0, y1 = a @ b, mm(a1, b1)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    s0, s1 = y0.softmax(-1), ml.MesaSoftmax(3)(y1)
    torch.testing.assert_close(s1, s0)
    g = torch.randn_like(s0)
    s0.backward(g), s1.backward(g)
    assert _rel(a1.grad, a.grad) < 0.05 and _rel(b1.grad, b.grad) < 0.05

    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(20, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    mesa = ml.MesaRMSNorm.from_rmsnorm(copy.deepcopy(norm))
    x = torch.randn(3, 4, 20)
    _check_layer(norm, mesa, x, 0.05)
    assert _rel(mesa.weight.grad, norm.weight.grad) < 0.05


def test_saved_bytes_per_layer():
    """A Mesa linear saves numel + 8·G bytes for its input (plus the weight, a parameter) — 4x fewer than fp32."""
    lin = ml.MesaLinear.from_linear(nn.Linear(32, 8), groups=4)
    x = torch.randn(6, 32, requires_grad=True)
    rep = saved_bytes(lin, lambda: lin(x))
    assert rep["total"] == x.numel() + 4 * 8


def test_swin_window_attention_as_in_mesas_demo():
    """Swin's window attention (shifted windows included) runs Mesa's matmuls and softmax: the forward is exact, the
    backward exact given the dequantised tensors, and fewer bytes are saved than with the attention kept exact
    (``mesa_attention="keep"``, the row Mesa's demo does not have); export gives the plain model back."""
    ref, model, batch = _pair("swin", "mesa")
    keep = _pair("swin", "mesa", mesa_attention="keep")[1]
    assert model._mesa_converted["attention"] == 4 and keep._mesa_converted["attention"] == 0
    shifted = [b.attn for layer in model.layers for b in layer.blocks if b.shift_size]
    assert shifted and all(hasattr(a, "mesa_softmax") for a in shifted)  # the masked (shifted) windows too
    torch.testing.assert_close(logits(model, batch), logits(ref, batch), rtol=1e-5, atol=1e-6)
    mesa = saved_bytes(model, lambda: logits(model, batch))["total"]
    kept = saved_bytes(keep, lambda: logits(keep, batch))["total"]
    assert mesa < kept
    plain = lowmembp.export(model)
    assert not any(hasattr(m, "mesa_qk") for m in plain.modules())
    torch.testing.assert_close(logits(plain, batch), logits(ref, batch), rtol=1e-5, atol=1e-6)


def test_swin_window_attention_backward_exact_given_dequantised(lossless):
    ref, model, batch = _pair("swin", "mesa")
    assert model._mesa_converted["attention"] == 4
    _loss(ref, batch).backward()
    _loss(model, batch).backward()
    assert _rel(_grads(model), _grads(ref)) < 1e-5


# ------------------------------------------------------------------------------------------- the EMA range's momentum
def tiny_llama():
    return build("llama")[0]


def _quantizers(model):
    return [m for m in model.modules() if isinstance(m, EMAQuantizer)]


@pytest.mark.parametrize("method", ["mesa", "mesa-gelu-ln"])
def test_momentum_reaches_every_range_tracker(method):
    assert method_options(method)["mesa_momentum"] == MOMENTUM == 0.9
    default = lowmembp.apply(tiny_llama(), method)
    assert _quantizers(default) and {q.momentum for q in _quantizers(default)} == {0.9}
    model = lowmembp.apply(tiny_llama(), method, mesa_momentum=0.0)
    assert {q.momentum for q in _quantizers(model)} == {0.0}


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, "0.5", True, None])
def test_bad_momentum_is_refused(bad):
    with pytest.raises(ValueError, match="mesa_momentum"):
        convert(tiny_llama(), linears=False, acts=True, norms=True, attention="keep", groups=8, momentum=bad)


def _last_step_grad_error(momentum: float, growth: float, steps: int = 10) -> float:
    """Feed one MesaRMSNorm inputs whose scale grows by ``growth`` per step; the relative error of the input gradient
    of the last step against the exact RMSNorm's."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(1 + 0.1 * torch.randn(64, generator=gen))
    norm = MesaRMSNorm(weight, 1e-6).train()
    norm.quant.momentum = momentum
    for step in range(steps):
        x = (growth ** step * torch.randn(32, 64, generator=gen)).requires_grad_()
        g = torch.randn(32, 64, generator=gen)
        norm(x).backward(g)
    ref = x.detach().clone().requires_grad_()
    h = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6)
    (weight.detach() * h).backward(g)
    return float((x.grad - ref.grad).norm() / ref.grad.norm())


def test_ema_lag_clamps_when_activations_grow_and_momentum_zero_follows():
    steady = _last_step_grad_error(MOMENTUM, growth=1.0)
    lagging = _last_step_grad_error(MOMENTUM, growth=1.35)  # ~15x over 10 steps, as llama-tiny's residual stream
    own_range = _last_step_grad_error(0.0, growth=1.35)
    assert steady < 0.01  # 8-bit noise only (measured 0.3 %)
    assert own_range < 0.01  # measured 0.2 %
    assert lagging > 10 * own_range  # the lagging EMA range clamps the larger values (measured 7.8 %)


@pytest.mark.parametrize("name", ["vit", "llama"])
@pytest.mark.parametrize("method,opts", [("mesa-gelu-ln", {}), ("mesa", {"mesa_attention": "eager"})])
def test_converted_on_a_device_the_new_layers_stay_there(name, method, opts):
    """Converted after ``model.to(device)`` (here ``meta``, standing for a GPU), every parameter and buffer is on that
    device: MesaAct and the attention's Mesa layers have no weight, and their EMA ranges were left on the CPU (the
    GPU run's fig1 "lora+mesa-gelu-ln": "Expected all tensors to be on the same device ... cuda:0 and cpu")."""
    model = lowmembp.apply(build(name)[0].to("meta"), method, **opts)
    stray = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    assert not stray, stray
    assert model._mesa_converted["act"] > 0 and (method == "mesa-gelu-ln" or model._mesa_converted["attention"] > 0)

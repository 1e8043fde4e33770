"""MS-norm output sharing with peft LoRA layers, and the shared-input linear helpers."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowmembp.ops.ms_norm import MSLayerNorm, MSRMSNorm
from lowmembp.ops.shared_linear import CastWeightLinear, linear_sharing_input, share_lora_inputs

peft = pytest.importorskip("peft")

H = 24


def _model(norm_cls, dtype, seed=0):
    torch.manual_seed(seed)
    base = nn.Sequential()
    base.add_module("norm", norm_cls(H))
    base.add_module("q", nn.Linear(H, 10))
    base.add_module("v", nn.Linear(H, 10))
    base.to(dtype)
    cfg = peft.LoraConfig(r=4, target_modules=["q", "v"], lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, cfg)


def _forward(model, x, autocast):
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    recs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: recs.append(t) or t, lambda t: t), ctx:
        inner = model.base_model.model
        h = inner.norm(x)
        out = inner.q(h) + inner.v(h)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    big = {t.untyped_storage().data_ptr() for t in recs
           if t.untyped_storage().data_ptr() not in params and t.untyped_storage().nbytes() >= h.numel() * 2}
    return h, out, big


CASES = [(torch.float32, None), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
         (torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("norm_cls", [MSLayerNorm, MSRMSNorm])
@pytest.mark.parametrize("dtype,autocast", CASES)
def test_share_lora_inputs_makes_lora_save_norm_output_once(norm_cls, dtype, autocast):
    x = torch.randn(4, 9, H, dtype=dtype, requires_grad=True)  # activations larger than any weight cast
    model = _model(norm_cls, dtype)
    assert model.base_model.model.q.lora_A["default"].weight.dtype == torch.float32  # peft keeps adapters fp32
    h0, out0, big0 = _forward(model, x, autocast)
    mixed = autocast is not None or dtype != torch.float32
    # measured peft 0.21 behaviour: it casts x to the adapter dtype, and the LoRA A layer saves that copy
    assert (len(big0) > 1) == mixed
    out0.float().sum().backward()
    grads0 = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    x.grad = None

    assert share_lora_inputs(model) == 2 and share_lora_inputs(model) == 2  # idempotent
    assert type(model.base_model.model.q.lora_A["default"]) is CastWeightLinear
    h1, out1, big1 = _forward(model, x, autocast)
    assert big1 == {h1.untyped_storage().data_ptr()}
    assert x.untyped_storage().data_ptr() not in big1
    out1.float().sum().backward()
    # same outputs and adapter gradients within the compute dtype's rounding; gradients stay fp32
    low = autocast or dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[low]
    torch.testing.assert_close(out1.float(), out0.float(), rtol=tol, atol=tol * float(out0.detach().abs().max()))
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad.dtype == torch.float32
            ref = grads0[n]
            torch.testing.assert_close(p.grad, ref, rtol=4 * tol, atol=4 * tol * float(ref.abs().max()))


def test_linear_sharing_input_matches_f_linear_and_saves_input():
    x = torch.randn(3, 7, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, 16, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    recs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: recs.append(t) or t, lambda t: t):
        y = linear_sharing_input(x, w, b)
    assert y.dtype == torch.bfloat16
    assert x.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in recs}
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    xr, wr, br = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    F.linear(xr, wr, br).sum().backward()
    torch.testing.assert_close(y.double(), F.linear(xr, wr, br).detach(), rtol=3e-2, atol=0.2)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-2, atol=1e-2 * float(wr.grad.abs().max()))


def test_cast_weight_linear_is_nn_linear_in_fp32():
    lin = nn.Linear(6, 3)
    x = torch.randn(4, 6)
    ref = lin(x)
    lin.__class__ = CastWeightLinear
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=0)
    assert set(lin.state_dict()) == {"weight", "bias"}

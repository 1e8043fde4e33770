"""The emulation of the official LowMemoryBP LoraFunction (experiments.repro.official_lora): the same outputs and
gradients as peft's LoRA, and what it saves (x as it comes: the fp32 LayerNorm output under autocast)."""
import copy

import pytest
import torch
from torch import nn

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from experiments.repro.official_lora import OfficialLoraFunction, emulated
from tiny_models import build, lora_wrap

peft = pytest.importorskip("peft")


def _step(model, x, autocast=None):
    """(output, gradients of the trainable parameters and of x, the accountant) of one forward + backward."""
    xi = x.clone().requires_grad_(True)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with SavedTensorAccountant(model) as acc, ctx:
        out = model(xi)
    (out.float() * torch.linspace(-1, 2, out.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["x"] = xi.grad
    model.zero_grad()
    return out.detach(), grads, acc


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * max(float(b.abs().max()), 1e-30))


@pytest.mark.parametrize("convert", ["", "lowmembp-norm"], ids=["peft", "peft+folded-norms"])
@pytest.mark.parametrize("autocast", [None, torch.float16])
def test_gradients_equal_peft_lora(convert, autocast):
    """Tiny timm ViT, peft LoRA on qkv/proj/fc1/fc2 (random B; after lowmembp-norm lora_A has a bias: the folded
    β): the emulated official function gives peft's outputs and gradients (fp32: to rounding; fp16 autocast: to
    fp16 rounding)."""
    model, inputs = build("vit")
    pm = lora_wrap(model, "vit")
    if convert:
        pm = lowmembp.apply(pm, convert)
        assert any(m.bias is not None for n, m in pm.named_modules() if n.endswith("lora_A.default"))
    x = inputs()["x"]
    out0, g0, _ = _step(pm, x, autocast)
    with emulated():
        out1, g1, _ = _step(pm, x, autocast)
    out2, g2, _ = _step(pm, x, autocast)  # the class is restored on exit
    torch.testing.assert_close(out2, out0, rtol=0, atol=0)
    tol = 1e-5 if autocast is None else 2e-2
    _close(out1, out0, tol)
    assert set(g1) == set(g0) and any("lora_A" in n for n in g0)
    for n in g0:
        assert g1[n].dtype == g0[n].dtype
        _close(g1[n], g0[n], tol)


def test_saves_the_fp32_layernorm_output_not_a_fp16_copy():
    """Under fp16 autocast peft's lora_A saves the fp16 copy of the LayerNorm output; the official function saves
    the fp32 output itself: 2 more bytes per element, one storage."""
    torch.manual_seed(0)
    base = nn.Sequential()
    base.add_module("norm", nn.LayerNorm(24))
    base.add_module("q", nn.Linear(24, 24))
    cfg = peft.LoraConfig(r=4, target_modules=["q"], lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(base, cfg)
    x = torch.randn(4, 9, 24)
    n = x.numel()

    def big(acc):
        return sorted((s.nbytes, s.dtype) for s in acc.storages if s.nbytes >= n * 2)

    _, _, acc_peft = _step(pm, x, torch.float16)
    with emulated():
        _, _, acc_off = _step(pm, x, torch.float16)
    # both: the LayerNorm's own fp32 input; then peft's fp16 copy vs the official fp32 LN output
    assert big(acc_peft) == [(n * 2, torch.float16), (n * 4, torch.float32)]
    assert big(acc_off) == [(n * 4, torch.float32), (n * 4, torch.float32)]


def test_function_against_float64_math_and_refusals():
    g = torch.Generator().manual_seed(3)
    x, A, B, a = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                  for s in ((2, 5, 6), (3, 6), (4, 3), (3,)))
    w = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    (OfficialLoraFunction.apply(x, A, B, a) * w).sum().backward()
    got = [t.grad.clone() for t in (x, A, B, a)]
    for t in (x, A, B, a):
        t.grad = None
    (((x @ A.t() + a) @ B.t()) * w).sum().backward()
    for gg, t in zip(got, (x, A, B, a)):
        torch.testing.assert_close(gg, t.grad, rtol=1e-12, atol=1e-12)
    model, _ = build("vit")
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["qkv"], lora_dropout=0.1))
    with emulated(), pytest.raises(ValueError, match="lora_dropout"):
        pm(torch.randn(1, 3, 32, 32))

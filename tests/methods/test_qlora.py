"""QLoRA (``lora`` option ``quantize="nf4"``): bitsandbytes NF4 frozen weights under peft adapters, on the CPU.

Reference: the same model with each targeted weight replaced by bitsandbytes' own dequantisation of the stored NF4
weight, plain LoRA on top, the adapter weights copied over: loss and adapter gradients must agree."""
import copy

import pytest
import torch
import torch.nn as nn

import lowmembp
from lowmembp.estimator.step import nf4_weight_bytes
from tiny_models import VOCAB, _decoder

bnb = pytest.importorskip("bitsandbytes")


def _model():
    torch.manual_seed(0)
    return _decoder().float()


def _lora_params(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def test_nf4_lora_matches_dequantised_reference():
    plain = _model()
    q = lowmembp.apply(copy.deepcopy(plain), "lora", rank=4, quantize="nf4")
    quantised = {n.removesuffix(".base_layer"): m for n, m in q.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantised) == 2 * 7  # q, k, v, o, gate, up, down of each of the 2 layers
    ref_base = copy.deepcopy(plain)
    changed = 0.0
    for name, m in quantised.items():
        lin = ref_base.get_submodule(name.removeprefix("base_model.model."))
        assert m.weight.dtype == torch.uint8 and m.weight.numel() == lin.weight.numel() // 2  # packed 4-bit
        deq = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).to(lin.weight.dtype)
        changed = max(changed, (deq - lin.weight).abs().max().item())
        lin.weight.data.copy_(deq)
    assert changed > 1e-3  # 4 bits lose something: the check below is against the dequantised weight, not the fp32 one
    ref = lowmembp.apply(ref_base, "lora", rank=4)
    g = torch.Generator().manual_seed(1)
    for n, p in _lora_params(q).items():  # B = 0 at init: give both models the same non-zero adapters
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
        dict(ref.named_parameters())[n].data.copy_(p.data)
    ids = torch.randint(2, VOCAB, (2, 9), generator=g)
    lq, lr = q(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    lq.backward()
    lr.backward()
    assert lq.item() == pytest.approx(lr.item(), rel=1e-5)
    gr = _lora_params(ref)
    for n, p in _lora_params(q).items():
        torch.testing.assert_close(p.grad, gr[n].grad, rtol=1e-4, atol=1e-6)
    assert all(not m.weight.requires_grad for m in quantised.values())


def test_nf4_storage_bytes_match_the_estimate_model():
    q = lowmembp.apply(_model(), "lora", rank=4, quantize="nf4", targets="gate_proj")
    m = next(m for m in q.modules() if isinstance(m, bnb.nn.Linear4bit))
    n = m.in_features * m.out_features
    qs = m.weight.quant_state
    held = m.weight.numel() + qs.absmax.numel() * qs.absmax.element_size()
    held += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + 4  # second-level scales + offset
    assert held == nf4_weight_bytes(n, double_quant=True)
    single = lowmembp.apply(_model(), "lora", rank=4, quantize="nf4", targets="gate_proj", double_quant=False)
    ms = next(m for m in single.modules() if isinstance(m, bnb.nn.Linear4bit))
    assert ms.weight.numel() + ms.weight.quant_state.absmax.numel() * 4 == nf4_weight_bytes(n, double_quant=False)


def test_nf4_refusals():
    with pytest.raises(ValueError, match="quantize must be None or 'nf4'"):
        lowmembp.apply(_model(), "lora", quantize="int8")
    with torch.device("meta"):
        meta = _decoder()
    with pytest.raises(ValueError, match="needs real weights"):
        lowmembp.apply(meta, "lora", quantize="nf4")
    with pytest.raises(ValueError, match="found no nn.Linear"):
        lowmembp.apply(_model(), "lora", quantize="nf4", targets="nothing_here")
    assert isinstance(_model().model.layers[0].self_attn.q_proj, nn.Linear)


def test_cpu_eval_computes_what_training_does():
    """bitsandbytes' CPU inference repacking (avx512-bf16 CPUs) is kept off: eval gives the training values, any shape,
    and a training step after eval still runs."""
    from lowmembp.methods.qlora import quantize_nf4
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 40))  # 40: no multiple of 32, the repacking's assertion
    assert quantize_nf4(m, ["0", "1"]) == 2
    x = torch.randn(3, 64)
    y_train = m.train()(x)
    with torch.no_grad():
        y_eval = m.eval()(x)
    assert torch.equal(y_eval, y_train)
    xr = x.clone().requires_grad_()
    m.train()(xr).sum().backward()
    assert xr.grad is not None and torch.isfinite(xr.grad).all()

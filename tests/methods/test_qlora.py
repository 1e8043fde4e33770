"""QLoRA (``lora`` option ``quantize="nf4"``): bitsandbytes NF4 frozen weights under peft adapters, on the CPU.

Reference: the same model with each targeted weight replaced by bitsandbytes' own dequantisation of the stored NF4
weight, plain LoRA on top, the adapter weights copied over: loss and adapter gradients must agree.

Composed with LowMemoryBP the official way: ``lora(quantize="nf4")+lowmembp`` folds the RMSNorm γ into the
full-precision base weights (and LoRA's A) first, then quantises the base to NF4 (github yyyyychen/LowMemoryBP
experiments/llama_exp/src/merge_utils/merge_ln.py:66-87, then scripts/finetune_llama_7b_mergeln.sh loads the merged
checkpoint in NF4). References: (1) the original model with γ folded by hand (W·diag(γ) in float64 for q/k/v ←
input_layernorm, gate/up ← post_attention_layernorm, lm_head ← the final norm; norms γ = 1), then plain ``lora`` NF4 —
the converted model must hold the same 4-bit bytes and compute the same logits; (2) the plain QLoRA path (quantise,
then place the adapters) — a plain ``lora`` NF4 must give the same model bit for bit; (3) the baseline QLoRA model —
the converted one differs from it (NF4(W·diag γ) ≠ NF4(W)·diag γ) by the order of NF4's own error, measured here. The
logits are taken in eval mode (quantize_nf4 keeps bitsandbytes' CPU inference repacking off: see
test_cpu_eval_computes_what_training_does)."""
import copy

import pytest
import torch
import torch.nn as nn

import lowmembp
from lowmembp.estimator.step import nf4_weight_bytes
from lowmembp.methods.qlora import quantize_nf4
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


# ------------------------------------------------------------------- QLoRA + LowMemoryBP: the norms folded before NF4
SPECS = ["lora+lowmembp", "lora+lowmembp-norm"]
FOLDS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def _norms_model(dtype=torch.float32):
    torch.manual_seed(0)
    m = _decoder().to(dtype)
    g = torch.Generator().manual_seed(5)
    for n, p in m.named_parameters():  # random-init norms have γ = 1: perturb them
        if "norm" in n:
            p.data.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)).to(dtype))
    return m


def _ids():
    return torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def _logits(m):
    m.eval()
    with torch.no_grad():
        return m(input_ids=_ids()).logits.double()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _apply(model, spec, **kw):
    torch.manual_seed(1)  # the same LoRA init for every path
    return lowmembp.apply(model, spec, rank=4, **kw)


def _nf4(model):
    return {n.removeprefix("base_model.model.").removesuffix(".base_layer"): m
            for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _same_bytes(a, b):
    assert a.keys() == b.keys() and len(a) == 2 * 7
    for n in a:
        qa, qb = a[n].weight.quant_state, b[n].weight.quant_state
        assert torch.equal(a[n].weight.data, b[n].weight.data), n
        assert torch.equal(qa.absmax, qb.absmax) and torch.equal(qa.state2.absmax, qb.state2.absmax), n
        assert torch.equal(qa.offset, qb.offset), n


def _hand_folded(plain):
    """The official merge (merge_ln.py): γ into the readers' weights in float64, stored in the weight dtype."""
    m = copy.deepcopy(plain)
    with torch.no_grad():
        for layer in m.model.layers:
            for norm, readers in FOLDS.items():
                gamma = getattr(layer, norm).weight
                for r in readers:
                    w = layer.get_submodule(r).weight
                    w.copy_((w.double() * gamma.double()).to(w.dtype))
                gamma.fill_(1.0)
        m.lm_head.weight.copy_((m.lm_head.weight.double() * m.model.norm.weight.double()).to(m.lm_head.weight.dtype))
        m.model.norm.weight.fill_(1.0)
    return m


@pytest.mark.parametrize("spec", SPECS)
def test_converted_is_the_fp_folded_model_quantised(spec):
    plain = _norms_model()
    conv = _apply(copy.deepcopy(plain), spec, quantize="nf4")
    ref = _apply(_hand_folded(plain), "lora", quantize="nf4")
    _same_bytes(_nf4(conv), _nf4(ref))
    g = torch.Generator().manual_seed(2)
    ref_params = dict(ref.named_parameters())
    for n, p in conv.named_parameters():  # non-zero adapters; the reference reads γ = 1, so A' is its A
        if "lora_" in n and n.endswith("weight"):
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
            ref_params[n].data.copy_(p.data)
    assert not any(n.endswith("lora_A.default.bias") and p.abs().max() > 0 for n, p in conv.named_parameters())
    torch.testing.assert_close(_logits(conv), _logits(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_converted_trains_with_nf4_bases(spec):
    conv = _apply(_norms_model(), spec, quantize="nf4")
    assert set(n.rsplit(".", 1)[-1] for n in _nf4(conv)) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"}
    for n, m in conv.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            assert n.endswith(".base_layer") and not m.weight.requires_grad
    assert type(conv.base_model.model.model.layers[0].input_layernorm).__name__ == "MSRMSNorm"
    trainable = [p for p in conv.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5)
    conv.train()
    losses = []
    for _ in range(2):
        loss = conv(input_ids=_ids(), labels=_ids()).loss
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nf4_lora_equals_quantise_then_lora(dtype):
    """``lora@quantize=nf4`` equals the plain route: quantise the model's targets, then place the adapters on the NF4
    layers."""
    plain = _norms_model(dtype)
    new = _apply(copy.deepcopy(plain), "lora", quantize="nf4")
    old_base = copy.deepcopy(plain)
    assert quantize_nf4(old_base, new.peft_config["default"].target_modules) == 14
    old = _apply(old_base, "lora")
    _same_bytes(_nf4(new), _nf4(old))
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in old.named_parameters()]
    old_params = dict(old.named_parameters())
    for n, p in new.named_parameters():
        q = old_params[n]
        assert p.dtype == q.dtype and p.requires_grad == q.requires_grad, n
        assert torch.equal(p, q), n  # peft rounds A's init to the base dtype both ways (bnb's compute_dtype)
    assert torch.equal(_logits(new), _logits(old))


def test_converted_differs_from_baseline_qlora_by_nf4_error():
    """Not the baseline QLoRA model with γ moved: NF4 does not commute with diag(γ). The gap is NF4-sized."""
    plain = _norms_model()
    fp = _logits(plain)
    base = _apply(copy.deepcopy(plain), "lora", quantize="nf4")
    conv = _apply(copy.deepcopy(plain), "lora+lowmembp-norm", quantize="nf4")
    fp_conv = _apply(copy.deepcopy(plain), "lora+lowmembp-norm")
    err_base, err_conv, gap = _rel(_logits(base), fp), _rel(_logits(conv), fp), _rel(_logits(conv), _logits(base))
    print(f"relative logits difference: baseline QLoRA vs fp {err_base:.3f}, converted QLoRA vs fp {err_conv:.3f}, "
          f"converted vs baseline QLoRA {gap:.3f}")
    assert _rel(_logits(fp_conv), fp) < 1e-5  # without NF4 the fold is exact: all of the gap is quantisation
    assert gap > 1e-3  # they are different models
    nb, nc = _nf4(base), _nf4(conv)
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert not torch.equal(nb[q].weight.data, nc[q].weight.data)  # folded, then quantised
    assert torch.equal(nb[o].weight.data, nc[o].weight.data)  # reads no norm: the same 4-bit bytes
    assert 0.2 < err_conv / err_base < 5 and gap < 2 * (err_base + err_conv)  # of the order of NF4's own error


def test_merge_into_nf4_is_refused_and_export_dequantises():
    conv = _apply(_norms_model(), "lora+lowmembp", quantize="nf4")
    with pytest.raises(NotImplementedError, match="cannot merge LoRA into an NF4"):
        conv.merge_adapter()
    for n, p in conv.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    exported = lowmembp.export(conv)  # the folded NF4 bases come back dequantised, un-folded: the same function
    torch.testing.assert_close(_logits(exported), _logits(conv), rtol=1e-4, atol=1e-5)
    layer = exported.base_model.model.model.layers[0]
    assert type(layer.self_attn.q_proj.base_layer) is nn.Linear  # folded: full precision
    assert isinstance(layer.self_attn.o_proj.base_layer, bnb.nn.Linear4bit)  # not folded: still NF4


def test_lora_called_outside_apply_quantises_at_once():
    from lowmembp.methods.lora import apply_lora
    assert len(_nf4(apply_lora(_norms_model(), quantize="nf4"))) == 14


@pytest.mark.parametrize("spec", ["lora+lowmembp+checkpointing", "lora+mesa"])
def test_nf4_step_runs_before_the_later_methods(spec):
    """The deferred NF4 step (order 25) runs before mesa (30, which would make the fp base a MesaLinear) and
    checkpointing (50): every targeted base is NF4 and a step runs."""
    model = _apply(_norms_model(), spec, quantize="nf4")
    assert len(_nf4(model)) == 14
    model.train()
    loss = model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    assert torch.isfinite(loss)

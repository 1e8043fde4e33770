"""``velora``: peft's VeLoRA placed as ``lora`` places its adapters. B, the head and every input gradient equal LoRA's
exactly; A's gradient is VeLoRA's rank-1 approximation (its error measured and printed, exact where the input is rank-1
per group); fewer saved bytes than LoRA; trains; composes with lowmembp / checkpointing / tokentune; excludes lora and
lora-fa; export merges or saves the adapters."""
import copy

import pytest
import torch
import torch.nn as nn

import lowmembp
from peers_common import FAMILIES, adapter_pair, grads, loss_of, saved_total, train_steps
from tiny_models import build, logits

GROUPS = 8  # the tiny models are 32 wide (48-56 in their MLPs): 8 groups of 4-7 features


def _pair(name, **options):
    """(LoRA model, VeLoRA model, batch): same weights, same adapters, a non-zero B."""
    return adapter_pair(name, "lora", "velora", options_b={"num_groups": GROUPS}, **options)


def _error(ref, got):
    x, y = ref.flatten().double(), got.flatten().double()
    return float((x - y).norm() / x.norm()), float(nn.functional.cosine_similarity(x, y, dim=0))


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_b_and_head_exact_a_approximated(name):
    lora, velora, batch = _pair(name)
    assert any(hasattr(m, "lora_velora_embed") for m in velora.modules())
    loss_of(lora, batch).backward()
    loss_of(velora, batch).backward()
    g_lora, g_velora = grads(lora), grads(velora)
    assert set(g_lora) == set(g_velora)
    a_names = [k for k in g_lora if "lora_A" in k]
    assert a_names and len(a_names) < len(g_lora)
    for k in g_lora:
        if k not in a_names:  # B (x·A is exact in the forward), the head: LoRA's gradients
            torch.testing.assert_close(g_velora[k], g_lora[k], rtol=1e-5, atol=1e-7)
    errors = [_error(g_lora[k], g_velora[k]) for k in a_names]
    for k, (rel, cos) in zip(a_names, errors):
        assert torch.isfinite(g_velora[k]).all() and g_velora[k].abs().sum() > 0
        assert rel > 1e-3, f"{k}: VeLoRA's A gradient equals LoRA's: the compression is not active"
    rels, coss = zip(*errors)
    print(f"\n{name}: VeLoRA vs LoRA, A gradients ({len(errors)} layers, num_groups={GROUPS}): relative error "
          f"{min(rels):.3f}-{max(rels):.3f} (mean {sum(rels) / len(rels):.3f}), cosine {min(coss):.3f}-"
          f"{max(coss):.3f} (mean {sum(coss) / len(coss):.3f})")


def test_a_gradient_exact_when_the_input_is_rank_one_per_group():
    """VeLoRA reconstructs each group of features as a multiple of the batch's mean direction: for an input whose
    groups are all multiples of one positive vector the reconstruction, and so A's gradient, is exact."""
    lora, velora, _ = _pair("llama")
    width, group_dim = 32, 32 // GROUPS
    v = torch.rand(group_dim) + 0.5
    coeff = torch.rand(2, 7, GROUPS) + 0.1
    x = (coeff.unsqueeze(-1) * v).reshape(2, 7, width)  # every group of every token a positive multiple of v
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    out = []
    for m in (lora, velora):
        mod = m.get_submodule(layer)
        y = mod(x)
        y.pow(2).sum().backward()
        out.append(mod.lora_A["default"].weight.grad.clone())
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FAMILIES)
def test_saves_fewer_bytes_than_lora_and_trains(name):
    lora, velora, batch = _pair(name)
    saved_lora, saved_velora = saved_total(lora, batch)["total"], saved_total(velora, batch)["total"]
    print(f"\n{name}: saved bytes LoRA {saved_lora}, VeLoRA {saved_velora}")
    assert saved_velora < saved_lora
    losses, moved = train_steps(velora, batch)
    assert moved and losses[-1] < losses[0]


def test_each_velora_layer_saves_num_groups_values_per_token():
    from lowmembp.measurement.saved import SavedTensorAccountant

    _, velora, batch = _pair("llama")
    with SavedTensorAccountant(velora) as acc:
        logits(velora, batch)
    rows = acc.table()
    layers = [n for n, m in velora.named_modules() if hasattr(m, "lora_velora_embed")]
    from_a = [r for r in rows if ".lora_A." in r["module"] + "." or r["module"].endswith(tuple(layers))]
    tokens = batch["input_ids"].numel()
    compressed = [r for r in from_a if tuple(r["shape"]) == (tokens, GROUPS)]
    assert len(compressed) == len(layers)
    assert not [r for r in rows if ".base_layer" in r["module"]]


@pytest.mark.parametrize("spec", ["velora+lowmembp", "velora+checkpointing", "velora+tokentune"])
def test_composes(spec):
    model, inputs = build("llama")
    ref = lowmembp.apply(copy.deepcopy(model), "velora", num_groups=GROUPS).train()
    m = lowmembp.apply(model, spec, num_groups=GROUPS).train()
    assert any(hasattr(x, "lora_velora_embed") for x in m.modules())
    batch = inputs()
    if spec != "velora+tokentune":  # same forward as velora alone (lowmembp: to the folds' rounding)
        with torch.no_grad():
            torch.testing.assert_close(logits(m.eval(), batch), logits(ref.eval(), batch), rtol=1e-4, atol=1e-4)
        m.train()
    losses, moved = train_steps(m, batch)
    assert moved and losses[-1] < losses[0]


def test_refusals_and_spec_options():
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(build("vit")[0], "lora+velora")
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(build("vit")[0], "lora-fa+velora")
    model = build("llama")[0]
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(ValueError, match="num_groups=64 is not below the input width 32"):
        lowmembp.apply(model, "velora")  # peft's default 64 groups on a 32-wide model
    assert [n for n, _ in model.named_modules()] == names  # refused: the model is left as it was
    with pytest.raises(ValueError, match="init_type must be one of batch_average, batch_average_once, random"):
        lowmembp.apply(build("llama")[0], "velora", num_groups=4, init_type="mean")
    with pytest.raises(ValueError, match="velora: rank"):
        lowmembp.apply(build("llama")[0], "velora", num_groups=4, rank=0)
    m = lowmembp.apply(build("llama")[0], "velora@num_groups=4,rank=2,scale=0.5,init_type=random")
    layer = m.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert layer.lora_velora_num_groups["default"] == 4 and layer.lora_velora_scale["default"] == 0.5
    assert layer.lora_velora_init_type["default"] == "random" and layer.lora_A["default"].weight.shape[0] == 2
    assert "velora" in lowmembp.methods()


@pytest.mark.parametrize("spec", ["velora", "velora+lowmembp"])
def test_export_merges_and_saves_the_adapters(spec, tmp_path):
    from peft import PeftModel

    model, inputs = build("llama")
    stock = copy.deepcopy(model)
    m = lowmembp.apply(model, spec, num_groups=GROUPS).train()
    batch = inputs()
    train_steps(m, batch, lr=1e-2)
    m.eval()
    with torch.no_grad():
        want = logits(m, inputs(3))
        merged = lowmembp.export(m, merge_lora=True)
        assert not any(hasattr(x, "lora_A") for x in merged.modules())
        fresh = copy.deepcopy(stock)
        fresh.load_state_dict(merged.state_dict(), strict=True)
        torch.testing.assert_close(logits(fresh.eval(), inputs(3)), want, rtol=1e-4, atol=1e-4)
        lowmembp.export(m).save_pretrained(tmp_path)
        loaded = PeftModel.from_pretrained(copy.deepcopy(stock), tmp_path).eval()
        torch.testing.assert_close(logits(loaded, inputs(3)), want, rtol=1e-4, atol=1e-4)


def test_estimated_on_fake_tensors_below_lora():
    """The planner's estimate (peft on the meta device, a fake step): VeLoRA keeps fewer bytes than LoRA."""
    from lowmembp.estimator.step import estimate

    saved = {m: estimate("llama-7b", m, batch_size=1, seq_len=256, layers=2)["saved"]["total"]
             for m in ("lora", "velora")}
    assert 0 < saved["velora"] < saved["lora"]

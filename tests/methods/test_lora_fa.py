"""``lora-fa``: A frozen, B and the head trainable; the gradients equal LoRA's for every trainable parameter (a
frozen-A reference: same initialisation, A simply not updated); each LoRA layer saves exactly x·A (rank values per
token) and never its input; composes with ``lowmembp``; excludes ``lora``; trains a tiny ViT, BERT and LLaMA."""

import pytest
import torch

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from peers_common import FAMILIES, adapter_pair, grads, loss_of, train_steps
from tiny_models import build, logits


def _pair(name, **options):
    return adapter_pair(name, "lora", "lora-fa", **options)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_frozen_gradients_equal_loras(name):
    lora, fa, batch = _pair(name)
    names = {n for n, p in fa.named_parameters() if p.requires_grad}
    assert names and not any("lora_A" in n for n in names) and any("lora_B" in n for n in names)
    assert all(not p.requires_grad for n, p in fa.named_parameters() if "lora_A" in n)
    loss_of(lora, batch).backward()
    loss_of(fa, batch).backward()
    g_lora, g_fa = grads(lora), grads(fa)
    assert set(g_fa) == names and set(g_lora) - set(g_fa) == {n for n in g_lora if "lora_A" in n}
    for k in g_fa:  # B and the head see exactly LoRA's gradients at the same point
        torch.testing.assert_close(g_fa[k], g_lora[k], rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("rank", [2, 4])
def test_each_lora_layer_saves_x_times_a_only(name, rank):
    lora, fa, batch = _pair(name, rank=rank)
    reports = {}
    for label, m in (("lora", lora), ("fa", fa)):
        with SavedTensorAccountant(m) as acc:
            logits(m, batch)
        reports[label] = acc
    rows = reports["fa"].table()
    layers = [n for n, mod in fa.named_modules() if hasattr(mod, "lora_A") and len(getattr(mod, "lora_A", {}))]
    tokens = logits_tokens(name, batch)
    from_b = [r for r in rows if ".lora_B." in r["module"] + "."]
    assert len(from_b) == len(layers)
    assert all(r["shape"][-1] == rank for r in from_b)
    assert sum(r["bytes"] for r in from_b) == len(layers) * tokens * rank * 4  # fp32: x·A, rank values per token
    assert not [r for r in rows if ".lora_A." in r["module"] + "." or ".base_layer" in r["module"]]
    assert reports["fa"].report()["total"] < reports["lora"].report()["total"]


def logits_tokens(name, batch):
    from tiny_models import IMG
    if "x" in batch:
        return IMG[0] * ((IMG[2] // 8) ** 2 + 1)  # patches + [CLS] per image
    return batch["input_ids"].numel()


def test_composes_with_lowmembp_and_excludes_lora():
    model, inputs = build("llama")
    m = lowmembp.apply(model, "lora-fa+lowmembp").train()
    assert all(not p.requires_grad for n, p in m.named_parameters() if "lora_A" in n)
    losses, moved = train_steps(m, inputs())
    assert moved and losses[-1] < losses[0]
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(build("vit")[0], "lora+lora-fa")
    with pytest.raises(ValueError, match="lora-fa: rank"):
        lowmembp.apply(build("vit")[0], "lora-fa", rank=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_trains(name):
    _, fa, batch = _pair(name)
    losses, moved = train_steps(fa, batch)
    assert moved and losses[-1] < losses[0]

"""``lora``: peft adapters on the per-family default targets, α/r scaling, trainable head, errors."""
import re

import pytest
import torch

import lowmembp
from tiny_models import build, logits

# (model, adapted linears per block, suffixes that must be adapted, names that must not be)
CASES = {
    "vit": (4, ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"), ("patch_embed.proj", "head")),
    "swin": (4, ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"), ("patch_embed.proj", "downsample.reduction")),
    "bert": (6, ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"),
             ("pooler.dense", "classifier")),
    "llama": (7, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), ("lm_head",)),
}


def _lora_modules(model):
    return {n for n, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}


@pytest.mark.parametrize("name", list(CASES))
def test_default_targets_and_scaling(name):
    model, inputs = build(name)
    batch = inputs()
    with torch.no_grad():
        before = logits(model, batch)
    pm = lowmembp.apply(model, "lora")
    from peft import PeftModel
    assert isinstance(pm, PeftModel)
    per_block, must, must_not = CASES[name]
    adapted = _lora_modules(pm)
    from lowmembp.models import get_layout
    n_blocks = len(get_layout(pm).blocks)
    assert len(adapted) == per_block * n_blocks, sorted(adapted)
    for suffix in must:
        assert any(a.endswith(suffix) for a in adapted), suffix
    for bad in must_not:
        assert not any(a.endswith(bad) for a in adapted), bad
    for n, m in pm.named_modules():
        if n in adapted:
            assert m.r["default"] == 4 and m.scaling["default"] == 1.0  # alpha None: alpha = rank
    with torch.no_grad():
        torch.testing.assert_close(logits(pm, batch), before)  # B = 0 at init


@pytest.mark.parametrize("name,head", [("vit", "head"), ("swin", "head"), ("bert", "classifier"),
                                       ("llama_cls", "score"), ("llama", None)])
def test_only_adapters_and_classifier_train(name, head):
    model, inputs = build(name)
    pm = lowmembp.apply(model, "lora", rank=2, alpha=8)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    others = [n for n in trainable if "lora_" not in n]
    if head is None:
        assert others == []  # a causal LM's lm_head stays frozen
    else:
        assert others and all(re.search(rf"(^|\.){head}\.modules_to_save\.", n) for n in others), others
    assert all(m.scaling["default"] == 4.0 for n, m in pm.named_modules() if n in _lora_modules(pm))
    out = logits(pm, inputs())
    out.float().pow(2).mean().backward()
    assert all(pm.get_parameter(n).grad is not None for n in trainable if "lora_B" in n)


def test_custom_targets():
    model, _ = build("bert")
    pm = lowmembp.apply(model, "lora", targets="query, value")
    assert {n.rsplit(".", 1)[-1] for n in _lora_modules(pm)} == {"query", "value"}
    model, _ = build("llama")
    pm = lowmembp.apply(model, "lora", targets=["q_proj"], rank=3)
    assert len(_lora_modules(pm)) == 2 and all(n.endswith("q_proj") for n in _lora_modules(pm))


def test_errors():
    model, _ = build("vit")
    with pytest.raises(ValueError, match="rank"):
        lowmembp.apply(model, "lora", rank=0)
    with pytest.raises(ValueError, match="alpha"):
        lowmembp.apply(model, "lora", alpha=-1)
    with pytest.raises(ValueError, match="targets"):
        lowmembp.apply(model, "lora", targets=["no_such_layer"])
    pm = lowmembp.apply(build("vit")[0], "lora")
    with pytest.raises(ValueError, match="already a peft model"):
        from lowmembp.methods.lora import apply_lora
        apply_lora(pm)


def test_lora_after_lowmembp_shares_norm_output():
    """lowmembp first, lora in a later call: the new LoRA A layers save the MS-norm output, not peft's cast copy."""
    from lowmembp.ops.shared_linear import CastWeightLinear

    model = lowmembp.apply(build("vit")[0], "lowmembp")
    model = lowmembp.apply(model, "lora")
    lora_a = [m for n, m in model.named_modules() if n.endswith("lora_A.default")]
    assert lora_a and all(isinstance(m, CastWeightLinear) for m in lora_a)
    plain = lowmembp.apply(build("vit")[0], "lora")  # no MS norms: peft's layers are left as they are
    assert not any(isinstance(m, CastWeightLinear) for m in plain.modules())

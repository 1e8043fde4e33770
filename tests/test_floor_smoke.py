"""The compatibility tier (marker ``compat``; ``.ci/floors`` runs it in an environment at the declared floors of
torch / transformers / timm / peft, and it runs with the pinned versions in the main suite too): every method on a
tiny model of each adapter family — apply, one training step, the eval forward against the original (every method
here keeps the forward: LoRA starts at B = 0, the others change only what is saved or how gradients flow), export —
then ``estimate`` and a small plan."""
import copy

import pytest
import torch

import lowmembp
from tiny_models import build, logits

pytestmark = pytest.mark.compat

FAMILIES = ["vit", "bert", "llama"]
METHODS = ["checkpointing", "sac", "offload", "lora", "lora-fa", "lowmembp", "lowmembp-act", "lowmembp-norm", "mesa",
           "tokentune", "chunked-ce", "lora+lowmembp+checkpointing"]


def _loss(model, batch):
    out = logits(model, batch)
    return out.float().square().mean()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_apply_train_eval_export(family, method):
    if method == "chunked-ce" and family != "llama":
        pytest.skip("chunked-ce is for causal LMs (its refusal on other families is tested in tests/test_chunked_ce)")
    model, inputs = build(family)
    ref = copy.deepcopy(model).eval()
    new = lowmembp.apply(model, method)
    new.train()
    loss = _loss(new, inputs())
    loss.backward()
    grads = [p.grad for p in new.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    opt = torch.optim.SGD([p for p in new.parameters() if p.requires_grad], lr=0.0)
    opt.step()  # lr 0: the weights stay, so the forward can still be compared with the original
    new.eval()
    batch = inputs(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(logits(new, batch), logits(ref, batch), rtol=1e-4, atol=1e-4)
        exported = lowmembp.export(new)
        torch.testing.assert_close(logits(exported, batch), logits(ref, batch), rtol=1e-4, atol=1e-4)


LLAMA = dict(overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 61}, seq_len=8)


@pytest.mark.parametrize("method", ["baseline", "lora+lowmembp", "mesa+checkpointing"])
def test_estimate(method):
    from lowmembp.estimator.step import estimate
    r = estimate("llama-7b", method, batch_size=2, layers=2, dtype="bf16", **LLAMA)
    assert r["peak"]["bytes"] > 0
    v = estimate("vit-b16", method, batch_size=2, layers=1, dtype="fp16",
                 overrides={"img_size": 32, "embed_dim": 48, "num_heads": 3})
    assert v["peak"]["bytes"] > 0


def test_small_plan_command(capsys):
    from lowmembp.plan.__main__ import main
    args = ["--model", "llama-7b", "--batch-size", "2", "--seq-len", "8", "--gpu-memory", "80GiB",
            "--methods", "lora,lowmembp", "--max-methods", "1", "--jobs", "1", "--json"]
    assert main(args) == 0, capsys.readouterr().err

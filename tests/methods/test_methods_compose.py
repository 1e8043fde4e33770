"""Every method and the main combinations train a tiny ViT, BERT and LLaMA on CPU (loss falls on a fixed batch), and
the saved bytes come in the expected order at L = 128, k = 16 (models of benchmarks/saved_bytes_methods.py)."""

import pytest
import torch

import lowmembp
from script_loader import load_script
from tiny_models import build

pytestmark = pytest.mark.slow  # the full suite only: every pair of methods (~60 s)

SPECS = ["baseline", "checkpointing", "mesa", "mesa-gelu-ln", "lowmembp", "lowmembp-act", "lowmembp-norm",
         "tokentune", "lora", "lora+lowmembp", "lora+checkpointing", "lora+mesa-gelu-ln", "lowmembp+tokentune",
         "lora+lowmembp+tokentune"]
FAMILIES = ["vit", "bert", "llama"]


def _task(name):
    """A tiny model, a fixed batch with labels and its loss (ViT: cross-entropy; HF: the model's own loss)."""
    model, inputs = build(name)
    batch = inputs(seed=7)
    g = torch.Generator().manual_seed(11)
    if name == "vit":
        labels = torch.randint(0, 5, (batch["x"].shape[0],), generator=g)

        def loss(m):
            return torch.nn.functional.cross_entropy(m(**batch), labels)
    elif name == "bert":
        batch["labels"] = torch.randint(0, 3, (batch["input_ids"].shape[0],), generator=g)

        def loss(m):
            return m(**batch).loss
    else:
        batch["labels"] = batch["input_ids"]

        def loss(m):
            return m(**batch).loss
    return model, loss


def _eval_loss(model, loss):
    model.eval()
    with torch.no_grad():
        return float(loss(model))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", SPECS)
def test_trains_and_loss_falls(family, spec):
    torch.manual_seed(0)
    model, loss = _task(family)
    opts = {"k": 4} if "tokentune" in spec else {}  # tiny sequences (7 tokens, 17 for ViT): select a few
    model = lowmembp.apply(model, spec, **opts)
    before = _eval_loss(model, loss)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params
    lr = 2e-2 if "lora" in spec else 3e-3
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(8):
        opt.zero_grad(set_to_none=True)
        train_loss = loss(model)
        assert torch.isfinite(train_loss)
        train_loss.backward()
        assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in params)
        opt.step()
    after = _eval_loss(model, loss)
    assert after < 0.9 * before, (before, after)


def _bench():
    return load_script("benchmarks/saved_bytes_methods.py")


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_bytes_order_at_L128_k16(family):
    bench = _bench()
    methods = ["baseline", "lowmembp", "mesa", "checkpointing", "tokentune"]
    res = {m: bench.measure(family, m, seq_len=128, k=16) for m in methods}
    b = {m: r["saved"] for m, r in res.items()}
    ck = b["checkpointing"]  # block inputs included (test_memory.py::test_checkpoint_held_block_inputs_...)
    assert b["lowmembp"] < 0.85 * b["baseline"], b
    assert b["mesa"] < 0.75 * b["baseline"], b
    assert ck < 0.5 * b["lowmembp"], (ck, b)
    assert b["tokentune"] < 0.7 * b["lowmembp"], b

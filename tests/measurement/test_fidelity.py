"""lowmembp.measurement.fidelity: cosine and relative error per tensor against hand computations, summaries as one
concatenated vector, depth labels, and gradients of real models (an exact method at rounding level, an approximate one
not)."""
import copy
import math

import pytest
import torch
import torch.nn as nn

import lowmembp
from lowmembp.measurement.fidelity import (EMBED, HEAD, block_index, canonical_name, depth_labels, gradient_fidelity,
                                           gradients_of, summarize_fidelity)

from tiny_models import build, logits


def test_cosine_and_relative_error_by_hand():
    g = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 0.0, 0.0])}
    m = {"a": torch.tensor([4.0, 3.0]), "b": torch.tensor([2.0, 0.0, 0.0])}
    rows = {r["name"]: r for r in gradient_fidelity(g, m)}
    # a: <m, g> = 24, |m| = |g| = 5 -> cos 0.96; m - g = (1, -1) -> rel sqrt(2) / 5
    assert rows["a"]["cosine"] == pytest.approx(24 / 25)
    assert rows["a"]["rel_error"] == pytest.approx(math.sqrt(2) / 5)
    # b: the same direction twice as long: cos 1, rel 1
    assert rows["b"]["cosine"] == pytest.approx(1.0)
    assert rows["b"]["rel_error"] == pytest.approx(1.0)
    assert rows["a"]["numel"] == 2 and rows["b"]["ref_norm"] == pytest.approx(1.0)


def test_summary_is_the_concatenated_vector():
    torch.manual_seed(0)
    g = {f"t{i}": torch.randn(5 + i) for i in range(4)}
    m = {k: v + 0.3 * torch.randn_like(v) for k, v in g.items()}
    rows = gradient_fidelity(g, m)
    whole, = summarize_fidelity(rows)
    cg, cm = torch.cat(list(g.values())).double(), torch.cat(list(m.values())).double()
    assert whole["group"] == "all" and whole["tensors"] == 4 and whole["numel"] == cg.numel()
    assert whole["cosine"] == pytest.approx(float(nn.functional.cosine_similarity(cm, cg, dim=0)), rel=1e-12)
    assert whole["rel_error"] == pytest.approx(float((cm - cg).norm() / cg.norm()), rel=1e-12)
    halves = summarize_fidelity(rows, lambda n: "low" if n in ("t0", "t1") else "high")
    assert [h["group"] for h in halves] == ["low", "high"]
    low = torch.cat([g["t0"], g["t1"]]).double(), torch.cat([m["t0"], m["t1"]]).double()
    assert halves[0]["rel_error"] == pytest.approx(float((low[1] - low[0]).norm() / low[0].norm()), rel=1e-12)


def test_perturbation_of_known_size():
    """m = g + e with e orthogonal to g and |e| = r|g|: rel error r, cosine 1/sqrt(1 + r²)."""
    g = torch.zeros(100)
    g[:50] = torch.randn(50, generator=torch.Generator().manual_seed(1))
    e = torch.zeros(100)
    e[50:] = torch.randn(50, generator=torch.Generator().manual_seed(2))
    for r in (1e-3, 0.1, 2.0):
        m = g + e * (r * g.norm() / e.norm())
        row, = gradient_fidelity({"w": g}, {"w": m})
        assert row["rel_error"] == pytest.approx(r, rel=1e-5)
        assert row["cosine"] == pytest.approx(1 / math.sqrt(1 + r * r), rel=1e-5)
    flipped, = gradient_fidelity({"w": g}, {"w": -g})
    assert flipped["cosine"] == pytest.approx(-1.0) and flipped["rel_error"] == pytest.approx(2.0)


def test_zero_gradients_and_mismatches():
    zero = torch.zeros(3)
    both, = gradient_fidelity({"w": zero}, {"w": zero})
    assert both["cosine"] == 1.0 and both["rel_error"] == 0.0
    one, = gradient_fidelity({"w": zero}, {"w": torch.ones(3)})
    assert math.isnan(one["cosine"]) and one["rel_error"] == math.inf
    assert [r["name"] for r in gradient_fidelity({"a": zero, "b": zero}, {"b": zero})] == ["b"]
    with pytest.raises(KeyError, match="'a' has no gradient in the method"):
        gradient_fidelity({"a": zero}, {"b": zero}, names=["a"])
    with pytest.raises(ValueError, match="shape"):
        gradient_fidelity({"a": zero}, {"a": torch.zeros(4)})


def test_names_and_depths():
    assert canonical_name("blocks.0._checkpoint_wrapped_module.attn.qkv.weight") == "blocks.0.attn.qkv.weight"
    assert canonical_name("_orig_mod.model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert block_index("base_model.model.bert.encoder.layer.11.output.dense.lora_B.default.weight") == 11
    assert block_index("cls_token") is None and block_index("model.norm.weight") is None
    names = ["cls_token", "patch_embed.proj.weight", "blocks.0.norm1.weight", "blocks.1.mlp.fc2.bias", "norm.weight",
             "head.weight"]
    assert depth_labels(names) == {"cls_token": EMBED, "patch_embed.proj.weight": EMBED, "blocks.0.norm1.weight": "0",
                                   "blocks.1.mlp.fc2.bias": "1", "norm.weight": HEAD, "head.weight": HEAD}


def _loss(model, batch):
    out = logits(model, batch)
    return (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum()


@pytest.mark.parametrize("name", ["vit", "llama"])
def test_exact_method_is_at_rounding_level_and_approximate_is_not(name):
    model, inputs = build(name)
    batch = inputs()
    ref = gradients_of(model, _loss, batch)
    ckpt = gradients_of(lowmembp.apply(copy.deepcopy(model), "checkpointing"), _loss, batch)
    assert set(ckpt) == set(ref)  # the checkpoint wrapper's name parts are gone
    whole, = summarize_fidelity(gradient_fidelity(ref, ckpt))
    assert whole["cosine"] == pytest.approx(1.0, abs=1e-6) and whole["rel_error"] < 1e-5
    exact = lowmembp.apply(copy.deepcopy(model), "lowmembp-norm")
    approx = lowmembp.apply(copy.deepcopy(exact), "lowmembp-act")
    g_exact, g_approx = gradients_of(exact, _loss, batch), gradients_of(approx, _loss, batch)
    rows = gradient_fidelity(g_exact, g_approx)
    whole, = summarize_fidelity(rows)
    assert whole["rel_error"] > 1e-4 and whole["cosine"] < 1.0
    by_depth = summarize_fidelity(rows, depth_labels(g_exact))
    assert [d["group"] for d in by_depth] == [EMBED, "0", "1", HEAD]
    # the head's gradient needs no activation derivative: exact; the blocks' do not
    assert by_depth[-1]["rel_error"] < 1e-5 and max(d["rel_error"] for d in by_depth[1:3]) > 1e-4


def test_gradients_of_autocast_and_seed():
    model, inputs = build("vit")
    batch = inputs()
    g32 = gradients_of(model, _loss, batch)
    g16 = gradients_of(model, _loss, batch, autocast_dtype=torch.bfloat16)
    assert all(v.dtype == torch.float32 for v in g16.values()) and set(g16) == set(g32)
    whole, = summarize_fidelity(gradient_fidelity(g32, g16))
    assert 0 < whole["rel_error"] < 0.1  # bf16 rounding: not zero, small
    assert all(p.grad is None for p in model.parameters())

    def noisy(m, b):
        return _loss(m, b) * (1 + torch.rand(()))
    a, b = gradients_of(model, noisy, batch, seed=5), gradients_of(model, noisy, batch, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)

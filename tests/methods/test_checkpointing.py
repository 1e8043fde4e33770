"""``checkpointing``: same forward and gradients as the unmodified model, blocks recomputed in backward, far fewer
saved bytes, ``every=2`` in between; eval runs plainly; layouts still find the (unchanged) blocks."""
import copy

import pytest
import torch

import lowmembp
from lowmembp.measurement.saved import saved_bytes
from lowmembp.methods.checkpointing import is_checkpointed
from lowmembp.models import get_layout
from tiny_models import build, logits, lora_wrap

FAMILIES = ["vit", "swin", "bert", "llama"]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _attn_calls(model):
    """Count calls of each block's attention module (runs inside the block, so recomputation counts too)."""
    calls = []
    for site in get_layout(model).attentions:
        calls.append(0)
        i = len(calls) - 1
        site.get().register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("name", FAMILIES)
def test_same_forward_and_gradients_blocks_recomputed(name):
    model, inputs = build(name)
    model.train()
    ref = copy.deepcopy(model)
    blocks_before = [s.get() for s in get_layout(model).blocks]
    model = lowmembp.apply(model, "checkpointing")
    blocks_after = [s.get() for s in get_layout(model).blocks]
    assert blocks_after == blocks_before  # same objects, same classes: layouts and state dicts see the same model
    assert set(model.state_dict()) == set(ref.state_dict())
    expect_how = {"vit": "timm", "swin": "wrapper", "bert": "transformers", "llama": "transformers"}[name]
    assert model._checkpointing["how"] == expect_how
    calls = _attn_calls(model)
    batch = inputs()
    y0, y1 = logits(ref, batch), logits(model, batch)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    y0.pow(2).mean().backward()
    y1.pow(2).mean().backward()
    assert calls == [2] * len(calls)  # one forward, one recomputation per block
    g0, g1 = _grads(ref), _grads(model)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_bytes_far_lower_every2_between(name):
    totals = {}
    for every in (None, 2, 1):
        model, inputs = build(name)
        model.train()
        if every:
            model = lowmembp.apply(model, "checkpointing", every=every)
        batch = inputs()
        totals[every] = saved_bytes(model, lambda: logits(model, batch))["total"]
    assert totals[1] < totals[2] < totals[None], totals
    assert totals[1] < 0.35 * totals[None], totals


@pytest.mark.parametrize("name", ["vit", "bert"])
def test_every2_wraps_alternate_blocks_and_eval_runs_plain(name):
    model, inputs = build(name)
    ref = copy.deepcopy(model)
    model = lowmembp.apply(model, "checkpointing", every=2)
    assert model._checkpointing["how"] == "wrapper"
    blocks = [s.get() for s in get_layout(model).blocks]
    assert [is_checkpointed(b) for b in blocks] == [i % 2 == 0 for i in range(len(blocks))]
    model.eval(), ref.eval()
    calls = _attn_calls(model)
    batch = inputs()
    out = logits(model, batch)
    out.sum().backward()  # eval with grad: no checkpoint, no recomputation
    assert calls == [1] * len(calls)
    with torch.no_grad():
        torch.testing.assert_close(logits(model, batch), logits(ref, batch), rtol=0, atol=0)


def test_library_hooks_are_non_reentrant(monkeypatch):
    bert, _ = build("bert")
    lowmembp.apply(bert, "checkpointing")
    layers = [s.get() for s in get_layout(bert).blocks]
    assert all(layer.gradient_checkpointing for layer in layers)
    assert all(layer._gradient_checkpointing_func.keywords["use_reentrant"] is False for layer in layers)
    import timm.layers.config as tcfg
    monkeypatch.setattr(tcfg, "_USE_REENTRANT_CKPT", True)  # a user asked timm for reentrant: use our wrapper
    vit, _ = build("vit")
    assert lowmembp.apply(vit, "checkpointing")._checkpointing["how"] == "wrapper"
    assert not vit.grad_checkpointing


def test_with_frozen_parameters_lora():
    model, inputs = build("vit")
    peft_ref = lora_wrap(copy.deepcopy(model), "vit")
    peft_ck = lowmembp.apply(copy.deepcopy(peft_ref), "checkpointing", every=1)
    batch = inputs()
    logits(peft_ref, batch).pow(2).mean().backward()
    logits(peft_ck, batch).pow(2).mean().backward()
    g0, g1 = _grads(peft_ref), _grads(peft_ck)
    assert g0 and g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-6, atol=1e-7)


def test_bad_every():
    model, _ = build("vit")
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="every"):
            lowmembp.apply(model, "checkpointing", every=bad)


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
def test_after_tokentune_same_gradients_fewer_bytes(name):
    """tokentune runs its own block loop: checkpointing then wraps the blocks themselves (same gradients)."""
    model, inputs = build(name)
    model.train()
    batch = inputs()
    tt = lowmembp.apply(copy.deepcopy(model), "tokentune", k=3)
    ck = lowmembp.apply(copy.deepcopy(model), "tokentune+checkpointing", k=3)
    assert ck._checkpointing["how"] == "wrapper"
    torch.manual_seed(5)  # the same token selection in both
    saved_tt = saved_bytes(tt, lambda: logits(tt, batch).pow(2).mean().backward())["total"]
    torch.manual_seed(5)
    saved_ck = saved_bytes(ck, lambda: logits(ck, batch).pow(2).mean().backward())["total"]
    assert saved_ck < 0.6 * saved_tt, (saved_ck, saved_tt)
    g0, g1 = _grads(tt), _grads(ck)
    assert g0 and g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["vit", "bert"])
def test_wrapped_blocks_survive_save_load_and_deepcopy(name, tmp_path):
    """torch.save / torch.load and deepcopy of a model whose blocks our wrapper checkpoints: the copy trains on its
    own blocks, checkpointed like the original, with the same gradients."""
    model, inputs = build(name)
    model = lowmembp.apply(model, "checkpointing", every=2)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for other in (loaded, copy.deepcopy(model)):
        blocks = [s.get() for s in get_layout(other).blocks]
        assert [is_checkpointed(b) for b in blocks] == [i % 2 == 0 for i in range(len(blocks))]
        assert all(b.forward.block is b for b in blocks if is_checkpointed(b))
        model.train(), other.train()
        model.zero_grad()
        batch = inputs()
        logits(model, batch).sum().backward()
        logits(other, batch).sum().backward()
        ref = _grads(model)
        got = _grads(other)
        assert ref.keys() == got.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n])

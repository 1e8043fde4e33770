"""``sac``: gradients equal the baseline's exactly for every policy; saved bytes fall in the order the policies promise
(save-nothing = plain checkpointing's); eval runs plainly; composition rules; trains a tiny ViT, BERT and LLaMA."""
import pytest
import torch

import lowmembp
from lowmembp.methods.sac import MATMUL_OPS, POLICIES
from lowmembp.models import get_layout
from peers_common import FAMILIES, grads, loss_of, pair, saved_total, train_steps
from tiny_models import build, logits

POLICY_NAMES = list(POLICIES)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_gradients_equal_baseline(name, policy):
    ref, model, batch = pair(name, "sac", policy=policy)
    loss_of(ref, batch).backward()
    calls = []
    for site_ in get_layout(model).attentions:
        site_.get().register_forward_hook(lambda *a: calls.append(1))
    loss_of(model, batch).backward()
    assert len(calls) == 2 * len(get_layout(model).blocks)  # each block ran again in the backward
    g0, g1 = grads(ref), grads(model)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_bytes_follow_the_policy(name):
    base = saved_total(pair(name, "baseline")[1], pair(name, "baseline")[2])["total"]
    by_policy = {}
    for policy in POLICY_NAMES:
        _, model, batch = pair(name, "sac", policy=policy)
        by_policy[policy] = saved_total(model, batch)["total"]
    _, ckpt, batch = pair(name, "checkpointing")
    plain_ckpt = saved_total(ckpt, batch)["total"]
    assert by_policy["save-nothing"] == plain_ckpt           # recompute everything = plain checkpointing
    assert plain_ckpt < by_policy["save-attention"] < by_policy["save-matmuls"] < base
    # bf16 autocast: the casts and pointwise ops are recomputed, so save-matmuls keeps less than half the baseline
    _, model, batch = pair(name, "sac")
    amp = saved_total(model, batch, dtype=torch.bfloat16)["total"]
    _, ref, batch = pair(name, "baseline")
    assert amp < 0.75 * saved_total(ref, batch, dtype=torch.bfloat16)["total"]


def test_save_matmuls_keeps_the_matmul_outputs():
    """What save-matmuls keeps inside a block is exactly the outputs of the matrix products and attention (plus the
    block inputs checkpointing keeps), counted independently by a dispatch mode over one block's forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowmembp.methods.sac import ATTENTION_OPS

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.inside = 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.inside and func in MATMUL_OPS | ATTENTION_OPS:
                for t in (out if isinstance(out, (tuple, list)) else [out]):
                    if isinstance(t, torch.Tensor):
                        self.bytes += t.untyped_storage().nbytes()
            return out

    model, inputs = build("vit")
    model.train()
    batch = inputs()
    mode = Outputs()
    for site_ in get_layout(model).blocks:  # count inside the blocks only (not the patch embedding, not the head)
        site_.get().register_forward_pre_hook(lambda *a: setattr(mode, "inside", True))
        site_.get().register_forward_hook(lambda *a: setattr(mode, "inside", False))
    with mode:
        logits(model, batch)
    kept = mode.bytes
    sac = lowmembp.apply(build("vit")[0], "sac")
    ckpt = lowmembp.apply(build("vit")[0], "checkpointing")
    diff = saved_total(sac, batch)["total"] - saved_total(ckpt, batch)["total"]
    assert diff == kept


def test_eval_runs_the_plain_forward():
    ref, model, batch = pair("llama", "sac")
    ref.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(model, batch), logits(ref, batch), rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_trains(name):
    _, model, batch = pair(name, "lora+sac" if name == "bert" else "sac")
    losses, moved = train_steps(model, batch)
    assert moved and losses[-1] < losses[0]


def test_composition_rules():
    model, _ = build("vit")
    for spec in ("sac+checkpointing", "sac+tokentune"):
        with pytest.raises(ValueError, match="cannot be combined"):
            lowmembp.apply(model, spec)
    with pytest.raises(ValueError, match="unknown policy"):
        lowmembp.apply(model, "sac", policy="save-everything")
    assert "sac" in lowmembp.list_methods()

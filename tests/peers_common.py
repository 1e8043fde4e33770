"""Helpers of the peer-method tests (offload, sac, lora-fa, velora, tiled-mlp, cce, chunked-ce, liger): one loss,
gradients, the same LoRA adapters in two models, an exact-step comparison, a few steps."""
import copy

import torch

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from tiny_models import build, logits

FAMILIES = ["vit", "bert", "llama"]


def loss_of(model, batch):
    """A loss through the whole model: the mean square of its logits (every output unit gets a gradient)."""
    return logits(model, batch).float().pow(2).mean()


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def pair(name, spec, seed=0, **options):
    """(reference model, converted model, batch): the same weights, ``spec`` applied to the second (train mode)."""
    model, inputs = build(name, seed)
    ref = copy.deepcopy(model)
    out = lowmembp.apply(model, spec, **options)
    ref.train()
    out.train()
    return ref, out, inputs()


def same_lora_b(a, b, seed=5):
    """Give the LoRA B matrices of ``a`` and ``b`` the same non-zero values (peft starts B at 0, where every other
    adapter gradient is trivially zero); the two models' parameters must correspond name by name."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert na == nb
            if "lora_B" in na:
                pa.normal_(0, 0.1, generator=g)
                pb.copy_(pa)


def adapter_pair(name, spec_a, spec_b, options_b=None, **options):
    """(model with ``spec_a``, model with ``spec_b``, batch): the same weights, the same adapter initialisation (seed 3)
    and the same non-zero LoRA B, both in train mode; ``options`` go to both, ``options_b`` to the second only."""
    model, inputs = build(name)
    torch.manual_seed(3)
    a = lowmembp.apply(copy.deepcopy(model), spec_a, **options).train()
    torch.manual_seed(3)
    b = lowmembp.apply(model, spec_b, **(options_b or {}), **options).train()
    same_lora_b(a, b)
    return a, b, inputs()


def assert_same_step(ref, out, batch, tol, loss=loss_of, grad_atol=None):
    """The loss and every gradient of ``out`` equal ``ref``'s: ``tol`` relative, of the loss and of the largest
    gradient (several gradients are 0 up to rounding); ``grad_atol``, when given, replaces ``tol`` as the gradients'
    absolute bound (a fraction of the largest gradient)."""
    loss_ref, loss_out = loss(ref, batch), loss(out, batch)
    torch.testing.assert_close(loss_out, loss_ref, rtol=tol, atol=0)
    loss_ref.backward()
    loss_out.backward()
    g_ref, g_out = grads(ref), grads(out)
    assert g_ref and set(g_ref) == set(g_out)
    scale = max(g.abs().max().item() for g in g_ref.values())
    for k in g_ref:
        torch.testing.assert_close(g_out[k], g_ref[k], rtol=tol, atol=(tol if grad_atol is None else grad_atol) * scale)


def saved_total(model, batch, loss=loss_of, **autocast):
    with SavedTensorAccountant(model) as acc, torch.autocast("cpu", **autocast) if autocast else _null():
        value = loss(model, batch)
    value.backward()
    return acc.report()


def train_steps(model, batch, loss=loss_of, steps=3, lr=1e-3):
    """A few AdamW steps on one batch: the losses (they must fall) and whether every trainable parameter moved."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        value = loss(model, batch)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(value.detach()))
    moved = all(not torch.equal(a, p.detach()) for a, p in zip(before, params))
    return losses, moved


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

"""Helpers of the peer-method tests (offload, sac, lora-fa, chunked-ce, liger): one loss, gradients, a few steps."""
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

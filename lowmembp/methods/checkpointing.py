"""``checkpointing``: non-reentrant gradient checkpointing per transformer block (docs/design.md#checkpointing).

Each checkpointed block keeps only its inputs during the forward; its activations are recomputed in the backward
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: works with frozen inputs, keyword arguments and
non-tensor outputs; the RNG state is preserved, so dropout recomputes the same mask).

Option ``every`` (default 1): checkpoint blocks ``0, n, 2n, ...`` (every n-th block); the others run normally.

How: with ``every=1`` the library's own switch is used where there is one and nothing else rewrote the block loop —
timm's ``set_grad_checkpointing(True)`` (timm checkpoints with ``use_reentrant`` = ``timm.layers.use_reentrant_ckpt()``,
False unless ``TIMM_REENTRANT_CKPT`` is set; if it is set we fall back to our wrapper) and transformers'
``activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})`` (older releases:
``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``). Otherwise (``every > 1``,
Swin, models whose block loop another method replaced, e.g. ``tokentune``) each chosen block's ``forward`` is wrapped
on the instance: the module keeps its class, name and parameters (layouts and state dicts see the same model), and
checkpoints only in training mode with grad enabled — in eval it runs the plain forward.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lowmembp.methods.registry import register

_RUNS_OWN_BLOCK_LOOP = ("tokentune",)  # methods after which library switches may not be honoured


def _check(every=1, **_) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpointing: every must be a positive integer (1 = every block), got {every!r}")


@register("checkpointing", "non-reentrant gradient checkpointing per block (option every: every n-th block)",
          options={"every": 1}, order=50, check=_check)
def apply_checkpointing(model: nn.Module, every: int = 1) -> nn.Module:
    from lowmembp.models import get_layout

    _check(every)
    layout = get_layout(model)
    if not layout.blocks:
        raise ValueError(f"checkpointing: no transformer blocks found in {type(layout.base).__name__}")
    others = set(getattr(model, "_lowmembp_methods", ())) & set(_RUNS_OWN_BLOCK_LOOP)
    how = None
    if every == 1 and not others:
        how = _library_switch(layout)
    if how is None:
        for i, site in enumerate(layout.blocks):
            if i % every == 0:
                wrap_block(site.get())
        how = "wrapper"
    object.__setattr__(model, "_checkpointing", {"every": every, "how": how,
                                                 "blocks": sum(1 for i in range(len(layout.blocks)) if i % every == 0)})
    return model


def _library_switch(layout) -> str | None:
    base = layout.base
    if layout.checkpoint_switch == "timm" and hasattr(base, "set_grad_checkpointing"):
        from timm.layers import use_reentrant_ckpt

        if use_reentrant_ckpt():
            return None
        base.set_grad_checkpointing(True)
        return "timm"
    if layout.checkpoint_switch == "transformers" and getattr(base, "supports_gradient_checkpointing", False):
        kwargs = {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x (the old name is deprecated)
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return "transformers"
    return None


def wrap_block(block: nn.Module) -> nn.Module:
    """Make ``block`` checkpoint itself (non-reentrant) in training; idempotent; returns ``block``."""
    if getattr(block, "_lowmembp_checkpointed", False):
        return block
    inner = block.__dict__.get("forward")  # an instance-level forward another method installed, if any
    object.__setattr__(block, "_lowmembp_inner_forward", inner)
    block.forward = _CheckpointedForward(block)
    block._lowmembp_checkpointed = True
    return block


def is_checkpointed(block: nn.Module) -> bool:
    return bool(getattr(block, "_lowmembp_checkpointed", False))


class _CheckpointedForward:
    """The instance-level forward of a wrapped block: a picklable callable (``torch.save(model)`` and
    ``copy.deepcopy`` work; a bound method of a module-level function would not unpickle)."""

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, *args, **kwargs):
        return _checkpointed_forward(self.block, *args, **kwargs)

    @property
    def __signature__(self):  # what inspect.signature reads: the wrapped forward's parameters
        from lowmembp.methods._signature import original_signature
        return original_signature(self.block, "forward", self.block.__dict__.get("_lowmembp_inner_forward"))


def _checkpointed_forward(self, *args, **kwargs):
    inner = self.__dict__.get("_lowmembp_inner_forward") or functools.partial(type(self).forward, self)
    if self.training and torch.is_grad_enabled():
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return inner(*args, **kwargs)

"""``tiled-mlp``: each block's MLP computed over sequence tiles with recomputation (the idea of Liger-Kernel's
TiledMLP, Snowflake's ALST and Unsloth's tiled MLP), exact.

An MLP's intermediate activations (the up / gate projections, the activation, their product: 2-4 × the MLP width per
token) are usually a block's largest, and an MLP acts on every token alone, so splitting its input along the tokens
changes nothing but the matmuls' blocking. Each tile runs under non-reentrant ``torch.utils.checkpoint``: the forward
keeps only the tile's input (a view of the MLP input, which the MLP's first linear saves anyway), and the backward
recomputes one tile at a time, so one tile's intermediates are alive at once; the cost is a second MLP forward.
Tiles are taken over the ``B·L`` tokens laid end to end (a tile may span two sequences). Options: ``tiles`` (how
many) or ``tile_len`` (tokens per tile), not both; default tiles of ``hidden_size`` tokens, as Liger-Kernel and ALST
choose. Where: each block's ``mlp`` child, or BERT's ``feed_forward_chunk``; replaced on the instance for training
with grad enabled. Composes with the methods that keep the MLP a function of each token. In full, with measured
figures: docs/methods/tiled-mlp.md.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lowmembp.methods.registry import register


def check_tiled_mlp(tiles=None, tile_len=None):
    for name, value in (("tiles", tiles), ("tile_len", tile_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"tiled-mlp: {name} must be a positive integer or None, got {value!r}")
    if tiles is not None and tile_len is not None:
        raise ValueError(f"tiled-mlp: give tiles ({tiles}) or tile_len ({tile_len}), not both")


@register("tiled-mlp", "each block's MLP over sequence tiles with recomputation: one tile's intermediates alive "
                       "(tiles or tile_len; default tiles of hidden_size tokens)",
          options={"tiles": None, "tile_len": None}, order=35, kinds={"tiles": (int,), "tile_len": (int,)},
          check=check_tiled_mlp)
def apply_tiled_mlp(model: nn.Module, tiles: int | None = None, tile_len: int | None = None) -> nn.Module:
    from lowmembp.models import get_layout

    check_tiled_mlp(tiles, tile_len)
    layout = get_layout(model)
    if not layout.blocks:
        raise ValueError(f"tiled-mlp: no transformer blocks found in {type(layout.base).__name__}")
    sites = [mlp_site(s.get(), s.path) for s in layout.blocks]
    for owner, attr in sites:
        if "_lowmembp_tiled_mlp" in owner.__dict__:
            raise RuntimeError(f"tiled-mlp: {type(owner).__name__}.{attr} is already tiled")
    for owner, attr in sites:
        inner = owner.__dict__.get(attr)  # an instance-level override another method installed, if any
        object.__setattr__(owner, "_lowmembp_tiled_mlp", {"attr": attr, "inner": inner})
        setattr(owner, attr, _TiledForward(owner, attr, inner, tiles, tile_len))
    object.__setattr__(model, "_tiled_mlp", {"tiles": tiles, "tile_len": tile_len, "mlps": len(sites)})
    return model


def mlp_site(block: nn.Module, path: str = "") -> tuple[nn.Module, str]:
    """(module, attribute) of the per-token MLP call of ``block``: ``(block.mlp, "forward")`` or, for BERT layers,
    ``(block, "feed_forward_chunk")``; a ValueError naming the block when it has neither."""
    mlp = getattr(block, "mlp", None)
    if isinstance(mlp, nn.Module):
        return mlp, "forward"
    if callable(getattr(block, "feed_forward_chunk", None)) and hasattr(block, "intermediate"):
        return block, "feed_forward_chunk"
    raise ValueError(f"tiled-mlp: block {path or type(block).__name__} ({type(block).__name__}) has no 'mlp' child "
                     f"and no BERT 'feed_forward_chunk': supported are timm ViT / Swin blocks, LLaMA-family decoder "
                     f"layers and BERT / RoBERTa layers")


def tile_lengths(length: int, width: int, tiles: int | None, tile_len: int | None) -> list[int]:
    """The tile lengths that split ``length`` tokens (``width``: the MLP input width, the default tile length)."""
    if tiles is not None:
        n = max(1, min(tiles, length))
        return [len(t) for t in torch.arange(length).tensor_split(n)]
    step = tile_len or width
    return [min(step, length - s) for s in range(0, length, step)] or [length]


class _TiledForward:
    """The instance-level MLP call: tiles of tokens, each checkpointed (picklable, as checkpointing's wrapper)."""

    def __init__(self, owner, attr, inner, tiles, tile_len):
        self.owner, self.attr, self.inner, self.tiles, self.tile_len = owner, attr, inner, tiles, tile_len

    @property
    def __signature__(self):
        from lowmembp.methods._signature import original_signature
        return original_signature(self.owner, self.attr, self.inner)

    def __call__(self, *args, **kwargs):
        owner = self.owner
        plain = self.inner or functools.partial(getattr(type(owner), self.attr), owner)
        x = args[0] if len(args) == 1 and not kwargs else None
        if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() > 0 and owner.training
                and torch.is_grad_enabled()):
            return plain(*args, **kwargs)
        tokens = x.reshape(-1, x.shape[-1])  # the batch's sequences end to end (a view of a contiguous input)
        lengths = tile_lengths(tokens.shape[0], x.shape[-1], self.tiles, self.tile_len)
        outs = [checkpoint(plain, tile, use_reentrant=False) for tile in tokens.split(lengths)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(*x.shape[:-1], out.shape[-1])

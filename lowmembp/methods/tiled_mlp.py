"""``tiled-mlp``: each block's MLP computed over sequence tiles with recomputation (the idea of Liger-Kernel's
TiledMLP, Snowflake's ALST and Unsloth's tiled MLP), exact.

An MLP acts on every token alone, so splitting its input along the sequence and concatenating the outputs changes
nothing but the matmuls' blocking. Each tile runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
the forward keeps only the tile's input (a view of the MLP input, which the MLP's first linear saves anyway without
tiling) and no intermediate activation (the up/gate projections, the activation, their product: 2-4 × the MLP width
per token, usually the largest activations of a block). The backward recomputes one tile at a time, so only one
tile's intermediates are alive at once. Cost: the MLP's forward runs twice (about a third more MLP compute).

The tiles are taken over the batch's tokens laid end to end (``B·L`` rows of the ``B × L × D`` input, as Liger's
TiledMLP does; each tile a contiguous ``rows × D`` view), so a tile may span two sequences. Options: ``tiles`` (the
number of tiles: the ``B·L`` tokens split into that many near-equal parts) or ``tile_len`` (tokens per tile; the last
tile takes the rest). Default (neither): tiles as long as the MLP's input width (``hidden_size`` tokens;
``⌈B·L / hidden_size⌉`` tiles), as Liger-Kernel's and ALST's tiled MLPs choose; with one tile the MLP is simply
recomputed in the backward. Giving both is an error.

Where: the ``mlp`` child of each block (timm ViT / Swin blocks, LLaMA-family decoder layers: ``mlp(x)``), or BERT's
``feed_forward_chunk`` (``intermediate`` + ``output``: dense, activation, dense, dropout and the residual LayerNorm,
all per token). The module keeps its class and parameters: its ``forward`` (or ``feed_forward_chunk``) is replaced on
the instance, in training with grad enabled only (eval and ``no_grad`` run the plain forward). Dropout inside the MLP
draws its masks per tile: the same distribution as the plain model's, not the same masks.

Composes with everything that keeps the MLP a function of each token: ``lora`` / ``velora`` / ``lora-fa`` (their
adapters run inside the tiles), ``lowmembp`` (approximate activations and MS-norms inside), ``mesa``, ``tokentune``
(the selected tokens are tiled), ``checkpointing`` (a checkpoint inside a checkpoint: in the block's recomputation
the MLP again keeps only its tile inputs).
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

"""Adapters for timm vision models: ``VisionTransformer`` (vit_*, deit_*, distilled DeiT) and ``SwinTransformer``.

Recognised by structure: a ViT has ``patch_embed``, a ``blocks`` sequence whose blocks run timm's pre-norm
``Block.forward`` (``x + attn(norm1(x))``, ``x + mlp(norm2(x))``) and a ``head``; a Swin has ``layers`` of stages with
``blocks`` running ``SwinTransformerBlock.forward`` and ``PatchMerging`` downsamplers. Subclasses that keep those
forwards are accepted; blocks with another forward (ResPostBlock, parallel blocks, ...) are refused.
"""
from __future__ import annotations

import torch.nn as nn

from lowmembp.models.detect import act_kind, is_linear_like, norm_kind
from lowmembp.models.layout import (BUILTIN_PRIORITY, ActSite, ModelLayout, NormSite, UnsupportedModelError,
                                    register_adapter, site)


def _timm_block_forwards():
    from timm.models.swin_transformer import SwinTransformerBlock
    from timm.models.vision_transformer import Block
    return Block.forward, SwinTransformerBlock.forward


def _attn_inputs(attn: nn.Module, prefix: str):
    """The linears of a timm attention module that read its input: fused ``qkv`` or separate q/k/v."""
    for names in (("qkv",), ("q", "k", "v"), ("q_proj", "k_proj", "v_proj")):
        if all(is_linear_like(getattr(attn, n, None) or nn.Identity()) for n in names):
            return [site(attn, n, prefix) for n in names]
    raise UnsupportedModelError(f"{prefix}: attention {type(attn).__name__} has no qkv / q,k,v linears")


def _mlp_parts(mlp: nn.Module, prefix: str):
    """(input linears, activation site or None) of a timm Mlp / GluMlp / SwiGLU."""
    for names in (("fc1",), ("fc1_g", "fc1_x")):
        if all(is_linear_like(getattr(mlp, n, None) or nn.Identity()) for n in names):
            fcs = [site(mlp, n, prefix) for n in names]
            break
    else:
        raise UnsupportedModelError(f"{prefix}: MLP {type(mlp).__name__} has no fc1 (or fc1_g/fc1_x) linear")
    act = getattr(mlp, "act", None)
    kind = act_kind(act) if isinstance(act, nn.Module) else None
    return fcs, (site(mlp, "act", prefix, ActSite, kind=kind) if kind else None)


def _block_norm(block, attr, prefix, consumers, **kw) -> NormSite:
    m = getattr(block, attr)
    kind = norm_kind(m)
    if kind is None:
        raise UnsupportedModelError(f"{prefix}.{attr} is {type(m).__name__}, not a LayerNorm")
    return site(block, attr, prefix, NormSite, kind=kind, consumers=consumers, **kw)


def _head_linears(owner: nn.Module, names, prefix: str):
    return [site(owner, n, prefix) for n in names if is_linear_like(getattr(owner, n, None) or nn.Identity())]


@register_adapter("vit", BUILTIN_PRIORITY)
def detect_vit(model: nn.Module, base: nn.Module) -> ModelLayout | None:
    blocks = getattr(base, "blocks", None)
    if not (hasattr(base, "patch_embed") and isinstance(blocks, nn.Sequential) and hasattr(base, "head")):
        return None
    vit_forward, _ = _timm_block_forwards()
    if not all(type(b).forward is vit_forward for b in blocks):
        if any(hasattr(b, "norm1") for b in blocks):
            raise UnsupportedModelError(
                f"{type(base).__name__}: a block does not run timm's pre-norm Block.forward "
                f"(e.g. ResPostBlock / ParallelBlock); only x + attn(norm1(x)), x + mlp(norm2(x)) is supported")
        return None
    bl, at, norms, acts = [], [], [], []
    for i, blk in enumerate(blocks):
        p = f"blocks.{i}"
        bl.append(site(blocks, str(i), "blocks"))
        at.append(site(blk, "attn", p))
        norms.append(_block_norm(blk, "norm1", p, _attn_inputs(blk.attn, f"{p}.attn")))
        fcs, act = _mlp_parts(blk.mlp, f"{p}.mlp")
        norms.append(_block_norm(blk, "norm2", p, fcs))
        if act is not None:
            acts.append(act)
    head = _head_linears(base, ("head", "head_dist"), "")
    final = None
    fc_norm = getattr(base, "fc_norm", None)
    if fc_norm is not None and norm_kind(fc_norm):
        final = site(base, "fc_norm", "", NormSite, kind=norm_kind(fc_norm), consumers=head)
        pooled_ok = True  # fc_norm runs after pooling: it feeds head_drop -> head directly
    elif norm_kind(getattr(base, "norm", nn.Identity())):
        final = site(base, "norm", "", NormSite, kind=norm_kind(base.norm), consumers=head)
        pooled_ok = (getattr(base, "attn_pool", None) is None
                     and getattr(base, "global_pool", "token") in ("token", "avg", ""))
    if final is not None:
        if not head:
            final.foldable, final.why = False, "no classifier head (num_classes=0): the features are the output"
        elif not pooled_ok:
            final.foldable, final.why = False, f"pooling {getattr(base, 'global_pool', '?')!r} is not linear"
    reads, lead = _vit_head_rows(base)
    return ModelLayout("vit", model, base, bl, at, norms, acts, final, head, attention_style="timm",
                       checkpoint_switch="timm" if hasattr(base, "set_grad_checkpointing") else None,
                       tokentune="vit", head_reads=reads, head_lead=lead)


def _vit_head_rows(base: nn.Module) -> tuple[str, int]:
    """(``head_reads``, ``head_lead``) of a timm ViT's ``forward_head``: the class-token pool reads row 0 (distilled
    DeiT rows 0 and 1); avg/max/avgmax and attention pools reduce the rows after the ``num_prefix_tokens`` class /
    register tokens (all rows with ``pool_include_prefix``); ``global_pool=''`` keeps every row."""
    pool = getattr(base, "global_pool", "token")
    if getattr(base, "attn_pool", None) is None and pool == "token":
        return "first", 2 if getattr(base, "dist_token", None) is not None else 1
    if getattr(base, "attn_pool", None) is None and pool == "":
        return "each", 0
    return "pool", 0 if getattr(base, "pool_include_prefix", False) else int(getattr(base, "num_prefix_tokens", 0))


@register_adapter("swin", BUILTIN_PRIORITY)
def detect_swin(model: nn.Module, base: nn.Module) -> ModelLayout | None:
    layers = getattr(base, "layers", None)
    if not (hasattr(base, "patch_embed") and isinstance(layers, nn.Sequential)
            and all(hasattr(s, "blocks") and hasattr(s, "downsample") for s in layers)):
        return None
    _, swin_forward = _timm_block_forwards()
    if not all(type(b).forward is swin_forward for s in layers for b in s.blocks):
        raise UnsupportedModelError(f"{type(base).__name__}: a stage block does not run timm's "
                                    f"SwinTransformerBlock.forward (Swin v2 post-norm blocks are not supported)")
    bl, at, norms, acts = [], [], [], []
    for si, stage in enumerate(layers):
        ds = stage.downsample
        if norm_kind(getattr(ds, "norm", nn.Identity())) and is_linear_like(getattr(ds, "reduction", nn.Identity())):
            p = f"layers.{si}.downsample"  # PatchMerging: pad (zeros, before the norm) -> norm -> reduction
            norms.append(_block_norm(ds, "norm", p, [site(ds, "reduction", p)]))
        for bi, blk in enumerate(stage.blocks):
            p = f"layers.{si}.blocks.{bi}"
            bl.append(site(stage.blocks, str(bi), f"layers.{si}.blocks"))
            at.append(site(blk, "attn", p))
            res, win = tuple(getattr(blk, "input_resolution", (0, 0))), tuple(getattr(blk, "window_size", (1, 1)))
            padded = any(r % w for r, w in zip(res, win))
            norms.append(_block_norm(blk, "norm1", p, _attn_inputs(blk.attn, f"{p}.attn"), foldable=not padded,
                                     why=f"resolution {res} is padded to windows {win} with zeros after norm1"
                                     if padded else ""))
            fcs, act = _mlp_parts(blk.mlp, f"{p}.mlp")
            norms.append(_block_norm(blk, "norm2", p, fcs))
            if act is not None:
                acts.append(act)
    head_mod = getattr(base, "head", None)
    head = []
    if isinstance(getattr(head_mod, "original_module", None), nn.Module):  # peft modules_to_save on the whole head
        head = _head_linears(head_mod.original_module, ("fc",), "head.original_module")
        for k, copy in getattr(head_mod, "modules_to_save", {}).items():
            head += _head_linears(copy, ("fc",), f"head.modules_to_save.{k}")
        head_mod = head_mod.original_module
    elif isinstance(head_mod, nn.Module):
        head = _head_linears(head_mod, ("fc",), "head")
    final = None
    if norm_kind(getattr(base, "norm", nn.Identity())):
        final = site(base, "norm", "", NormSite, kind=norm_kind(base.norm), consumers=head)
        pool = getattr(getattr(head_mod, "global_pool", None), "pool_type", getattr(base, "global_pool", "avg"))
        if not head:
            final.foldable, final.why = False, "no classifier head (num_classes=0): the features are the output"
        elif pool not in ("avg", "fast", ""):
            final.foldable, final.why = False, f"pooling {pool!r} is not linear"
    return ModelLayout("swin", model, base, bl, at, norms, acts, final, head, attention_style=None,
                       checkpoint_switch=None, tokentune=None,
                       tokentune_why="Swin's shifted-window attention has no TokenTune training forward (tokens "
                       "are grouped into windows; selecting rows across windows is not implemented)")

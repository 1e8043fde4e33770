"""What the conversions record so that :func:`lowmembp.methods.export.export` can undo them exactly.

:func:`record_fold`, :func:`record_act` / :func:`record_swap` and :func:`record_attention` are called by the
conversions (``lowmembp``, ``mesa``) before they change a site; they keep what cannot be read back from the live
model (the original module, paths, which consumers had a bias, tied weights, the attention implementation) in
``base.__dict__["_lowmembp_export"]`` (:data:`RECORD`) — not a parameter, not in the state dict; ``copy.deepcopy``
and ``torch.save`` keep it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

__all__ = ["RECORD", "ExportRecord", "record_fold", "record_act", "record_swap", "record_attention"]

RECORD = "_lowmembp_export"


@dataclass
class NormFold:
    path: str                      # where the norm sat (dotted, from the base model)
    original: nn.Module            # the original norm module, out of the model
    gamma: torch.Tensor | None     # the effective (γ, β) that were folded (Gemma-like 1 + w included)
    beta: torch.Tensor | None
    consumers: list[str]           # modules γ/β were folded into
    stock_bias: dict[str, bool]    # consumer path -> its linear (peft: base layer) had a bias before folding
    residuals: list[str]           # post-norm: modules that got a ResidualAffine


@dataclass
class ActSwap:
    """A module replaced whole (an activation by ReGELU2 / ReSiLU2, a norm or activation by a Mesa layer)."""
    path: str
    original: nn.Module


@dataclass
class AttentionPatch:
    """An attention module Mesa switched to its eager path with its own matmul / softmax layers."""
    path: str
    fused_attn: object        # timm Attention.fused_attn before (None: no such attribute)
    attn_implementation: object  # transformers config._attn_implementation before (None: no config)


@dataclass
class Untie:
    path: str      # module whose weight folding gave its own copy (lm_head)
    tied_to: str   # a module that held the same parameter (embed_tokens)


@dataclass
class ExportRecord:
    folds: list[NormFold] = field(default_factory=list)
    acts: list[ActSwap] = field(default_factory=list)
    unties: list[Untie] = field(default_factory=list)
    attentions: list[AttentionPatch] = field(default_factory=list)
    tie_config: dict[str, bool] = field(default_factory=dict)  # "" / "text" -> tie_word_embeddings before folding


def _record(base: nn.Module) -> ExportRecord:
    rec = base.__dict__.get(RECORD)
    if rec is None:
        rec = ExportRecord()
        object.__setattr__(base, RECORD, rec)
    return rec


def _paths(base: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in base.named_modules(remove_duplicate=False)}


def _linear_of(m: nn.Module) -> nn.Module:
    """The plain linear inside a peft wrapper (LoRA ``base_layer``, ``ModulesToSaveWrapper.original_module``)."""
    for _ in range(4):
        inner = m._modules.get("base_layer") or m._modules.get("original_module")
        if not isinstance(inner, nn.Module):
            return m
        m = inner
    return m


def _text_config(cfg):
    try:
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
    except Exception:  # pragma: no cover - exotic configs
        return None


def record_fold(base: nn.Module, norm: nn.Module, gamma, beta, consumers, residuals=()) -> None:
    """Note, before folding, that ``norm`` (γ, β) is about to be folded into ``consumers`` (modules) and re-applied on
    the residual path of ``residuals`` (modules), so that :func:`lowmembp.methods.export.export` can undo it."""
    where = _paths(base)
    rec = _record(base)
    cons = [where.get(id(c), "?") for c in consumers]
    owners: dict[int, list[str]] = {}
    for name, m in base.named_modules(remove_duplicate=False):
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if w is not None:
            owners.setdefault(id(w), []).append(name)
    for c, path in zip(consumers, cons):
        lin = _linear_of(c)
        lin_path = where.get(id(lin), path)
        others = [p for p in owners.get(id(getattr(lin, "weight", None)), []) if p != lin_path]
        if others:
            rec.unties.append(Untie(lin_path, others[0]))
    if rec.unties and not rec.tie_config:
        cfg = getattr(base, "config", None)
        for key, c in (("", cfg), ("text", _text_config(cfg) if cfg is not None else None)):
            if c is not None and hasattr(c, "tie_word_embeddings"):
                rec.tie_config[key] = bool(c.tie_word_embeddings)
    rec.folds.append(NormFold(
        path=where.get(id(norm), "?"), original=norm,
        gamma=None if gamma is None else gamma.detach(), beta=None if beta is None else beta.detach(),
        consumers=cons,
        stock_bias={p: getattr(_linear_of(c), "bias", None) is not None for c, p in zip(consumers, cons)},
        residuals=[where.get(id(r), "?") for r in residuals]))


def record_act(base: nn.Module, original: nn.Module) -> None:
    """Note, before replacing it, the module ``original`` (an activation: ReGELU2 / ReSiLU2 take its place; a norm
    or activation a Mesa layer replaces). :func:`lowmembp.methods.export.export` puts it back, with the live parameters
    of
    its replacement."""
    _record(base).acts.append(ActSwap(_paths(base).get(id(original), "?"), original))


record_swap = record_act


def record_attention(base: nn.Module, attn: nn.Module) -> None:
    """Note, before Mesa patches it, how ``attn`` computes attention (timm ``fused_attn``, the transformers config's
    ``_attn_implementation``)."""
    cfg = getattr(attn, "config", None)
    _record(base).attentions.append(AttentionPatch(_paths(base).get(id(attn), "?"), getattr(attn, "fused_attn", None),
                                                   getattr(cfg, "_attn_implementation", None)))

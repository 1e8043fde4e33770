"""Gradient fidelity: how far a method's gradient is from exact backprop's, tensor by tensor and block by block.

    ref = gradients_of(model, loss_fn, batch)                 # {parameter name: gradient (fp32)}
    got = gradients_of(converted, loss_fn, batch)
    rows = gradient_fidelity(ref, got)                        # one row per parameter tensor both trained
    by_depth = summarize_fidelity(rows, depth_labels(list(ref)))   # one row per depth: embed, 0, 1, ..., head

A method that approximates the backward (an activation's derivative, 8-bit saved tensors, a subset of the tokens)
trains on another gradient; comparing it tensor by tensor and depth by depth shows where it departs, one step at a
time, before a training run shows an accuracy gap. Per tensor, with ``g`` the reference gradient and ``m`` the
method's (float64): ``cosine`` = ⟨m, g⟩ / (‖m‖·‖g‖) and ``rel_error`` = ‖m − g‖ / ‖g‖ (0 for an exact method). A
summary treats a group's tensors as one concatenated vector; names are compared without what wrappers add
(:func:`canonical_name`). Pure torch: rows are dicts. Edge cases, the depth rules and the measured figures of the
``grad-fidelity`` reproduction: docs/evidence/gradient-fidelity.md.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

__all__ = ["gradients_of", "gradient_fidelity", "summarize_fidelity", "depth_labels", "canonical_name",
           "block_index", "EMBED", "HEAD"]

EMBED, HEAD = "embed", "head"
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_BLOCK = re.compile(r"(?:^|\.)(?:layer|layers|blocks|h)\.(\d+)\.")


def canonical_name(name: str) -> str:
    """``name`` without the parts wrappers insert (``_orig_mod.``, ``_checkpoint_wrapped_module.``, ...)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def block_index(name: str) -> int | None:
    """The transformer block a parameter belongs to (``...layer.3.attention...`` -> 3), or None outside blocks."""
    found = _BLOCK.search(name)
    return int(found.group(1)) if found else None


def depth_labels(names: Iterable[str]) -> dict[str, str]:
    """``{name: depth}`` in the order given (a model's ``named_parameters`` order): the block index as text for a
    block's parameters, :data:`EMBED` before the first block, :data:`HEAD` after it (final norm, pooler, head)."""
    names = list(names)
    out: dict[str, str] = {}
    seen_block = False
    for name in names:
        idx = block_index(name)
        if idx is not None:
            seen_block = True
            out[name] = str(idx)
        else:
            out[name] = HEAD if seen_block else EMBED
    return out


def gradients_of(model: nn.Module, loss_fn: Callable[[nn.Module, dict], torch.Tensor], batch: dict, *,
                 autocast_dtype: torch.dtype | None = None, seed: int | None = 0) -> dict[str, torch.Tensor]:
    """One forward and backward of ``loss_fn(model, batch)`` in training mode; ``{canonical name: gradient}`` (fp32
    copies, on the CPU) of every parameter that received one. ``autocast_dtype``: run the forward under autocast
    (e.g. ``torch.bfloat16``) on the model's device. ``seed``: ``torch.manual_seed`` just before the forward, so a
    method's random draws (Mesa's stochastic rounding, TokenTune's token choice) are the same on every call (None:
    leave the generator alone). Gradients already on the model are cleared first and after."""
    model.train()
    model.zero_grad(set_to_none=True)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if seed is not None:
        torch.manual_seed(seed)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        loss = loss_fn(model, batch)
    loss.backward()
    grads = {canonical_name(n): p.grad.detach().float().cpu().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def _measures(dot: float, ref_sq: float, got_sq: float, diff_sq: float) -> dict:
    if ref_sq > 0 and got_sq > 0:
        cosine = max(-1.0, min(1.0, dot / math.sqrt(ref_sq * got_sq)))
    else:
        cosine = 1.0 if ref_sq == got_sq == 0 else math.nan
    return {"cosine": cosine, "rel_error": math.sqrt(_ratio(diff_sq, ref_sq))}


def gradient_fidelity(reference: Mapping[str, torch.Tensor], method: Mapping[str, torch.Tensor], *,
                      names: Iterable[str] | None = None) -> list[dict]:
    """One row per parameter tensor: ``name``, ``numel``, ``cosine``, ``rel_error``, ``ref_norm``, ``got_norm`` and
    the sums the summaries combine (``dot``, ``ref_sq``, ``got_sq``, ``diff_sq``; float64). ``names``: the tensors to
    compare (default: those with a gradient in both, in the reference's order). A name in ``names`` missing from
    either side, or two gradients of different shapes, is a KeyError / ValueError: the two runs did not train the
    same parameters."""
    if names is None:
        names = [n for n in reference if n in method]
    rows = []
    for name in names:
        if name not in reference or name not in method:
            side = "reference" if name not in reference else "method"
            raise KeyError(f"gradient_fidelity: {name!r} has no gradient in the {side}")
        g, m = reference[name], method[name]
        if g.shape != m.shape:
            raise ValueError(f"gradient_fidelity: {name!r} has shape {tuple(m.shape)} in the method and "
                             f"{tuple(g.shape)} in the reference")
        g64, m64 = g.detach().double().flatten(), m.detach().double().flatten()
        sums = {"dot": float(m64 @ g64), "ref_sq": float(g64 @ g64), "got_sq": float(m64 @ m64),
                "diff_sq": float(((m64 - g64) ** 2).sum())}
        rows.append({"name": name, "numel": g64.numel(), **_measures(**sums),
                     "ref_norm": math.sqrt(sums["ref_sq"]), "got_norm": math.sqrt(sums["got_sq"]), **sums})
    return rows


def summarize_fidelity(rows: Iterable[dict], groups: Mapping[str, str] | Callable[[str], str] | None = None
                       ) -> list[dict]:
    """Rows of :func:`gradient_fidelity` combined per group (``groups``: name -> group, a mapping such as
    :func:`depth_labels`' or a function; None: one group ``"all"``), each group's tensors taken as one vector: one
    row per group in order of first appearance with ``group``, ``tensors``, ``numel``, ``cosine``, ``rel_error``,
    ``ref_norm`` and the sums."""
    key = (lambda n: "all") if groups is None else (groups.__getitem__ if isinstance(groups, Mapping) else groups)
    acc: dict[str, dict] = {}
    for r in rows:
        a = acc.setdefault(key(r["name"]), {"tensors": 0, "numel": 0, "dot": 0.0, "ref_sq": 0.0, "got_sq": 0.0,
                                            "diff_sq": 0.0})
        a["tensors"] += 1
        a["numel"] += r["numel"]
        for s in ("dot", "ref_sq", "got_sq", "diff_sq"):
            a[s] += r[s]
    out = []
    for group, a in acc.items():
        sums = {s: a[s] for s in ("dot", "ref_sq", "got_sq", "diff_sq")}
        out.append({"group": group, "tensors": a["tensors"], "numel": a["numel"], **_measures(**sums),
                    "ref_norm": math.sqrt(a["ref_sq"]), **sums})
    return out

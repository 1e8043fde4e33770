"""``tokentune``: selective-token fine-tuning (Simoulin et al., ES-FoMo @ ICML 2023; EMNLP 2024, arXiv 2501.18824).

    model = lowmembp.apply(model, "tokentune", k=16)            # or "lora+tokentune", "lowmembp+tokentune", ...
    model.train(); out = model(**batch)                          # HF: out.logits / out.loss as usual
    tokentune_state(model).last.positions                        # the positions chosen for that batch (B×k)

The method: per sequence k distinct real positions, the same in every block (:class:`TokenTuneState`: the rows the
model's head reads, the first real token, for decoders the last, the rest at random; ``k`` a count or a fraction of
the real tokens), and in training an exact forward that runs the selected rows with the graph and the others without
(the block driver, :mod:`lowmembp.methods.tokentune_forward`). What a family adds — its block computation, embedding
and head, which models it runs — sits with the model adapters (:mod:`lowmembp.models.tokentune_families`: timm ViT,
BERT/RoBERTa sequence classification, LLaMA-like), chosen by the layout's ``tokentune``. ``model.eval()`` runs the
ordinary forward. Composes with ``lora`` (order 10), ``lowmembp*`` (20) and ``checkpointing`` (50, applied after: only
the selected part of each marked block is recomputed). The full rules: docs/methods/tokentune.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from lowmembp.methods.checkpointing import is_checkpointed
from lowmembp.methods.registry import register
from lowmembp.methods.tokentune_forward import make_context, run_blocks
from lowmembp.models.rows import take
from lowmembp.models.tokentune_families import DRIVERS


@dataclass
class Selection:
    """The positions of one training forward: ``positions`` B×k (ascending), ``valid`` B×k (False: a padding
    position used only to fill up a short sequence), ``others`` B×(L−k) (the unselected positions, ascending)."""
    positions: torch.Tensor
    valid: torch.Tensor
    others: torch.Tensor


@dataclass
class TokenTuneState:
    """Per-model TokenTune settings; find it with :func:`tokentune_state`."""
    k: int | float  # a count, or a fraction 0 < k < 1 of the real tokens (see count)
    family: str
    task: str  # "classification" | "causal_lm"
    seed: int | None = None
    pool: str = "model"  # "model": the head reads what the model's own head reads, of the selected rows; "mean"
    reads: str | None = None  # the layout's head_reads: "first" | "last" | "pool" | "each"
    lead: int = 0  # the layout's head_lead: leading rows the (timm) head reads or sets apart by position
    selector: Callable | None = None
    last: Selection | None = None
    blocks: list = field(default_factory=list)  # the original block modules
    sites: list = field(default_factory=list)  # their layout Sites (to see wrappers added later, e.g. checkpointing)
    owner: nn.Module | None = None  # the timm model / HF backbone whose flags say "gradient checkpointing"
    _generators: dict = field(default_factory=dict)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(int(self.seed))
        return self._generators[key]

    def count(self, valid: torch.Tensor, decoder: bool, forced: torch.Tensor | None = None) -> int:
        """Tokens per sequence of this batch: ``k`` itself, or for a fraction ``k`` the forced tokens plus
        ``int(k · (n − forced))`` of the rest (``n``: real tokens of the longest row)."""
        if isinstance(self.k, int):
            return self.k
        n = int(valid.sum(1).max()) if valid.numel() else 0
        n_forced = int(_forced_mask(valid, decoder, forced).sum(1).max()) if valid.numel() else 0
        forced = min(n, n_forced)
        return max(self.min_count(), forced + int(self.k * (n - forced)))

    def min_count(self) -> int:
        """The fewest tokens the head can work with: its leading rows (timm: class / register tokens), and a pool
        that sets them apart one more row to pool (``pool='mean'``: 1)."""
        if self.pool != "model":
            return 1
        return max(1, self.lead + (1 if self.reads == "pool" and self.lead else 0))

    def select(self, valid: torch.Tensor, decoder: bool, forced: torch.Tensor | None = None) -> Selection:
        """Choose this batch's positions; ``forced`` (B×m): positions that must be selected, before any other (the
        rows the model's head reads)."""
        gen = self.generator(valid.device)
        k = self.count(valid, decoder, forced)
        if self.selector is not None:
            positions = _check_positions(self.selector(valid, k, decoder, gen), valid, k, forced)
        else:
            positions = select_positions(valid, k, decoder=decoder, generator=gen, forced=forced)
        L = valid.shape[1]
        chosen = torch.zeros_like(valid).scatter_(1, positions, True)
        order = torch.sort(chosen.to(torch.uint8), dim=1, stable=True).indices  # unselected first, both ascending
        kk = positions.shape[1]
        sel = Selection(positions=order[:, L - kk:], valid=valid.gather(1, order[:, L - kk:]),
                        others=order[:, :L - kk])
        self.last = sel
        return sel

    def run_blocks(self, h: torch.Tensor, sel: Selection, key_valid: torch.Tensor | None,
                   extra: dict | None = None) -> torch.Tensor:
        """Every block over ``h`` (B×L×d, a graph on the selected rows only), by this model's family hooks;
        ``key_valid``: B×L real tokens (None: all), ``extra``: the family's data over all positions."""
        fam = DRIVERS[self.family]
        ctx = make_context(fam, sel, h.shape[1], key_valid, extra)
        return run_blocks(fam, self.blocks, h, ctx, self.checkpoint_flags())

    def head_feature(self, hs: torch.Tensor, sel: Selection, read: torch.Tensor | None) -> torch.Tensor:
        """B×d, what a head reads from the selected rows ``hs`` (B×k×d, positions ``sel.positions``): the row at
        the model's own read position ``read`` (selected: forced), or under ``pool='mean'`` the mean of the valid
        rows."""
        if self.pool == "mean":
            return _masked_mean(hs, sel.valid)
        j = (sel.positions == read[:, None]).to(torch.uint8).argmax(1)
        return take(hs, j[:, None])[:, 0]

    def checkpoint_flags(self) -> list[bool]:
        """Per block: checkpoint its selected part? (the ``checkpointing`` method's per-block mark, timm's
        ``grad_checkpointing``, transformers' per-layer ``gradient_checkpointing``, or a wrapper put in its place)."""
        flag = bool(getattr(self.owner, "grad_checkpointing", False))
        return [flag or site.get() is not blk or is_checkpointed(blk)
                or bool(getattr(blk, "gradient_checkpointing", False))
                for site, blk in zip(self.sites, self.blocks)]


def select_positions(valid: torch.Tensor, k: int, *, decoder: bool = False,
                     generator: torch.Generator | None = None, forced: torch.Tensor | None = None) -> torch.Tensor:
    """k distinct positions per row of ``valid`` (B×L bool, True = real token): the ``forced`` ones (B×m, in that
    order of priority: the rows the model's head reads), the first real token, for decoders the last real one too,
    the rest uniformly at random among real tokens; padding only when a row has < k real tokens. Returns
    B×min(k, L) positions (not sorted)."""
    B, L = valid.shape
    kk = min(int(k), L)
    scores = torch.rand(B, L, generator=generator, device=valid.device)
    scores = scores.masked_fill(~valid, -1.0)
    rows = torch.arange(B, device=valid.device)
    scores[rows, _first_real(valid)] = 3.0  # the first real token (position 0 if none is real)
    if decoder and kk >= 2:
        scores[rows, _last_real(valid)] = 2.0  # the last real token
    if forced is not None and forced.shape[1]:
        m = forced.shape[1]
        prio = 4.0 + torch.arange(m, 0, -1, device=valid.device, dtype=scores.dtype)  # column 0 first
        scores.scatter_(1, forced.to(valid.device), prio.expand(B, m))
    return scores.topk(kk, dim=1).indices


def _first_real(valid: torch.Tensor) -> torch.Tensor:
    return valid.to(torch.uint8).argmax(1)


def _last_real(valid: torch.Tensor) -> torch.Tensor:
    return valid.shape[1] - 1 - valid.flip(1).to(torch.uint8).argmax(1)


def _forced_mask(valid: torch.Tensor, decoder: bool, forced: torch.Tensor | None) -> torch.Tensor:
    """B×L: the positions every selection takes first (``forced``, the first real token, decoders: the last)."""
    rows = torch.arange(valid.shape[0], device=valid.device)
    must = torch.zeros_like(valid, dtype=torch.bool)
    must[rows, _first_real(valid)] = True
    if decoder:
        must[rows, _last_real(valid)] = True
    if forced is not None and forced.shape[1]:
        must.scatter_(1, forced.to(valid.device), True)
    return must


def _check_positions(pos, valid, k, forced=None) -> torch.Tensor:
    B, L = valid.shape
    kk = min(k, L)
    if not isinstance(pos, torch.Tensor) or pos.shape != (B, kk) or pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokentune selector must return an integer tensor of shape {(B, kk)}, got "
                         f"{getattr(pos, 'shape', type(pos))}")
    pos = pos.to(device=valid.device, dtype=torch.long)
    if bool(((pos < 0) | (pos >= L)).any()) or bool((pos.sort(1).values.diff(dim=1) == 0).any()):
        raise ValueError("tokentune selector must return distinct positions in [0, L) per row")
    if forced is not None and forced.shape[1]:
        chosen = torch.zeros_like(valid, dtype=torch.bool).scatter_(1, pos, True)
        if not bool(chosen.gather(1, forced.to(valid.device)).all()):
            raise ValueError(f"tokentune selector must include the positions the model's head reads "
                             f"({forced.tolist()} per row); or convert with pool='mean'")
    return pos


def tokentune_state(model: nn.Module) -> TokenTuneState:
    """The :class:`TokenTuneState` of a converted model (peft wrappers looked through)."""
    from lowmembp.models.layout import unwrap_peft
    base = unwrap_peft(model)
    for m in (base, getattr(base, "base_model", None)):
        st = getattr(m, "_tokentune", None) if m is not None else None
        if st is not None:
            return st
    raise ValueError("this model was not converted with tokentune (use lowmembp.apply(model, 'tokentune', k=...))")


# ------------------------------------------------------------------------------------------------------ conversion
POOLS = ("model", "mean")


def checked_options(k: int | float = 16, seed: int | None = None,
                    pool: str = "model") -> tuple[int | float, int | None, str]:
    """``k`` (an integer-valued float such as 16.0 becomes the count 16), ``seed`` and ``pool``, or ValueError."""
    if isinstance(k, float) and k.is_integer() and k >= 1:
        k = int(k)
    if isinstance(k, bool) or not (isinstance(k, int) and k >= 1 or isinstance(k, float) and 0 < k < 1):
        raise ValueError(f"tokentune: k must be an integer >= 1 (tokens per sequence that get gradients) or a "
                         f"fraction 0 < k < 1 of the real tokens (e.g. 0.3), got {k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"tokentune: seed must be None (global RNG) or an int, got {seed!r}")
    if pool not in POOLS:
        raise ValueError(f"tokentune: pool must be 'model' (the head reads what the model's own head reads, of the "
                         f"selected tokens) or 'mean' (the mean of the selected tokens), got {pool!r}")
    return k, seed, pool


@register("tokentune", "selective-token fine-tuning: gradients through k tokens per sequence (TokenTune)",
          options={"k": 16, "seed": None, "pool": "model"}, order=40, kinds={"k": (int, float)},
          check=checked_options)
def apply_tokentune(model: nn.Module, k: int | float = 16, seed: int | None = None, pool: str = "model") -> nn.Module:
    k, seed, pool = checked_options(k, seed, pool)
    from lowmembp.models import get_layout
    layout = get_layout(model)
    driver = layout.tokentune
    if driver not in DRIVERS:
        covered = ", ".join(f.label for f in DRIVERS.values())
        raise TypeError(f"tokentune supports the families {', '.join(DRIVERS)} ({covered}); it cannot run "
                        f"{type(layout.base).__name__}: "
                        f"{layout.tokentune_why or 'its adapter names no TokenTune driver'}")
    base, fam = layout.base, DRIVERS[driver]
    blocks = [s.get() for s in layout.blocks]
    for b in blocks:
        fam.check_block(b)
    if getattr(base, "_tokentune", None) is not None:
        raise RuntimeError("tokentune was already applied to this model")
    state = TokenTuneState(k=k, family=driver, task="classification", seed=seed, pool=pool,
                           reads=layout.head_reads, lead=layout.head_lead, blocks=blocks, sites=list(layout.blocks))
    if isinstance(k, int) and k < state.min_count():
        raise ValueError(f"tokentune: k={k} is less than the {state.min_count()} tokens the head of "
                         f"{type(base).__name__} needs: its {state.lead} leading class / register tokens (read or "
                         f"set apart by position){' and one token to pool' if state.reads == 'pool' else ''}; use "
                         f"k >= {state.min_count()}, or pool='mean'")
    entry = fam.entry_point(base, pool)
    state.owner, state.task = entry.owner, entry.task
    _patch(entry.module, entry.attr, entry.forward, state)
    object.__setattr__(base, "_tokentune", state)
    return model


def _patch(module: nn.Module, attr: str, fn, state: TokenTuneState) -> None:
    """Install the training forward as an instance-level ``module.<attr>``; eval mode calls the original.

    Nothing is captured in closures: the state, the training function and any earlier instance-level override live
    in the module's ``__dict__``, so ``copy.deepcopy`` of a converted model yields a model that runs on its own
    blocks and parameters.
    """
    d = module.__dict__
    d["_tokentune"] = state
    d["_tokentune_attr"] = attr
    d["_tokentune_fn"] = fn
    d["_tokentune_original"] = d.get(attr)  # an instance-level override another method installed, if any
    d[attr] = _Entry(module)


class _Entry:
    """The instance-level forward: a picklable callable (``torch.save(model)`` works; a bound method would not)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return _entry(self.module, *args, **kwargs)

    @property
    def __signature__(self):  # what inspect.signature (the HF Trainer) reads: the replaced forward's parameters
        from lowmembp.methods._signature import original_signature
        d = self.module.__dict__
        return original_signature(self.module, d["_tokentune_attr"], d["_tokentune_original"])


def _entry(self, *args, **kwargs):
    d = self.__dict__
    if not self.training:
        original = d["_tokentune_original"]
        if original is not None:
            return original(*args, **kwargs)
        return getattr(type(self), d["_tokentune_attr"])(self, *args, **kwargs)
    return d["_tokentune_fn"](self, d["_tokentune"], *args, **kwargs)


def _masked_mean(hs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over the valid selected rows (branch-free: runs on fake tensors too)."""
    w = valid.to(hs.dtype).unsqueeze(-1)
    return (hs * w).sum(1) / w.sum(1).clamp_min(1)

"""Saved-for-backward accounting: how many bytes the autograd graph keeps, by op kind.

    with SavedTensorAccountant(model) as acc:
        loss = model(x).sum()          # the forward (backward may follow inside or outside the block)
    acc.report()   # {"total": 123, "by_kind": {"act": .., "norm": .., "attention": .., "linear": .., "product": ..,
                   #   "other": ..}, "param_casts": .., "n_storages": ..}

Activation memory is what the methods trade against speed and exactness, and a step's peak mixes it with weights,
gradients and optimizer state: this counts it alone. Every tensor autograd saves passes through
``saved_tensors_hooks``; each storage counts once, at its full size, under the op kind of the module running when it
is saved (:mod:`lowmembp.measurement.kinds`). Parameters, buffers and autocast's copies of weights (``param_casts``)
are left out; tensors held outside autograd are not seen (the peak, :mod:`lowmembp.measurement.peak`, sees them).
Real and fake tensors are counted alike. The rules in full, checkpointing included: docs/measuring.md#saved-bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from lowmembp.measurement.kinds import KINDS, classify, rank

__all__ = ["SavedTensorAccountant", "KINDS", "saved_bytes"]


@dataclass
class SavedStorage:
    """One storage kept for backward."""
    nbytes: int
    kind: str
    module: str          # qualified name of the innermost module running when it was first saved
    shape: tuple
    dtype: torch.dtype
    ref: StorageWeakRef


class SavedTensorAccountant:
    """Context manager counting the bytes autograd saves for backward inside it, by op kind
    (docs/measuring.md#saved-bytes).

    ``model`` gives the module hooks and the parameters to exclude; pass ``None`` to count everything as ``other``
    (no module attribution) with nothing excluded. Re-entering starts a fresh count.
    """

    def __init__(self, model: nn.Module | None):
        self.model = model
        self.storages: list[SavedStorage] = []
        self.param_cast_bytes = 0
        self._index: dict[int, int] = {}
        self._handles: list = []
        self._stack: list[nn.Module] = []
        self._names: dict[int, str] = {}
        self._kind_cache: dict[int, str | None] = {}
        self._excluded: dict[int, StorageWeakRef] = {}  # storage key -> the parameter's / buffer's storage
        self._cast_seen: dict[int, StorageWeakRef] = {}  # storage key -> the cast's storage (while it lives)
        self._hooks_ctx = None

    # -- context --------------------------------------------------------------------------------------------
    def __enter__(self) -> "SavedTensorAccountant":
        self.storages, self._index, self.param_cast_bytes, self._cast_seen = [], {}, 0, {}
        self._stack, self._excluded = [], {}
        if self.model is not None:
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                key = _storage_key(t)
                if key is not None:
                    self._excluded[key] = StorageWeakRef(t.untyped_storage())
            for name, module in self.model.named_modules():
                self._names[id(module)] = name or type(module).__name__
                self._handles.append(module.register_forward_pre_hook(self._push))
                self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks_ctx.__exit__(*exc)
        self._hooks_ctx = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    # -- hooks ----------------------------------------------------------------------------------------------
    def _push(self, module, args):
        self._stack.append(module)

    def _pop(self, module, args, output):
        # pop up to and including this module (robust to a child that raised before its post hook)
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i] is module:
                del self._stack[i:]
                break

    def _pack(self, t):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            self._record(t)
        return t

    def _record(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None:
            return
        param = self._excluded.get(key)
        if param is not None and not param.expired():  # a dead parameter's address (a weight replaced in the
            return                                       # forward) taken by a new storage is counted
        st = t.untyped_storage()
        nbytes = int(st.nbytes())
        if nbytes == 0:
            return
        if self._is_param_cast(t):
            seen = self._cast_seen.get(key)
            if seen is None or seen.expired():  # a dead cast's address taken by a new one counts again
                self._cast_seen[key] = StorageWeakRef(st)
                self.param_cast_bytes += nbytes
            return
        kind = classify(self._stack, self._kind_cache) if self.model is not None else "other"
        i = self._index.get(key)
        if i is not None and not self.storages[i].ref.expired():
            entry = self.storages[i]
            if rank(kind) < rank(entry.kind):
                entry.kind = kind
            return
        module = self._names.get(id(self._stack[-1]), "?") if self._stack else ""
        self._index[key] = len(self.storages)
        self.storages.append(SavedStorage(nbytes, kind, module, tuple(t.shape), t.dtype, StorageWeakRef(st)))

    def _is_param_cast(self, t: torch.Tensor) -> bool:
        if not self._stack:
            return False
        shape = sorted(t.shape)
        for p in self._stack[-1].parameters(recurse=False):
            if t.dim() >= 2 and sorted(p.shape) == shape:  # the cast copy, possibly transposed (linear's mat2)
                return True
        return False

    # -- results --------------------------------------------------------------------------------------------
    def report(self) -> dict:
        """``{"total", "by_kind" (every kind, zeros included), "param_casts", "n_storages"}``, bytes as ints."""
        by_kind = dict.fromkeys(KINDS, 0)
        for s in self.storages:
            by_kind[s.kind] += s.nbytes
        return {"total": sum(by_kind.values()), "by_kind": by_kind, "param_casts": self.param_cast_bytes,
                "n_storages": len(self.storages)}

    def table(self) -> list[dict]:
        """One row per saved storage (module, kind, shape, dtype, bytes), in the order first saved."""
        return [{"module": s.module, "kind": s.kind, "shape": s.shape, "dtype": str(s.dtype).replace("torch.", ""),
                 "bytes": s.nbytes} for s in self.storages]


def saved_bytes(model: nn.Module, fn, *args, **kwargs) -> dict:
    """Run ``fn(*args, **kwargs)`` (a forward) under a :class:`SavedTensorAccountant` and return its report."""
    with SavedTensorAccountant(model) as acc:
        out = fn(*args, **kwargs)
    del out
    return acc.report()


def _unpack(t):
    return t


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage, or None for a tensor without one (torch's ``NotImplementedError`` "Cannot
    access storage of ...": sparse, MKL-DNN, functorch's batched / grad wrappers); other exceptions propagate."""
    try:
        return StorageWeakRef(t.untyped_storage()).cdata
    except NotImplementedError:
        return None

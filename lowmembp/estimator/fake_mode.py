"""The fake mode the estimates step in: torch's ``FakeTensorMode``, its cache hits served in one short path.

    from lowmembp.estimator.fake_mode import StepFakeMode
    with StepFakeMode(allow_non_fake_inputs=True):   # what FakeTensorMode(...) does, the same outputs
        ...

Why: a fake training step is nearly all ``FakeTensorMode`` bookkeeping. :class:`StepFakeMode` keys torch's cache in
one pass over each argument, builds the outputs of a cache hit from a recipe (:data:`RECIPES`) past torch's layers of
dispatch, gives recipes to two kinds of calls torch never caches (``aten._unsafe_view``, this library's functional
``lowmembp::*`` ops) and answers ``prim.device`` at once; none of this changes what an op returns. It rests on torch's
private internals (:func:`lowmembp._compat.fast_fake_internals`): where they differ from what it expects, or with
``LOWMEMBP_FAST_FAKE=0``, it is torch's ``FakeTensorMode`` unchanged, the same estimates to the byte, slower. The
design: docs/architecture.md, "The fake mode's fast path".
"""
from __future__ import annotations

import torch
from lowmembp._compat import FakeTensor, FakeTensorMode, fast_fake_enabled, fast_fake_internals, storage_key, \
    tree_leaves
from lowmembp.measurement.peak import DEVICE_QUERY

__all__ = ["StepFakeMode", "KEY_MARK", "DEVICE_QUERY", "answer_device", "RECIPES"]

_I = fast_fake_internals()  # torch's private pieces the fast path uses, None where they are not as expected
# FakeTensorMode.dispatch's own answer to prim.device (None without the fast path)
answer_device = _I.answer_device if _I is not None else None

KEY_MARK = object()      # first item of the args part of a key in this form
_FAKE = object()         # tag of a fake tensor's tuple (no plain value can equal it)
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_SEQUENCES = frozenset({tuple, list, torch.Size})
_STRIDED = torch.strided
_LAYOUT = torch.Tensor.layout.__get__  # the tensor's own layout, past FakeTensor's Python property
_UNSAFE_VIEW = _I.UNSAFE_VIEW if _I is not None else None

# How a recipe makes one output (see _output): an argument returned as it is (in-place ops), a constant, or a new
# fake tensor from its metadata (on the storage of argument ``view_idx`` when that is not None)
_INPLACE, _CONSTANT, _TENSOR = 0, 1, 2

RECIPES: dict = {}  # this mode's key -> (is a tuple, (output recipe, ...)); shared by every StepFakeMode, as
#                     torch shares its cache (FakeTensorMode.cache) between its modes
_NO_RECIPE = object()  # a key learnt to have none: torch's cache bypasses it, or its first output fit no recipe


class _TorchKey(Exception):
    """An argument this key form does not cover: torch's key code takes the whole call."""


class StepFakeMode(FakeTensorMode):
    """``FakeTensorMode`` with the one-pass cache key, cache hits served from :data:`RECIPES` and ``prim.device``
    answered directly (docs/architecture.md); everything else is torch's. ``fast=False`` (or
    ``LOWMEMBP_FAST_FAKE=0``, or torch internals other than those expected): torch's ``FakeTensorMode`` unchanged."""

    def __init__(self, *args, fast: bool | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._attrs = None  # what FakeTensor.__new__ puts in a new fake tensor's __dict__ (from the first one made)
        self.fast = fast_fake_enabled() if fast is None else bool(fast) and _I is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.dispatch_op(func, types, args, kwargs)

    def dispatch_op(self, func, types, args=(), kwargs=None):
        """What ``__torch_dispatch__`` does, callable from a subclass's own ``__torch_dispatch__`` without going
        through this one's ``_disable_dynamo`` wrapper again (torch wraps every mode's ``__torch_dispatch__``)."""
        if not self.fast:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is DEVICE_QUERY:
            return answer_device(args)
        key = self._recipe_key(func, args, kwargs)
        if key is not None:
            recipe = RECIPES.get(key)
            if recipe is not None and recipe is not _NO_RECIPE:
                return self._from_recipe(recipe, args)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if key is not None and recipe is None:
            RECIPES[key] = self._recipe(func, args, kwargs or {}, out)
        return out

    # -- recipes ---------------------------------------------------------------------------------------------
    def _recipe_key(self, func, args, kwargs):
        """This mode's key for ``func(*args, **kwargs)``, or None where recipes are not used (docs/architecture.md)."""
        if (self.shape_env is not None or not self.cache_enabled or self.cache_crosscheck_enabled
                or _I.FakeTensorConfig.debug or _I.get_dispatch_mode(_I.PROXY) is not None
                or _I.get_dispatch_mode_pre_dispatch(_I.PROXY) is not None):
            return None
        try:
            return (func, self._encode(args), self._encode(kwargs) if kwargs else None, torch.get_default_dtype(),
                    _I.get_default_device(), torch.is_inference_mode_enabled())
        except _TorchKey:
            return None

    def _recipe(self, func, args, kwargs, out):
        """The recipe for a call that just ran: from torch's cache entry for it, or, for the two kinds of calls
        torch does not cache, from ``out`` itself; :data:`_NO_RECIPE` where there is neither."""
        try:
            entry = FakeTensorMode.cache.get(self._cache_key(_I.CacheKeyState(self.shape_env), func, args, kwargs))
        except _I.BypassDispatchCache:
            entry = None
        if isinstance(entry, _I.DispatchCacheValidEntry):
            return _from_entry(entry)
        if func is _UNSAFE_VIEW or _own_functional_op(func):
            return self._from_output(func, args, out)
        return _NO_RECIPE

    def _from_output(self, func, args, out):
        outs = out if isinstance(out, tuple) else (out,)
        inputs = [storage_key(a.untyped_storage()) for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
        made = []
        for t in outs:
            if (not isinstance(t, FakeTensor) or t.fake_mode is not self or t.constant is not None
                    or _LAYOUT(t) is not _STRIDED or t.is_quantized):
                return _NO_RECIPE
            storage = t.untyped_storage()
            view_idx = None
            if func is _UNSAFE_VIEW:  # a view of its first argument, whatever else it was given
                if (not isinstance(args[0], FakeTensor)
                        or storage_key(args[0].untyped_storage()) != storage_key(storage)):
                    return _NO_RECIPE
                view_idx = 0
            elif storage_key(storage) in inputs or t.storage_offset() != 0 or storage.nbytes() != _dense_bytes(t):
                return _NO_RECIPE
            made.append((_TENSOR, view_idx, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, _LAYOUT(t),
                         t.fake_device, t.requires_grad, t.is_conj(), t.is_neg()))
        return isinstance(out, tuple), tuple(made)

    def _from_recipe(self, recipe, args):
        is_tuple, outs = recipe
        if not is_tuple:
            return self._output(outs[0], args)
        return tuple(self._output(o, args) for o in outs)

    def _output(self, o, args):
        """One output as torch's ``_get_output_tensor_from_cache_entry`` makes it (no shape environment)."""
        kind = o[0]
        if kind == _INPLACE:
            return args[o[1]]
        if kind == _CONSTANT:
            return o[1]
        _, view_idx, shape, stride, offset, dtype, layout, device, requires_grad, conj, neg = o
        with _I.DisableTorchDispatch():
            elem = torch.empty_strided(shape, stride, dtype=dtype, layout=layout, device="meta",
                                       requires_grad=requires_grad)
            if conj:
                _I.set_conj(elem, True)
            if neg:
                _I.set_neg(elem, True)
            if view_idx is not None:
                elem.set_(args[view_idx].untyped_storage(), offset, shape, stride)
        return self._fake(elem, device)

    def _fake(self, elem, device):
        """``FakeTensor(self, elem, device)`` for a meta ``elem`` and a device torch has normalised already."""
        if self._attrs is None:
            self._attrs = dict(vars(FakeTensor(self, elem, device)))
        t = _I.make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                             device_for_backend_keys=device)
        if not self._allow_unsafe_data_ptr_access:
            _I.set_throw_on_mutable_data_ptr(t)
        else:
            _I.set_warn_deprecated_on_mutable_data_ptr(t)
        attrs = t.__dict__
        attrs.update(self._attrs)
        attrs["_fake_device"] = device
        return t

    # -- the key ---------------------------------------------------------------------------------------------
    def _prep_args_for_hash(self, *a, **kw):
        if not self.fast:  # torch's own, whatever its signature
            return super()._prep_args_for_hash(*a, **kw)
        result, args = a[0], a[1]
        try:
            encoded = self._encode(args)
        except _TorchKey:
            return super()._prep_args_for_hash(*a, **kw)
        result.append(KEY_MARK)
        result.append(encoded)

    def _encode(self, x):
        """A hashable value that is equal for two arguments only when torch's key would be (docs/architecture.md)."""
        kind = type(x)
        if kind in _PLAIN:
            return kind, x  # the type too: 1, 1.0 and True are equal but give different dtypes
        if kind is FakeTensor or isinstance(x, FakeTensor):
            # strided (so not mkldnn, not sparse), not quantized, not symbolic, this mode's own, no constant
            if (x.fake_mode is not self or x.constant is not None or x._has_symbolic_sizes_strides
                    or _LAYOUT(x) is not _STRIDED or x.is_quantized):
                raise _TorchKey
            return (_FAKE, x.dtype, x.shape, x.stride(), x._fake_device, x.storage_offset(),
                    x.untyped_storage().nbytes(), x.requires_grad, x.is_conj(), x.is_neg(), x.is_inference())
        if kind in _SEQUENCES:
            return kind, tuple([self._encode(y) for y in x])
        if kind is dict:
            return kind, tuple([(self._encode(k), self._encode(v)) for k, v in x.items()])
        raise _TorchKey


def _from_entry(entry):
    """A recipe from torch's cache entry: the same outputs its ``_output_from_cache_entry`` makes."""
    outs = []
    for info in entry.output_infos:
        if info.inplace_idx is not None:
            outs.append((_INPLACE, info.inplace_idx))
        elif info.metadata is None and info.view_idx is None:
            outs.append((_CONSTANT, info.constant_value))
        else:
            m = info.metadata
            if m is None or m.is_sparse or m.layout is not _STRIDED:
                return _NO_RECIPE
            outs.append((_TENSOR, info.view_idx, tuple(m.shape), tuple(m.stride), m.storage_offset, m.dtype,
                         m.layout, m.device, m.requires_grad, m.is_conj, m.is_neg))
    return entry.is_output_tuple, tuple(outs)


def _own_functional_op(func) -> bool:
    """One of this library's ``torch.library`` ops that mutates nothing and returns no alias."""
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "namespace", None) != "lowmembp":
        return False
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def _dense_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage ``torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)`` makes."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()

"""The fake mode the estimates step in: torch's ``FakeTensorMode`` with its dispatch-cache key built in one pass.

    from lowmembp.fake_mode import StepFakeMode
    with StepFakeMode(allow_non_fake_inputs=True):   # what FakeTensorMode(...) does, the same outputs
        ...

Why: a fake training step is nearly all ``FakeTensorMode`` bookkeeping, and on LLaMA-7B shapes the largest part of
that was building each op's cache key (``FakeTensorMode._prep_args_for_hash``): every fake argument is turned into
a ``TensorMetadata`` dataclass and flattened field by field, its shape and stride walked element by element. Here a
fake argument becomes one tuple of the same facts (dtype, shape, stride, device, storage offset, storage bytes,
``requires_grad``, conj / neg / inference bits); ``memory_format``, the one field left out, is a function of shape
and stride. The key thus tells apart every pair of calls torch's tells apart, so a cache hit returns what torch's
cache would (the outputs are built by torch from its own cache entries, unchanged). Keys in this form start with a
private marker, so they never meet torch's own in the shared cache.

``prim.device`` (a tensor's device: on LLaMA-7B shapes two thirds of a fake step's dispatches, the autograd engine
asking) is answered at once by the handler ``FakeTensorMode.dispatch`` itself calls for it, past that method's
wrappers (a dispatch-mode check, logging, two ``_disable_dynamo`` frames): the same device in 7 µs instead of 13.

Anything else (symbolic shapes, constants, non-strided or quantized tensors, real tensors, another mode's fakes,
callables, SymInts) goes to torch's own key code, whole, which also bypasses the cache where torch does.
``tests/test_fake_mode.py``: a whole training step gives the same ops with the same output metadata in both modes.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor, FakeTensorMode

__all__ = ["StepFakeMode", "KEY_MARK", "DEVICE_QUERY", "answer_device"]

DEVICE_QUERY = torch.ops.prim.device.default
answer_device = _DISPATCH_META_HANDLERS[DEVICE_QUERY]  # FakeTensorMode.dispatch's own answer to prim.device

KEY_MARK = object()      # first item of the args part of a key in this form
_FAKE = object()         # tag of a fake tensor's tuple (no plain value can equal it)
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_SEQUENCES = frozenset({tuple, list, torch.Size})
_STRIDED = torch.strided
_LAYOUT = torch.Tensor.layout.__get__  # the tensor's own layout, past FakeTensor's Python property


class _TorchKey(Exception):
    """An argument this key form does not cover: torch's key code takes the whole call."""


class StepFakeMode(FakeTensorMode):
    """``FakeTensorMode`` with the one-pass cache key and ``prim.device`` answered directly (module doc); everything
    else is torch's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:
            return answer_device(args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
        try:
            encoded = self._encode(args)
        except _TorchKey:
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        result.append(KEY_MARK)
        result.append(encoded)

    def _encode(self, x):
        """A hashable value that is equal for two arguments only when torch's key would be (module doc)."""
        kind = type(x)
        if kind in _PLAIN:
            return kind, x  # the type too: 1, 1.0 and True are equal but give different dtypes
        if isinstance(x, FakeTensor):
            if (x.fake_mode is not self or x.constant is not None or x._has_symbolic_sizes_strides
                    or x.is_mkldnn or _LAYOUT(x) is not _STRIDED or x.is_quantized):
                raise _TorchKey
            return (_FAKE, x.dtype, tuple(x.shape), x.stride(), x.fake_device, x.storage_offset(),
                    x.untyped_storage().nbytes(), x.requires_grad, x.is_conj(), x.is_neg(), x.is_inference())
        if kind in _SEQUENCES:
            return kind, tuple([self._encode(y) for y in x])
        if kind is dict:
            return kind, tuple([(self._encode(k), self._encode(v)) for k, v in x.items()])
        raise _TorchKey

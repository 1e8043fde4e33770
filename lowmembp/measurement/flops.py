"""FLOPs of a training step as torch counts them: ``torch.utils.flop_counter.FlopCounterMode`` plus CPU attention.

    with step_flop_counter() as counter:
        step()                         # forward, backward (with any recomputation), optimizer step
    counter.get_total_flops()

The formulas are torch's (``torch.utils.flop_counter.flop_registry``: matmuls, convolutions and the GPU attention
kernels, 2 FLOPs per multiply-add), counted by a plain dispatch mode: ``FlopCounterMode`` itself also tracks modules
with hooks that keep tensors alive a little longer, which changes the peak it is measured with (LoRA +
checkpointing on BERT: +80 %), so it is not used around a step whose memory is measured. torch's registry does
not know the CPU flash-attention ops that ``scaled_dot_product_attention`` dispatches to on the CPU and on fake
tensors, so their formulas are added here (the same as torch's for the GPU flash kernel: the full L×L product,
causal masking not discounted). Pointwise work (activations, norms, quantisation, the optimizer) counts zero, as
in torch's counter: a FLOP ratio is a compute-bound estimate, not a step time.
"""
from __future__ import annotations

import torch
from lowmembp._compat import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

__all__ = ["step_flop_counter"]


def _cpu_flash_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _cpu_formulas() -> dict:
    aten = torch.ops.aten
    out = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_forward
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_backward
    return out


_SHAPED = shape_wrapper(lambda: 0).__code__  # the code of every formula torch wraps to take shapes


class _NotFlat(Exception):
    """An argument ``_shapes`` does not convert: torch's own conversion (a pytree map) takes the call."""


def _shapes(x):
    """What ``shape_wrapper``'s ``tree_map(get_shape, x)`` gives (tensors replaced by their shapes), for arguments
    of tensors, plain values and lists / tuples of them: the same in a fraction of the time (a pytree map per
    matmul costs ~5 % of a fake step)."""
    if isinstance(x, torch.Tensor):
        return x.shape
    kind = type(x)
    if kind is list or kind is tuple:
        return kind([_shapes(y) for y in x])
    if kind is dict or (isinstance(x, tuple) and kind is not tuple):  # dicts, named tuples: torch's map
        raise _NotFlat
    return x


def _fast(formula):
    """``formula`` from torch's registry, its shapes taken by :func:`_shapes` where torch wrapped it to take them."""
    if getattr(formula, "__code__", None) is not _SHAPED or not hasattr(formula, "__wrapped__"):
        return formula
    raw = formula.__wrapped__

    def counted(*args, out_val=None, **kwargs):
        try:
            return raw(*_shapes(args), out_shape=_shapes(out_val), **{k: _shapes(v) for k, v in kwargs.items()})
        except _NotFlat:
            return formula(*args, out_val=out_val, **kwargs)
    return counted


class StepFlops(TorchDispatchMode):
    """Sums torch's FLOP formulas over the ops run inside it; no hooks, no references kept."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self._registry = {k: _fast(f) for k, f in
                          {**flop_registry, **{k: shape_wrapper(v) for k, v in _cpu_formulas().items()}}.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out

    def count(self, func, args, kwargs, out) -> None:
        """Add ``func``'s FLOPs (its call with ``args``/``kwargs`` gave ``out``); for a mode that already runs the
        ops and counts with this one instead of stacking another (:class:`lowmembp.plan.steps.EventTracker`)."""
        formula = self._registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))

    def get_total_flops(self) -> int:
        return self.total


def step_flop_counter() -> StepFlops:
    """A FLOP counter (a dispatch mode) with torch's formulas and the CPU flash-attention forward and backward."""
    return StepFlops()

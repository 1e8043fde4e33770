"""The structure every op family with a backward shares: one set of formulas, two routes to the kernels.

An op family (:mod:`~lowmembp.ops.approx_act`, :mod:`~lowmembp.ops.ms_norm`) subclasses :class:`OpFamily` and gives
three static functions:

- ``forward(backend, *args) -> (output, saved tensors, attrs)``: the kernels of ``backend`` (``"triton"``, ``"cpu"``)
  and what the backward needs;
- ``backward(backend, attrs, saved, grad) -> grads of args``: the backward kernels;
- ``graph_backward(attrs, saved, grad) -> grads of args``: the same through the family's backward custom op, for a
  backward that is itself differentiated (``create_graph=True``), whose own autograd the family registers.

Eager calls on plain CPU / CUDA tensors (:func:`lowmembp.ops.backend.eager_backend`) take ``family.apply(backend,
*args)``: one ``torch.autograd.Function`` (named after the family) whose forward and backward call those functions,
nothing else between the module's forward and the kernel launch. Traced, fake, meta and ``torch.func`` calls take the
family's ``torch.library`` custom ops (typed, with fake implementations, in the family's file) whose autograd
:meth:`OpFamily.register_autograd` registers from the same ``graph_backward``. Both routes save the same tensors and
give the same gradients (tests/ops/test_backend.py).
"""
from __future__ import annotations

import torch


class _EagerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, family, backend, *args):
        output, saved, attrs = family.forward(backend, *args)
        ctx.save_for_backward(*saved)
        ctx.family, ctx.backend, ctx.attrs = family, backend, attrs
        return output

    @staticmethod
    def backward(ctx, grad):
        family = ctx.family
        if torch.is_grad_enabled():  # create_graph: through the custom op, whose own backward is registered
            grads = family.graph_backward(ctx.attrs, ctx.saved_tensors, grad)
        else:
            grads = family.backward(ctx.backend, ctx.attrs, ctx.saved_tensors, grad)
        return (None, None, *grads)


class OpFamily:
    """Base of an op family's two routes (module doc). Subclasses set ``name`` and the three static functions."""

    name = "op"
    function: type  # the family's eager torch.autograd.Function, made per subclass

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.function = type(f"{cls.name}_eager", (_EagerFunction,), {"__module__": cls.__module__})

    @classmethod
    def apply(cls, backend: str, *args):
        """The eager route: the family's Function on ``backend``'s kernels."""
        return cls.function.apply(cls, backend, *args)

    @classmethod
    def register_autograd(cls, op: str, setup):
        """Register the autograd of the family's forward custom op ``op`` (``"lowmembp::name"``): ``setup(inputs,
        output) -> (saved tensors, attrs)`` picks what ``graph_backward`` needs; the gradient of the op's first
        output goes to its first input, the other inputs get None."""

        def setup_context(ctx, inputs, output):
            saved, attrs = setup(inputs, output)
            ctx.save_for_backward(*saved)
            ctx.attrs, ctx.n_inputs = attrs, len(inputs)

        def backward(ctx, grad, *_others):
            first = cls.graph_backward(ctx.attrs, ctx.saved_tensors, grad)[0]
            return (first,) + (None,) * (ctx.n_inputs - 1)

        torch.library.register_autograd(op, backward, setup_context=setup_context)

    @staticmethod
    def forward(backend: str, *args):  # pragma: no cover - the subclasses give it
        raise NotImplementedError

    @staticmethod
    def backward(backend: str, attrs, saved, grad):  # pragma: no cover
        raise NotImplementedError

    @staticmethod
    def graph_backward(attrs, saved, grad):  # pragma: no cover
        raise NotImplementedError

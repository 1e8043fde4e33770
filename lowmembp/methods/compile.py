"""``compile``: ``torch.compile`` of the whole model, with inductor's activation memory budget (docs/design.md#peers).

    model = lowmembp.apply(model, "lora+lowmembp+compile", memory_budget=0.5)
    compile_info(model)      # {"memory_budget": 0.5, "backend": "inductor", "graphs": 2, "fn": <the backend>}

Applied last (order 60, after ``checkpointing``), so it compiles whatever the other methods built. The model is
compiled in place (``nn.Module.compile``, ``dynamic=False``): the object, its ``forward`` signature (which the HF
Trainer reads) and its ``state_dict`` keys stay the same. Options: ``memory_budget`` (in [0, 1]; default None, torch's
own setting), in force only while this model's own backend partitions its graphs, and ``compile_backend`` (default
``"inductor"``). Exact up to floating-point reassociation. See docs/methods/compile.md for what the budget means, the
dropout RNG of compiled graphs and how a compiled step is measured.
"""
from __future__ import annotations

import torch.nn as nn

from lowmembp._compat import functorch_config, is_optimized_module, list_backends, lookup_backend
from lowmembp.methods.registry import register

ATTR = "_lowmembp_compile"


@register("compile", "torch.compile of the whole model (option memory_budget: inductor's activation memory budget "
          "in [0, 1]; compile_backend)", options={"memory_budget": None, "compile_backend": "inductor"}, order=60)
def apply_compile(model: nn.Module, memory_budget: float | None = None,
                  compile_backend: str = "inductor") -> nn.Module:
    if memory_budget is not None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) \
                or not 0.0 <= float(memory_budget) <= 1.0:
            raise ValueError(f"compile: memory_budget must be a number in [0, 1] (0 = recompute everything, "
                             f"1 = torch's default partitioner) or None, got {memory_budget!r}")
        memory_budget = float(memory_budget)
    if not isinstance(compile_backend, str) or not compile_backend:
        raise ValueError(f"compile: compile_backend must be a torch.compile backend name such as 'inductor', "
                         f"got {compile_backend!r}")
    try:
        inner = lookup_backend(compile_backend)
    except Exception as e:
        raise ValueError(f"compile: unknown compile_backend {compile_backend!r}; valid names: "
                         f"{', '.join(list_backends())}") from e
    if is_compiled(model):
        raise RuntimeError("compile: this model is already compiled (apply 'compile' once, last)")
    info = {"memory_budget": memory_budget, "backend": compile_backend, "graphs": 0}
    info["fn"] = _BudgetBackend(inner, memory_budget, info)
    model.compile(backend=info["fn"], dynamic=False)
    object.__setattr__(model, ATTR, info)
    return model


class _BudgetBackend:
    """A ``torch.compile`` backend: the named backend with the memory budget in force while it compiles a graph
    (AOT autograd traces and partitions the joint graph inside this call)."""

    def __init__(self, inner, memory_budget: float | None, info: dict):
        self.inner, self.memory_budget, self.info = inner, memory_budget, info

    def __call__(self, gm, example_inputs):
        self.info["graphs"] += 1
        if self.memory_budget is None:
            return self.inner(gm, example_inputs)
        with functorch_config().patch(activation_memory_budget=self.memory_budget):
            return self.inner(gm, example_inputs)


def compile_info(model: nn.Module) -> dict | None:
    """The ``compile`` method's record on ``model`` (budget, backend, number of graphs compiled so far), or None."""
    return getattr(model, ATTR, None)


def is_compiled(model: nn.Module) -> bool:
    """True when ``model`` or one of its submodules runs through ``torch.compile`` (this method,
    ``nn.Module.compile`` or a ``torch.compile(model)`` wrapper)."""
    if is_optimized_module(model):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None or ATTR in m.__dict__
               or is_optimized_module(m) for m in model.modules())

"""lowmembp: memory-efficient fine-tuning of Transformers, methods side by side.

    import lowmembp
    model = lowmembp.apply(model, "lora+lowmembp")   # one call on your own timm / transformers model
    lowmembp.list_methods()                          # {name: description}
    lowmembp.export(model).save_pretrained(out)      # an ordinary model again (γ/β restored, LoRA kept or merged)
    lowmembp.make_plan("llama-7b", gpu_memory="24GiB", batch_size=4, seq_len=2048)   # what fits my GPU?

The rooms, each a subpackage whose ``__init__`` says what it holds and may import: :mod:`lowmembp.ops` (the ops and
their backend), :mod:`lowmembp.models` (the model adapters), :mod:`lowmembp.methods` (the methods, their registry and
the export that undoes them), :mod:`lowmembp.measurement` (saved bytes, a step's peak, step time, FLOPs),
:mod:`lowmembp.estimator` (a training step on fake tensors at paper scale) and :mod:`lowmembp.plan` (the planner).
``import lowmembp`` loads torch and the method registry only; the rest loads on first use. The rooms, the loose
modules every room may use and the layering: docs/architecture.md.
"""
from __future__ import annotations

import importlib
import logging


class _OptionalKernelNotice(logging.Filter):
    """Drops one log line of bitsandbytes, which peft imports whenever it is installed: on a CPU with AVX512-BF16
    its import says "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'" (an
    optional download of a faster CPU 4-bit matmul; without it bitsandbytes uses its own CPU path). A user who did
    not ask for 4-bit weights should not meet it first; every other record of that logger passes."""

    MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.MESSAGE)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OptionalKernelNotice())

from lowmembp.methods.registry import apply, list_methods  # noqa: E402  (after the filter: peft may load bitsandbytes)

__version__ = "0.1.0"

# name -> (module, attribute): the one-call entry points that live in a room, imported when first used
_ENTRY_POINTS = {
    "export": ("lowmembp.methods.export", "export"),
    "make_plan": ("lowmembp.plan", "make_plan"),
}
_ROOMS = ("ops", "models", "methods", "measurement", "estimator", "plan", "atomic")
__all__ = ["apply", "list_methods", "export", "make_plan", "__version__"]


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        module, attr = _ENTRY_POINTS[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _ROOMS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_ENTRY_POINTS) | set(_ROOMS))

"""The signature a patched forward shows: that of the forward it replaces.

Methods install instance-level forwards (picklable callables such as ``tokentune``'s entry or ``checkpointing``'s
wrapper) that take ``*args, **kwargs``. Code that reads ``inspect.signature(model.forward)`` — the HF ``Trainer``
with ``remove_unused_columns=True`` keeps only the batch columns named there; it also looks for ``**kwargs`` to pass
``num_items_in_batch`` — must see the original parameters, so such a callable defines ``__signature__`` (which
``inspect.signature`` reads first) with :func:`original_signature`.
"""
from __future__ import annotations

import inspect

import torch.nn as nn


def original_signature(module: nn.Module, attr: str, replaced=None) -> inspect.Signature:
    """Signature of what ``module.<attr>`` was before patching: ``replaced`` (an earlier instance-level override)
    when there was one, else the class's method bound to ``module`` (``self`` dropped)."""
    target = replaced if replaced is not None else getattr(type(module), attr).__get__(module, type(module))
    return inspect.signature(target)


"""Deprecated spellings kept working for one release: a room that used to be shadowed by a function of its name.

Here, at the bottom of the package (it imports nothing of lowmembp), so that the rooms can use it without importing
the package root.
"""
from __future__ import annotations

import sys
import types
import warnings

__all__ = ["make_module_callable"]


def make_module_callable(module_name: str, new_name: str, target) -> None:
    """Let the module ``module_name`` be called as the function it used to be shadowed by (one release only):
    ``lowmembp.methods()`` and ``lowmembp.plan(...)`` still work and warn, naming ``new_name``; ``target()`` gives
    the function to call (looked up at call time)."""

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            warnings.warn(f"calling {module_name}(...) is deprecated and will be removed in the next release; "
                          f"use {new_name}(...)", DeprecationWarning, stacklevel=2)
            return target()(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule

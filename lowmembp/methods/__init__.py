"""Methods: each file registers one transform ``model -> model`` (see :mod:`lowmembp.methods.registry`).

Holds the registry (``apply``, ``list_methods``, ``parse``, ``register``), one module per method (imported when a
method is first looked up), the optimizer levers chosen beside them, and the export that undoes the methods
(:mod:`lowmembp.methods.export`, what the conversions record: :mod:`lowmembp.methods.export_record`).

May import: :mod:`lowmembp.ops`, :mod:`lowmembp.models`, :mod:`lowmembp._compat`, torch, peft, timm, transformers
(the last three inside the method modules only, on first use). Never the measurement, estimator or planner rooms.
"""
from lowmembp._deprecation import make_module_callable
from lowmembp.methods.registry import apply, list_methods, method_options, parse, register

__all__ = ["apply", "list_methods", "method_options", "parse", "register"]

make_module_callable(__name__, "lowmembp.list_methods", lambda: list_methods)

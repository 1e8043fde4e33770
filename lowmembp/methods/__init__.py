"""Methods: each file registers one transform ``model -> model`` (see :mod:`lowmembp.methods.registry`)."""
from lowmembp.methods.registry import apply, method_options, methods, parse, register

__all__ = ["apply", "methods", "method_options", "parse", "register"]

"""The method registry behind ``lowmembp.apply(model, "a+b+c", **options)``.

Each method lives in its own file under ``lowmembp/methods/`` and registers a transform ``model -> model`` with
:func:`register`. A method declares the options it takes (with defaults) and its place in the order in which
composed methods are applied, so ``"lowmembp+lora"`` and ``"lora+lowmembp"`` mean the same thing.

Order (lower first): lora 10 → lowmembp / lowmembp-act / lowmembp-norm 20 → mesa / mesa-gelu-ln 30 →
tokentune 40 → checkpointing 50 → compile 60 (torch.compile of the result). ``baseline`` changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    fn: Callable[..., nn.Module]
    options: dict[str, Any] = field(default_factory=dict)  # option name -> default
    order: int = 100
    excludes: tuple[str, ...] = ()  # names that cannot be combined with this one


_REGISTRY: dict[str, Method] = {}


def register(name: str, description: str, *, options: dict[str, Any] | None = None, order: int = 100,
             excludes: tuple[str, ...] = ()):
    """Decorator: register ``fn(model, **options) -> model`` as method ``name``."""
    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is registered twice")
        _REGISTRY[name] = Method(name, description, fn, dict(options or {}), order, tuple(excludes))
        return fn
    return deco


def methods() -> dict[str, str]:
    """All method names, each with a one-line description."""
    _load_all()
    return {name: m.description for name, m in sorted(_REGISTRY.items())}


def method_options(spec: str) -> dict[str, Any]:
    """The options (with defaults) that the methods of ``spec`` take together."""
    out: dict[str, Any] = {}
    for m in parse(spec):
        out.update(m.options)
    return out


def parse(spec: str) -> list[Method]:
    """``"lora+lowmembp"`` -> the Method objects in application order; a clear error for bad specs."""
    _load_all()
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method must be a non-empty string like 'lora+lowmembp'; valid names: {_valid()}")
    names = [n.strip() for n in spec.split("+")]
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown method {', '.join(map(repr, unknown))} in {spec!r}; valid names: {_valid()} "
                         f"(combine them with '+', e.g. 'lora+lowmembp')")
    if len(set(names)) != len(names):
        raise ValueError(f"method {spec!r} names a method twice")
    chosen = [_REGISTRY[n] for n in names]
    if any(m.name == "baseline" for m in chosen) and any(m.name not in ("baseline", "compile") for m in chosen):
        raise ValueError(f"'baseline' means no change and can only be combined with 'compile' (got {spec!r})")
    for m in chosen:
        for other in chosen:
            if other.name in m.excludes:
                raise ValueError(f"{_conflict(m, other)} (in {spec!r})")
    return sorted(chosen, key=lambda m: m.order)


def _conflict(a: Method, b: Method) -> str:
    """The one message for two methods that exclude each other (in one spec, or one already on the model)."""
    a, b = sorted((a, b), key=lambda m: (m.order, m.name))
    return f"{a.name!r} cannot be combined with {b.name!r}: {_why(a, b)}"


def carried_methods(model: nn.Module) -> list[str]:
    """The methods ``model`` already carries: those ``apply`` recorded, plus those its layers show (MS norms /
    approximate activations: lowmembp-norm / lowmembp-act; Mesa layers: mesa or mesa-gelu-ln) when the record
    was lost (e.g. the method's own function was called directly)."""
    out = list(getattr(model, "_lowmembp_methods", ()))
    mods = {(type(m).__module__ or "", type(m).__name__) for m in model.modules()}
    names = {n for _, n in mods}
    shown = []
    if names & {"MSLayerNorm", "MSRMSNorm"}:
        shown.append("lowmembp-norm")
    if any(mod.startswith("lowmembp.ops.approx_act") for mod, _ in mods):
        shown.append("lowmembp-act")
    if any(mod.startswith("lowmembp.ops.mesa_layers") for mod, _ in mods):
        shown.append("mesa" if "MesaLinear" in names else "mesa-gelu-ln")
    covered = {"lowmembp": ("lowmembp-norm", "lowmembp-act"), "mesa": ("mesa-gelu-ln",)}
    for name in shown:
        if name not in out and not any(name in covered.get(o, ()) for o in out):
            out.append(name)
    return out


def apply(model: nn.Module, method: str, **options) -> nn.Module:
    """Convert ``model`` in place for ``method`` (names joined with ``+``) and return it.

    The returned object may be a new wrapper (``lora`` returns a peft model); always use the return value.
    Options go to the methods that take them; an option no chosen method takes is an error.
    """
    chosen = parse(method)
    accepted = {k for m in chosen for k in m.options}
    bad = sorted(set(options) - accepted)
    if bad:
        takes = "; ".join(f"{m.name}: {', '.join(m.options) or 'no options'}" for m in chosen)
        raise TypeError(f"option(s) {', '.join(bad)} not taken by {method!r} ({takes})")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise TypeError(f"the model is wrapped by {type(model).__name__}: apply lowmembp before wrapping — "
                        f"lowmembp.apply(model.module, {method!r}), then wrap the result again")
    carried = carried_methods(model) if isinstance(model, nn.Module) else []
    for m in chosen:
        for name in carried:
            other = _REGISTRY.get(name)
            if other is not None and (other.name in m.excludes or m.name in other.excludes):
                raise ValueError(f"{_conflict(m, other)} (the model already carries {other.name!r})")
    applied = list(getattr(model, "_lowmembp_methods", ()))
    for m in chosen:
        if m.name == "baseline":
            continue
        if m.name in applied:
            raise RuntimeError(f"method {m.name!r} was already applied to this model")
        kwargs = {k: options.get(k, default) for k, default in m.options.items()}
        model = m.fn(model, **kwargs)
        applied.append(m.name)
        try:
            object.__setattr__(model, "_lowmembp_methods", tuple(applied))
        except Exception:  # pragma: no cover - exotic wrappers
            pass
    return model


def _valid() -> str:
    return ", ".join(sorted(_REGISTRY))


def _why(a: Method, b: Method) -> str:
    return f"{a.name} and {b.name} both rewrite the same layers"


_loaded = False


def _load_all() -> None:
    """Import every method module once so that its ``register`` calls run."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    import pkgutil

    # ``lowmembp.methods`` the attribute is the function ``methods()``; the package is found by name.
    pkg = importlib.import_module("lowmembp.methods")
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("registry",) and not info.name.startswith("_"):
            importlib.import_module(f"lowmembp.methods.{info.name}")

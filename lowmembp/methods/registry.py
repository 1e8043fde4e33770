"""The method registry behind ``lowmembp.apply(model, "a+b+c", **options)``.

Each method lives in its own file under ``lowmembp/methods/`` and registers a transform ``model -> model`` with
:func:`register`, declaring the options it takes (with defaults), the methods it excludes and its place in the order
in which composed methods are applied, so ``"lowmembp+lora"`` and ``"lora+lowmembp"`` mean the same thing
(``baseline`` changes nothing). A method may :func:`defer` part of its work to later in the same ``apply``:
``lora``'s NF4 quantisation waits until ``lowmembp`` has folded γ into the full-precision weights. A method name may
carry its options, ``name@opt=value[,opt=value...]`` (``"lora@rank=8+tokentune@k=0.3"``), so that the spec alone
names the variant; values are read as the method declares (:func:`read_option`) and checked by its ``check``. The
order of every method, deferred steps and the spec's rules: docs/methods/index.md.
"""
from __future__ import annotations

import contextvars
import re
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
    exclude_reasons: dict[str, str] = field(default_factory=dict)  # excluded name -> why (the refusal's message)
    kinds: dict[str, tuple[type, ...]] = field(default_factory=dict)  # option -> types its text may read as, in order
    check: Callable[..., None] | None = None  # check(**options, defaults filled): ValueError for a bad value
    parts: tuple[str, ...] = ()  # methods that, applied together, are exactly this one (lowmembp = -act + -norm)
    shown_by: Callable[[set], bool] | None = None  # shown_by({(module, class name) of each layer}): carried?
    covers: tuple[str, ...] = ()  # methods a model carrying this one shows without carrying them (its parts, ...)
    changes_weights: bool = False  # rewrites the model's own weights (adapters, γ folded): a saved base can't follow


_REGISTRY: dict[str, Method] = {}
SPEC_OPTION_MARK = "@"  # tokentune@k=4
_OPTION_NAME = re.compile(r"[a-z][a-z0-9_]*")
_OPTION_VALUE = re.compile(r"[A-Za-z0-9._-]+")


def register(name: str, description: str, *, options: dict[str, Any] | None = None, order: int = 100,
             excludes: tuple[str, ...] | dict[str, str] = (), kinds: dict[str, tuple[type, ...]] | None = None,
             check: Callable[..., None] | None = None, parts: tuple[str, ...] = (),
             shown_by: Callable[[set], bool] | None = None, covers: tuple[str, ...] = (),
             changes_weights: bool = False):
    """Decorator: register ``fn(model, **options) -> model`` as method ``name``.

    ``kinds``: for an option whose default's type does not say how to read its text, the types to try in order
    (tokentune's ``k``: ``(int, float)``, a count or a fraction). ``check``: called with every option (defaults
    filled) before any work (the training job calls it when it parses its arguments); raises ValueError.
    ``parts``: the methods whose combination is exactly this method (the planner lists only one of the two).
    ``excludes``: the methods this one cannot be combined with; a dict maps each to the reason the refusal gives
    (without one, or with "": "both rewrite the same layers"). ``shown_by``: for a method whose layers show on the
    model, whether the set of ``(module, class name)`` of a model's layers shows it (:func:`carried_methods`);
    ``covers``: the methods a model carrying this one shows without carrying them (besides ``parts``).
    ``changes_weights``: the method rewrites the model's weights (adapters, folded γ/β), so the model it trains is
    not the plain model a later cell could start from."""
    reasons = dict(excludes) if isinstance(excludes, dict) else {}

    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is registered twice")
        _REGISTRY[name] = Method(name, description, fn, dict(options or {}), order, tuple(excludes), reasons,
                                 dict(kinds or {}), check, tuple(parts), shown_by, tuple(parts) + tuple(covers),
                                 changes_weights)
        return fn
    return deco


_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("lowmembp_pending_steps", default=None)


def defer(model: nn.Module, step: Callable[[nn.Module], Any], *, order: int) -> None:
    """Run ``step(model)`` (in place) later in the running ``apply``: before its first method of order > ``order``,
    or at its end; at once when no ``apply`` is running."""
    pending = _PENDING.get()
    if pending is None:
        step(model)
    else:
        pending.append((order, model, step))


def _run_pending(pending: list, below: int | None) -> None:
    """Run (and drop) the deferred steps of order < ``below`` (all when None), lowest order first."""
    due = sorted((p for p in pending if below is None or p[0] < below), key=lambda p: p[0])
    for p in due:
        pending.remove(p)
        p[2](p[1])


def list_methods() -> dict[str, str]:
    """All method names, each with a one-line description."""
    _load_all()
    return {name: m.description for name, m in sorted(_REGISTRY.items())}


def list_methods_changing_weights() -> tuple[str, ...]:
    """The methods that rewrite the model's own weights (``changes_weights``), sorted."""
    _load_all()
    return tuple(name for name, m in sorted(_REGISTRY.items()) if m.changes_weights)


def method_options(spec: str) -> dict[str, Any]:
    """The options (with defaults) that the methods of ``spec`` take together."""
    out: dict[str, Any] = {}
    for m in parse(spec):
        out.update(m.options)
    return out


def option_kinds(spec: str) -> dict[str, tuple[type, ...]]:
    """The declared ``kinds`` of the options of ``spec``'s methods (options without any are read by their
    default's type)."""
    out: dict[str, tuple[type, ...]] = {}
    for m in parse(spec):
        out.update(m.kinds)
    return out


def spec_parts(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``"lora@rank=8+tokentune@k=0.3"`` -> ``[("lora", {"rank": "8"}), ("tokentune", {"k": "0.3"})]``: each name of
    the spec (as written, not yet checked against the registry) with the options written after it, as text."""
    if not isinstance(spec, str) or not spec.strip():
        _load_all()  # for the list of valid names
        raise ValueError(f"method must be a non-empty string like 'lora+lowmembp'; valid names: {_valid()}")
    out = []
    for part in spec.split("+"):
        name, mark, rest = part.strip().partition(SPEC_OPTION_MARK)
        opts: dict[str, str] = {}
        if mark:
            for item in rest.split(","):
                key, eq, value = (x.strip() for x in item.partition("="))
                if not (eq and _OPTION_NAME.fullmatch(key) and _OPTION_VALUE.fullmatch(value)):
                    raise ValueError(f"method {spec!r}: cannot read the option {item.strip()!r} of {name.strip()!r}; "
                                     f"write options as name@option=value[,option=value], e.g. 'tokentune@k=4' "
                                     f"(values: one word of letters, digits, '.', '_', '-')")
                if key in opts:
                    raise ValueError(f"method {spec!r}: option {key!r} is given twice")
                opts[key] = value
        out.append((name.strip(), opts))
    return out


def plain_spec(spec: str) -> str:
    """``spec`` without the options written into it: ``"lora@rank=8+tokentune"`` -> ``"lora+tokentune"``."""
    return "+".join(name for name, _ in spec_parts(spec))


def read_option(name: str, raw: Any, default: Any, kinds: tuple[type, ...] | None = None) -> Any:
    """An option's value from its text (a command line, a method spec) or a YAML value: by the ``kinds`` its method
    declares (tried in order), else by the type of its default. A non-text value is kept (the method checks it).
    ValueError when the text does not read."""
    if not isinstance(raw, str):
        return list(raw) if isinstance(default, (list, tuple)) and isinstance(raw, (list, tuple)) else raw
    if kinds:
        for kind in kinds:
            try:
                return _read_as(kind, raw, default)
            except ValueError:
                pass
        raise ValueError(f"cannot read {raw!r} as {' or '.join(k.__name__ for k in kinds)}")
    return _read_as(type(default), raw, default)


def _read_as(kind: type, raw: str, default: Any) -> Any:
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind in (list, tuple):
            items = [s.strip() for s in raw.split(",") if s.strip()]
            item_kind = type(default[0]) if isinstance(default, (list, tuple)) and default else str
            return [item_kind(s) for s in items]
        if kind is type(None):
            for k in (int, float):
                try:
                    return k(raw)
                except ValueError:
                    pass
            if raw.lower() in ("none", "null"):
                return None
            if "," in raw:
                return [s.strip() for s in raw.split(",") if s.strip()]
        return raw
    except ValueError as err:
        raise ValueError(f"cannot read {raw!r} as {kind.__name__} ({err})") from None


def spec_options(spec: str) -> dict[str, Any]:
    """The options written into ``spec`` (``"tokentune@k=4"`` -> ``{"k": 4}``), read as their methods declare."""
    parse(spec)
    out: dict[str, Any] = {}
    for name, opts in spec_parts(spec):
        m = _REGISTRY[name]
        for key, raw in opts.items():
            try:
                out[key] = read_option(key, raw, m.options[key], m.kinds.get(key))
            except ValueError as err:
                raise ValueError(f"method {spec!r}: option {key}: {err}") from None
    return out


def check_options(spec: str, options: dict[str, Any]) -> None:
    """Each method's own ``check`` of its options (``options`` over the defaults); ValueError for a bad value."""
    for m in parse(spec):
        if m.check is not None:
            m.check(**{k: options.get(k, d) for k, d in m.options.items()})


def parse(spec: str) -> list[Method]:
    """``"lora+lowmembp"`` (options in the names allowed: ``"tokentune@k=4"``) -> the Method objects in application
    order; a clear error for bad specs."""
    _load_all()
    parts = spec_parts(spec)
    names = [n for n, _ in parts]
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown method {', '.join(map(repr, unknown))} in {spec!r}; valid names: {_valid()} "
                         f"(combine them with '+', e.g. 'lora+lowmembp')")
    if len(set(names)) != len(names):
        raise ValueError(f"method {spec!r} names a method twice")
    chosen = [_REGISTRY[n] for n in names]
    for m, (_, opts) in zip(chosen, parts):
        bad = sorted(set(opts) - set(m.options))
        if bad:
            raise ValueError(f"method {spec!r}: {m.name!r} does not take option(s) {', '.join(bad)}; it takes: "
                             f"{', '.join(m.options) or 'no options'}")
        values = {k: v for o in (p[1] for p in parts) for k, v in o.items()}
        clash = [k for k in opts if values[k] != opts[k]]
        if clash:
            raise ValueError(f"method {spec!r}: option {clash[0]!r} is given two values")
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
    """The methods ``model`` already carries: those ``apply`` recorded, plus those its layers show (each method's
    ``shown_by``: MS norms, approximate activations, Mesa layers) when the record was lost (e.g. the method's own
    function was called directly)."""
    _load_all()
    out = list(getattr(model, "_lowmembp_methods", ()))
    layers = {(type(m).__module__ or "", type(m).__name__) for m in model.modules()}
    shown = [m.name for m in _REGISTRY.values() if m.shown_by is not None and m.shown_by(layers)]
    for name in shown:
        if name not in out and not any(name in _REGISTRY[o].covers for o in out if o in _REGISTRY):
            out.append(name)
    return out


def apply(model: nn.Module, method: str, **options) -> nn.Module:
    """Convert ``model`` in place for ``method`` (names joined with ``+``) and return it.

    The returned object may be a new wrapper (``lora`` returns a peft model); always use the return value.
    Options go to the methods that take them; an option no chosen method takes is an error. Options written into
    the spec (``"tokentune@k=4"``) join ``options``; one given both ways with two values is an error.
    """
    chosen = parse(method)
    for key, value in spec_options(method).items():
        if key in options and options[key] != value:
            raise ValueError(f"option {key}={options[key]!r} contradicts the method spec {method!r}; give it once")
        options[key] = value
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
    pending: list = []
    token = _PENDING.set(pending)
    try:
        for m in chosen:
            if m.name == "baseline":
                continue
            if m.name in applied:
                raise RuntimeError(f"method {m.name!r} was already applied to this model")
            _run_pending(pending, below=m.order)
            kwargs = {k: options.get(k, default) for k, default in m.options.items()}
            model = m.fn(model, **kwargs)
            applied.append(m.name)
            try:
                object.__setattr__(model, "_lowmembp_methods", tuple(applied))
            except Exception:  # pragma: no cover - exotic wrappers
                pass
        _run_pending(pending, below=None)
    finally:
        _PENDING.reset(token)
    return model


def _valid() -> str:
    return ", ".join(sorted(_REGISTRY))


def _why(a: Method, b: Method) -> str:
    reason = a.exclude_reasons.get(b.name) or b.exclude_reasons.get(a.name)
    return reason or f"{a.name} and {b.name} both rewrite the same layers"


_loaded = False
# Modules of lowmembp/methods/ that register no method: the registry itself, the export that undoes the methods
# and what it records, the optimizer levers (chosen beside the methods, not applied to the model).
NOT_METHODS = frozenset({"registry", "export", "export_record", "optimizers", "optim_levers"})


def _load_all() -> None:
    """Import every method module once so that its ``register`` calls run."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    import pkgutil

    pkg = importlib.import_module("lowmembp.methods")
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in NOT_METHODS and not info.name.startswith("_"):
            importlib.import_module(f"lowmembp.methods.{info.name}")

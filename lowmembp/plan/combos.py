"""Every valid combination of the registry's methods, with the option values a plan sweeps.

The registry is read when the plan runs (methods added later appear by themselves); a combination is valid when
:func:`lowmembp.methods.registry.parse` accepts it (composition rules, exclusions). ``baseline`` is the empty
combination. A combination holding every part of a composite method (``lowmembp-act`` and ``lowmembp-norm``: the
registry's ``parts`` of ``lowmembp``) is the composite itself and is listed once, under the composite's name.
Options take the registry's defaults unless the caller sweeps them (``{"tokentune": {"k": [16, 256]}}``
gives one row per value). A few methods cannot be estimated on fake tensors at all; they are skipped up front with
the reason below, and any other method whose estimate fails is skipped with its error.

The default plan (no ``methods`` given) is the combinations of at most :data:`DEFAULT_MAX_METHODS` methods, without
the variants of :func:`variants` (the parts of a composite method, and the paper-figure variants of
:data:`VARIANTS`): 60 rows for LLaMA-7B against 768 for every valid combination, which a plan gets with
``max_methods="all"`` and the variants named in ``methods``. Naming ``methods`` plans every combination of them.
"""
from __future__ import annotations

import itertools

from lowmembp.methods.registry import check_options, list_methods, parse

__all__ = ["NOT_ESTIMATED", "VARIANTS", "DEFAULT_MAX_METHODS", "ALL", "combinations", "variants",
           "default_max_methods", "option_grid", "check_sweeps", "key_of", "parse_option_sweeps"]

DEFAULT_MAX_METHODS = 2  # methods per combination in the default plan (module doc)
ALL = "all"              # max_methods without a limit
# method -> why the default plan leaves it out (besides the parts of a composite method, see variants())
VARIANTS = {
    "mesa-gelu-ln": "Mesa on GELU/SiLU and the norms only (the LowMemoryBP paper's Fig. 1 comparison); mesa is planned",
}

# method -> why the fake-tensor estimate cannot say what it does
NOT_ESTIMATED = {
    "compile": "not estimated on fake tensors: torch.compile's memory is what inductor generates, which the "
               "dispatch-mode tracker does not see (measure it on the device)",
    "liger": "needs a GPU: Liger-Kernel's Triton kernels run on CUDA only",
    "cce": "not estimated on fake tensors: Cut Cross-Entropy's loss runs in Triton kernels (CUDA) or torch.compile, "
           "which the dispatch-mode tracker does not see (chunked-ce, estimated, also never keeps the full logits; "
           "measure cce on the device)",
}


def key_of(method: str) -> str:
    """An order-free key of a method combination (``"lowmembp+lora"`` and ``"lora+lowmembp"`` alike)."""
    return "+".join(sorted(n.strip() for n in method.split("+")))


def variants() -> dict[str, str]:
    """The methods the default plan leaves out, with the reason: the parts of a composite method (the composite is
    in: ``lowmembp`` for ``lowmembp-act`` and ``lowmembp-norm``) and :data:`VARIANTS`."""
    out = {}
    for name in sorted(list_methods()):
        for part in parse(name)[0].parts:
            out[part] = f"a part of {name}, which is planned whole"
    out.update(VARIANTS)
    return {n: f"{why}; name it in --methods to plan it" for n, why in out.items()}


def default_max_methods(include: list[str] | None, max_methods: int | str | None) -> int | None:
    """The limit of methods per combination: ``max_methods`` as given (``"all"``: none), else
    :data:`DEFAULT_MAX_METHODS` for the default plan and none when ``include`` names the methods."""
    if max_methods == ALL:
        return None
    if max_methods is None:
        return DEFAULT_MAX_METHODS if include is None else None
    if isinstance(max_methods, bool) or not isinstance(max_methods, int) or max_methods < 1:
        raise ValueError(f"max_methods must be a positive integer or {ALL!r}, got {max_methods!r}")
    return max_methods


def combinations(include: list[str] | None = None, exclude: list[str] | None = None,
                 max_methods: int | None = None, default: bool = False) -> tuple[list[str], dict[str, str]]:
    """``(combinations, skipped)``: every valid combination in application order (``"baseline"`` first), and the
    registry's methods left out with the reason. ``include``: only these methods; ``exclude``: not these;
    ``max_methods``: at most that many methods in one combination; ``default``: without ``include``, the default
    plan's methods (no :func:`variants`)."""
    names = sorted(n for n in list_methods() if n != "baseline")
    for n in (include or []) + (exclude or []):
        if n not in names and n != "baseline":
            raise ValueError(f"unknown method {n!r}; known: {', '.join(names)}")
    skipped = {n: NOT_ESTIMATED[n] for n in names if n in NOT_ESTIMATED}
    if include is not None:
        skipped.update({n: "not asked for (--methods)" for n in names if n not in include and n not in skipped})
    elif default:
        skipped.update({n: why for n, why in variants().items() if n in names and n not in skipped})
    skipped.update({n: "left out (--exclude)" for n in exclude or [] if n not in skipped})
    usable = [n for n in names if n not in skipped]
    parts_of = {n: set(parse(n)[0].parts) for n in usable}
    composites = [p for n, p in parts_of.items() if p and p <= set(usable)]  # each listed under its composite
    top = len(usable) if max_methods is None else max_methods
    out = ["baseline"]
    for r in range(1, top + 1):
        for combo in itertools.combinations(usable, r):
            if any(parts <= set(combo) for parts in composites):
                continue  # the composite method's own row
            try:
                chosen = parse("+".join(combo))
            except ValueError:
                continue
            out.append("+".join(m.name for m in chosen))
    return out, skipped


def option_grid(method: str, sweeps: dict[str, dict[str, list]] | None) -> list[dict]:
    """The option settings of one combination: the product of the sweeps of its methods (``[{}]``: defaults)."""
    axes = []
    for m in parse(method):
        for opt, values in (sweeps or {}).get(m.name, {}).items():
            if opt not in m.options:
                raise ValueError(f"method {m.name!r} has no option {opt!r}; its options: "
                                 f"{', '.join(m.options) or 'none'}")
            if not isinstance(values, (list, tuple)):
                raise ValueError(f"options: {m.name}.{opt} takes a list of values to sweep, e.g. [{values!r}]")
            axes.append([(opt, v) for v in values])
    return [dict(c) for c in itertools.product(*axes)] if axes else [{}]


def check_sweeps(sweeps: dict[str, dict[str, list]] | None, combos: list[str]) -> None:
    """ValueError naming the option for a sweep the plan cannot use: a method not in the registry or in no planned
    combination, an option the method does not take, or a value its ``check`` refuses (never a row dropped later)."""
    known = list_methods()
    planned = {m.name for c in combos for m in parse(c)}
    for method, opts in (sweeps or {}).items():
        if method not in known:
            raise ValueError(f"option {method}.{', '.join(opts)}: unknown method {method!r}; known: "
                             f"{', '.join(n for n in known if n != 'baseline')}")
        if method not in planned:
            raise ValueError(f"option {method}.{', '.join(opts)}: {method!r} is in no planned combination; add it to "
                             f"the methods (--methods {method},...) or drop the option")
        m = parse(method)[0]
        for opt, values in opts.items():
            if opt not in m.options:
                raise ValueError(f"option {method}.{opt}: {method!r} has no option {opt!r}; its options: "
                                 f"{', '.join(m.options) or 'none'}")
            if not isinstance(values, (list, tuple)):
                raise ValueError(f"options: {method}.{opt} takes a list of values to sweep, e.g. [{values!r}]")
            for v in values:
                try:
                    check_options(method, {opt: v})
                except (ValueError, TypeError) as e:
                    raise ValueError(f"option {method}.{opt}={v}: {e}") from None


def parse_option_sweeps(items: list[str]) -> dict[str, dict[str, list]]:
    """``["tokentune.k=16,256", "lora.rank=8"]`` -> ``{"tokentune": {"k": [16, 256]}, "lora": {"rank": [8]}}``."""
    out: dict[str, dict[str, list]] = {}
    for item in items or []:
        head, sep, values = item.partition("=")
        method, dot, opt = head.partition(".")
        if not sep or not dot or not values:
            raise ValueError(f"--option {item!r}: write METHOD.OPTION=V1[,V2,...], e.g. tokentune.k=16,256")
        out.setdefault(method.strip(), {})[opt.strip()] = [_value(v) for v in values.split(",")]
    return out


def _value(text: str):
    t = text.strip()
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(t.lower(), t)

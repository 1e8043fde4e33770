"""The library's layering as a contract (docs/architecture.md): each room imports only the rooms below it, never a
private name of another room, never the package root; no import cycles between the modules of lowmembp/.

Read from the source with ``ast`` (every import, at module level or inside a function), so that a lazy import
counts as a dependency too; only module-level imports can form an import cycle, so the cycle check reads those.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lowmembp"

# The bottom: loose modules every room may use; they import nothing of lowmembp.
BOTTOM = {"_compat", "_deprecation", "atomic", "cache"}
# room -> the rooms it may import (besides itself and the bottom), lowest first: ops and models are side by side
# (neither imports the other), then methods, measurement, estimator, plan.
MAY_IMPORT = {
    **{name: set() for name in BOTTOM},
    "ops": set(),
    "models": set(),
    "methods": {"ops", "models"},
    "measurement": {"ops", "models", "methods"},
    "estimator": {"ops", "models", "methods", "measurement"},
    "plan": {"ops", "models", "methods", "measurement", "estimator"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _room(module: str) -> str | None:
    """``lowmembp.methods.lora`` -> ``methods``; the package root -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(path: pathlib.Path):
    """``(line, target module, imported name or None, at module level)`` for each lowmembp import of ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lowmembp":
                    yield node.lineno, alias.name, None, id(node) not in nested
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "lowmembp":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists()
                if is_module:
                    yield node.lineno, sub, None, id(node) not in nested
                else:
                    yield node.lineno, target, alias.name, id(node) not in nested


FILES = sorted(PACKAGE.rglob("*.py"))


def _private(module: str, name: str | None) -> bool:
    parts = module.split(".")[1:] + ([name] if name else [])
    return any(p.startswith("_") and not p.startswith("__") and p not in BOTTOM for p in parts)


def test_every_room_is_in_the_contract():
    rooms = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert rooms == set(MAY_IMPORT), "a new room (or loose module) needs its place in MAY_IMPORT and the docs"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_rooms_import_only_rooms_below_them(path):
    module = _module_name(path)
    room = _room(module)
    if room is None:  # the package root: the front door, it may reach every room
        return
    bad = []
    for line, target, name, _ in _imports(path):
        other = _room(target)
        if other is None:
            bad.append(f"{line}: imports the package root (import from the room that defines it)")
        elif other != room and other not in MAY_IMPORT[room] | BOTTOM:
            bad.append(f"{line}: {room} imports {target} (room {other!r} is not below {room!r})")
        elif other != room and _private(target, name):
            bad.append(f"{line}: private name {target}{'.' + name if name else ''} of room {other!r}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    modules = {_module_name(p): p for p in FILES}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        for _, target, name, at_top in _imports(path):
            if not at_top:
                continue
            # importing a.b.c runs a, a.b and a.b.c; an ancestor of the importer is already running, which is no
            # cycle unless a name is taken from it (there only if the ancestor ran that far: statement order)
            for i in range(1, target.count(".") + 2):
                step = ".".join(target.split(".")[:i])
                if step in modules and (step not in own or (step == target and name is not None)):
                    edges[module].add(step)
    cycles, index, low, stack, on, counter = [], {}, {}, [], set(), [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, cycles

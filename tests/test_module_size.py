"""The house's size rules (docs/architecture.md): no module of the project over 600 lines, and every module
docstring of the library says what and why in a few lines (at most 20)."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROOMS = ("lowmembp", "experiments", "workflow", "benchmarks")
MAX_LINES = 600
MAX_DOCSTRING_LINES = 20

FILES = sorted(p for room in ROOMS for p in (ROOT / room).rglob("*.py"))
LIBRARY = [p for p in FILES if p.parts[len(ROOT.parts)] == "lowmembp"]


def _rel(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_module_at_most_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{_rel(path)} has {n} lines: split it by job (docs/architecture.md)"


@pytest.mark.parametrize("path", LIBRARY, ids=_rel)
def test_module_docstring_is_short(path):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    n = len(doc.splitlines())
    assert n <= MAX_DOCSTRING_LINES, f"{_rel(path)}: module docstring of {n} lines; design detail goes to docs/"


def test_the_rules_see_the_rooms():
    assert len(LIBRARY) > 50 and any(p.name == "train.py" for p in FILES)

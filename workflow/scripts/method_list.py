"""The one list of methods, written from the registry (``lowmembp.list_methods()``) into every page that shows it:
README.md, docs/index.md and docs/methods/index.md, between the markers below (each page's links relative to it).

    python workflow/scripts/method_list.py           # write the lists again (after registering a method)
    python workflow/scripts/method_list.py --check   # exit 1 and name the pages whose list differs

tests/workflow/test_method_list.py fails while a committed list differs from the registry's, so a method registered
later cannot be missing from a page.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START = "<!-- methods: written by workflow/scripts/method_list.py from lowmembp.list_methods(); do not edit -->"
END = "<!-- /methods -->"
PAGES = {"README.md": "docs/methods/", "docs/index.md": "methods/", "docs/methods/index.md": ""}  # page -> link base


def method_page(name: str, pages_dir: Path = ROOT / "docs" / "methods") -> str | None:
    """The docs page of method ``name``: docs/methods/<name>.md, else that of the method it is a variant or part of
    (``lowmembp-act`` -> lowmembp.md, ``mesa-gelu-ln`` -> mesa.md); None without one."""
    parts = name.split("-")
    for n in range(len(parts), 0, -1):
        page = pages_dir / f"{'-'.join(parts[:n])}.md"
        if page.is_file() and page.name != "index.md":
            return page.name
    return None


def _options(options: dict) -> str:
    return ", ".join(f"`{k}`" + ("" if v is None else f" ({v})") for k, v in options.items())


def table(link_base: str = "", methods: dict[str, str] | None = None) -> str:
    """The list as a Markdown table: method, what it does (its registry description), its options with their
    defaults, its page (linked as ``link_base + page``)."""
    from lowmembp.methods.registry import list_methods, parse

    methods = list_methods() if methods is None else methods
    lines = ["| method | what it does | options (default) | page |", "|---|---|---|---|"]
    for name, description in methods.items():
        options = parse(name)[0].options if name in list_methods() else {}
        page = method_page(name)
        link = f"[{page[:-3]}]({link_base}{page})" if page else ""
        lines.append(f"| `{name}` | {description.replace('|', '/')} | {_options(options)} | {link} |")
    return "\n".join(lines)


def with_list(text: str, link_base: str, methods: dict[str, str] | None = None) -> str:
    """``text`` with the part between the markers replaced by the list; ValueError when the markers are missing."""
    if START not in text or END not in text:
        raise ValueError(f"no list markers: put {START} and {END} where the list goes")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table(link_base, methods)}\n{END}{tail}"


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose list differs from the registry's."""
    return [page for page, base in PAGES.items()
            if (root / page).read_text() != with_list((root / page).read_text(), base)]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        bad = stale()
        if bad:
            print(f"the method list differs from the registry in: {', '.join(bad)}; "
                  f"run python workflow/scripts/method_list.py", file=sys.stderr)
        return 1 if bad else 0
    for page, base in PAGES.items():
        path = ROOT / page
        new = with_list(path.read_text(), base)
        if new != path.read_text():
            path.write_text(new)
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))

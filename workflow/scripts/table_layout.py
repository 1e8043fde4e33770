"""How a pipeline table reads alone: a title that says what and on which machine, a machine line, a short caption,
one or more parts of at most :data:`MAX_COLUMNS` columns (units in the headers), and long notes as numbered footnotes
under the table, numbers rounded as their column's name says (:func:`format_table`). sweep_layouts.py and
repro_layouts.py build a :class:`Layout` per table and tables.py writes it (the CSV keeps every column, for tools); this
module writes it as Markdown (:func:`markdown`); table_html.py as HTML.

    notes = Footnotes()
    shown = pd.DataFrame({"method": ["lora" + notes.mark("a long note")], "peak (MiB)": ["12.0"]})
    markdown(Layout("Peak memory", "cpu (x86_64, 1 threads)", "caption", [Part("", shown)], notes.texts))

Markdown layout (the docs include a table from its third line on, ``--8<-- "tables/NAME.md:3:"``, so the machine
line comes along; a part with a ``section`` name is wrapped in pymdownx.snippets' section markers, so a page can
include that part alone, ``--8<-- "tables/NAME.md:SECTION"``, and its machine line, ``--8<-- "tables/NAME.md:3:3"``):

    # <title> — <machine>
    <blank>
    Machine: <machine line>
    <blank>
    <caption>, <notes>
    ### <part heading>          (where a part has one)
    <table>
    Notes:  1. <footnote> ...
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

MAX_COLUMNS = 10  # a table a person reads: at most this many columns per part (tests/workflow/test_tables.py)
NOTE_CHARS = 60  # a text column whose cells run longer than this goes into footnotes


class Footnotes:
    """Numbered notes: :meth:`mark` gives a cell's marker ``[n]`` (the same text, the same number)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def number(self, text: str) -> int:
        if text not in self.texts:
            self.texts.append(text)
        return self.texts.index(text) + 1

    def mark(self, *texts) -> str:
        """`` [1]`` / `` [1, 3]`` for the non-empty ``texts``; ``""`` when none is."""
        nums = [self.number(str(t)) for t in texts if isinstance(t, str) and t.strip()]
        return f" [{', '.join(map(str, dict.fromkeys(nums)))}]" if nums else ""


@dataclass
class Part:
    heading: str  # "" for a table of one part
    table: pd.DataFrame  # formatted: strings, '-' where nothing
    section: str = ""  # a name a docs page includes this part by (pymdownx.snippets sections), "" for none


@dataclass
class Layout:
    title: str  # what the table holds
    machine: str  # where it was measured (the records' device) or how (fake tensors)
    caption: str
    parts: list[Part]
    footnotes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines under the caption (cells, left-out records)

    @property
    def heading(self) -> str:
        return f"{self.title} — {self.machine}"

    def check(self) -> "Layout":
        wide = [(p.heading, len(p.table.columns)) for p in self.parts if len(p.table.columns) > MAX_COLUMNS]
        if wide:
            raise ValueError(f"{self.title}: parts wider than {MAX_COLUMNS} columns: {wide}")
        return self


def markdown(layout: Layout) -> str:
    lines = [f"# {layout.heading}", "", f"Machine: {layout.machine}.", ""]
    if layout.caption:
        lines += [layout.caption, ""]
    for n in layout.notes:
        lines += [n, ""]
    for part in layout.parts:
        if part.section:
            lines += [f"<!-- --8<-- [start:{part.section}] -->"]
        if part.heading:
            lines += [f"### {part.heading}", ""]
        body = part.table.to_markdown(index=False, disable_numparse=True) if len(part.table) else "(no rows)"
        lines += [body, ""]
        if part.section:
            lines += [f"<!-- --8<-- [end:{part.section}] -->", ""]
    if layout.footnotes:
        lines += ["Notes:", ""] + [f"{i}. {t}" for i, t in enumerate(layout.footnotes, 1)] + [""]
    return "\n".join(lines)


def long_text_columns(df: pd.DataFrame) -> list[str]:
    """Text columns that are notes, sources or any cell longer than :data:`NOTE_CHARS`: footnotes, not columns."""
    out = []
    for c in df.columns:
        if pd.api.types.is_numeric_dtype(df[c]):
            continue
        name = str(c).lower()
        if name in ("note", "notes", "sources", "spec") or name.endswith("source") or \
                df[c].dropna().astype(str).str.len().max() > NOTE_CHARS:
            out.append(c)
    return out


UNITS = {"MiB": "MiB", "MB": "MB", "GiB": "GiB", "KiB": "KiB", "ms": "ms", "%": "%", "pct": "%", "s": "s"}


def header(col: str, unit: str = "") -> str:
    """A CSV column's name as a header that carries its unit: ``peak_MiB_b8`` -> ``peak b8 (MiB)``,
    ``paper_share_%`` -> ``paper share (%)``; ``unit`` for a number whose name has none (a table's own unit)."""
    parts = str(col).split("_")
    found = [p for p in parts if p in UNITS]
    words = " ".join(p for p in parts if p not in UNITS)
    u = UNITS[found[0]] if found else unit
    return f"{words} ({u})" if u else words


def format_value(col: str, v) -> str:
    """A number as its column's name says: metrics 2 decimals, MiB / MB / % 1, ms 2 (1 from 100), else 3 (1 from
    100); a change of a metric or in % signed; '-' for none."""
    if pd.isna(v):
        return "-"
    if (col.startswith("metric_") and not col.startswith("metric_ratio")) or col == "change_vs_compared":
        return f"{v:+.2f}" if "change" in col else f"{v:.2f}"  # accuracy in % and perplexity alike
    if "%" in col or "MiB" in col.split("_") or col.endswith("MB") or col.endswith("_pct"):
        return f"{v:+.1f}" if "change" in col else f"{v:.1f}"
    if "_ms_" in col or col.endswith("_ms"):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"


def format_table(df: pd.DataFrame) -> pd.DataFrame:
    """Every cell of ``df`` as a string (:func:`format_value`; counts as integers), '-' where nothing."""
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            if c in ("seeds", "steps", "memory_batch", "accuracy_batch"):
                out[c] = out[c].map(lambda v: "-" if pd.isna(v) else str(int(v)))
            else:
                out[c] = out[c].map(lambda v, c=c: format_value(c, v))
        else:
            out[c] = out[c].map(lambda v: "-" if v is None or (isinstance(v, float) and np.isnan(v)) else v)
    return out


def format_number(v, fmt: str = ".3f", unit: str = "") -> str:
    """``v`` in format ``fmt`` with ``unit`` after it, '-' for none."""
    return "-" if v is None or pd.isna(v) else f"{v:{fmt}}{unit}"


def split_columns(shown: pd.DataFrame, keys: list[str], max_columns: int = MAX_COLUMNS) -> list[Part]:
    """``shown`` as parts of at most ``max_columns`` columns, each repeating the ``keys`` columns."""
    rest = [c for c in shown.columns if c not in keys]
    width = max(1, max_columns - len(keys))
    chunks = [rest[i:i + width] for i in range(0, len(rest), width)] or [[]]
    if len(chunks) == 1:
        return [Part("", shown[keys + chunks[0]])]
    return [Part(f"{chunk[0]} … {chunk[-1]}", shown[keys + chunk]) for chunk in chunks]

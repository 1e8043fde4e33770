"""A table -> a small standalone HTML page for the Snakemake report (numbers rounded, '-' for missing).

tables.py writes each table's HTML in the same job as its Markdown and CSV (:func:`page` of its
:class:`table_layout.Layout`: title with the machine, caption, parts, numbered footnotes), so the report never shows a
stale table beside fresh ones. By hand: ``python table_html.py TABLE.csv OUT.html`` (every column, rounded).
"""

import html
import sys
from pathlib import Path

import pandas as pd

STYLE = ("<style>body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}</style>")


def page(layout) -> str:
    """The HTML page of a :class:`table_layout.Layout` (its tables already formatted as strings)."""
    paras = "".join(f"<p>{html.escape(n)}</p>" for n in [f"Machine: {layout.machine}.", layout.caption,
                                                          *layout.notes] if n)
    body = ""
    for part in layout.parts:
        if part.heading:
            body += f"<h4>{html.escape(part.heading)}</h4>"
        body += part.table.to_html(index=False, border=0, escape=True)
    notes = "".join(f"<li>{html.escape(t)}</li>" for t in layout.footnotes)
    notes = f"<p>Notes:</p><ol>{notes}</ol>" if notes else ""
    title = html.escape(layout.heading)
    return (f"<html><head><meta charset='utf-8'><title>{title}</title>{STYLE}</head><body>"
            f"<h3>{title}</h3>{paras}{body}{notes}</body></html>\n")


def main(csv: str, out: str) -> None:
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    sys.path.insert(0, str(here.parents[1]))
    from lowmembp.atomic import atomic_write
    from table_layout import Layout, Part, format_table

    atomic_write(out, page(Layout(Path(csv).stem, "not stated (a CSV shown as it is)", "",
                                  [Part("", format_table(pd.read_csv(csv)))])))


if __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    main(*by_hand.arguments("python table_html.py TABLE.csv OUT.html", sys.argv[1:], 2))

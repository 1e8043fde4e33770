"""A table -> a small standalone HTML page for the Snakemake report (numbers rounded, '-' for missing).

tables.py writes each table's HTML in the same job as its Markdown and CSV (``page``), so the report never shows a
stale table beside fresh ones. By hand: ``python table_html.py TABLE.csv OUT.html``.
"""

import html
import sys
from pathlib import Path

import pandas as pd

STYLE = ("<style>body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}</style>")


def page(formatted: pd.DataFrame, title: str, notes=()) -> str:
    """The HTML page of an already formatted table (strings), with its title and note lines."""
    body = formatted.to_html(index=False, border=0, escape=True)
    paras = "".join(f"<p>{html.escape(n)}</p>" for n in notes if n)
    return (f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>{STYLE}</head><body>"
            f"<h3>{html.escape(title)}</h3>{paras}{body}</body></html>\n")


def main(csv: str, out: str) -> None:
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    sys.path.insert(0, str(here.parents[1]))
    from lowmembp.atomic import atomic_write
    from tables import _fmt

    atomic_write(out, page(_fmt(pd.read_csv(csv)), Path(csv).stem))


if __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    main(*by_hand.arguments("python table_html.py TABLE.csv OUT.html", sys.argv[1:], 2))

"""A table's CSV -> a small standalone HTML page for the Snakemake report (numbers rounded, '-' for missing)."""

import html
import sys
from pathlib import Path

import pandas as pd

HERE = Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).resolve().parent  # noqa: F821
sys.path.insert(0, str(HERE))
from tables import _atomic_write, _fmt  # noqa: E402

STYLE = ("<style>body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}</style>")


def main(csv: str, out: str) -> None:
    df = pd.read_csv(csv)
    name = Path(csv).stem
    body = _fmt(df).to_html(index=False, border=0, escape=True)
    _atomic_write(Path(out), f"<html><head><meta charset='utf-8'><title>{html.escape(name)}</title>{STYLE}"
                             f"</head><body><h3>{html.escape(name)}</h3>{body}</body></html>\n")


if "snakemake" in globals():
    main(snakemake.input[0], snakemake.output[0])  # noqa: F821
elif __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

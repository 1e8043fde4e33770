"""runs.csv (and the reproductions' CSVs) -> results/tables/<name>.md, .csv and .html.

Each table is written as CSV (every column, for tools) and, for people, as Markdown and HTML (table_html.py) that read
alone (table_layout.py). All three files come from the same call (:func:`write`), atomically (``lowmembp.atomic``), to
the paths Snakemake gives (rule outputs). This module is the entry; the tables are made in:

- table_maths.py: the sweep's tables as numbers (runs.csv -> one frame per table, the CSV's columns);
- paper_claims.py: what ours is set against (the papers' ratios; the FLOP ratio and a GPU run beside their GPU claims);
- sweep_layouts.py: how the sweep's tables read (title, machine, caption, parts, footnotes);
- repro_layouts.py: how the reproductions' tables read.

Run by Snakemake (rules run_tables, repro_table, headline), or by hand:
``python tables.py runs RUNS.csv OUTDIR`` / ``python tables.py repro NAME REPRO.csv OUTDIR`` /
``python tables.py headline RUNS.csv OUTDIR``.
"""

import os
import sys
from pathlib import Path

import pandas as pd

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
for _p in (HERE, HERE.parent, HERE.parents[1]):  # scripts, the catalogue, the library
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import catalogue  # noqa: E402
from lowmembp.atomic import atomic_write  # noqa: E402
from paper_claims import load_claims  # noqa: E402
from repro_layouts import (REPRO_CAPTIONS, REPRO_LAYOUTS, REPRO_TABLE_VIEWS, REPRO_UNITS, generic_layout,  # noqa: E402
                           repro_machine)
from sweep_layouts import headline_layout, invalid_note, machine_note, run_layout  # noqa: E402
from table_html import page  # noqa: E402
from table_layout import Footnotes, Layout, markdown, split_columns  # noqa: E402
from table_maths import RUN_TABLES, headline_table, read_runs  # noqa: E402


def write(df: pd.DataFrame, md: Path, csv: Path, layout: Layout, html: Path | None = None) -> None:
    """One table as CSV (every column of ``df``, for tools), Markdown and (given ``html``) HTML (``layout``: what a
    person reads), each written atomically."""
    layout.check()
    atomic_write(csv, df.to_csv(index=False))
    if html is not None:
        atomic_write(html, page(layout))
    atomic_write(md, markdown(layout))


def write_run_tables(runs_csv: str | Path, outputs: dict[str, dict[str, str]]) -> None:
    """``outputs``: table name -> {"md": path, "csv": path, "html": path} (the rule's outputs)."""
    runs, invalid = read_runs(runs_csv)
    claims = load_claims()
    for name, out in outputs.items():
        df = RUN_TABLES[name](runs, claims)
        write(df, out["md"], out["csv"], run_layout(name, df, runs, machine_note(runs) + invalid_note(invalid)),
              out.get("html"))


def write_headline(runs_csv: str | Path, out: dict[str, str]) -> pd.DataFrame:
    """The headline table (rule headline) to ``out`` = {"md", "csv", "html"}; returns it."""
    runs, invalid = read_runs(runs_csv)
    df = headline_table(runs, load_claims())
    write(df, out["md"], out["csv"], headline_layout(df, runs, machine_note(runs) + invalid_note(invalid)),
          out.get("html"))
    return df


def write_repro_table(name: str, repro_csv: str | Path, out: dict[str, str], title: str | None = None) -> None:
    """A reproduction's rows (experiments.repro: paper value, ours, ratio and a note already side by side) -> table.

    A table without a ``ratio`` column gets one (ours / paper) from its first numeric ``paper...`` / ``ours...``
    pair."""
    import platform

    df = pd.read_csv(repro_csv)
    repro = catalogue.REPRO_BY_STEM.get(name)
    caption = REPRO_CAPTIONS.get(name, "")
    shown = None
    if name in REPRO_TABLE_VIEWS:
        import importlib
        module, fn = REPRO_TABLE_VIEWS[name].split(":")
        df, shown = getattr(importlib.import_module(module), fn)(df)
    if "ratio" not in df.columns:
        num = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]
        p = next((c for c in num if c.startswith("paper")), None)
        o = next((c for c in num if c.startswith("ours")), None)
        if p and o:
            df.insert(df.columns.get_loc(o) + 1, "ratio", df[o] / df[p])
            caption = caption or f"`ratio` = {o} / {p}."
    fn = Footnotes()
    if shown is not None:  # a summary view of the rows (REPRO_TABLE_VIEWS); the comparison rides in the method cell
        if "compared_with" in shown.columns:
            shown = shown.assign(method=shown["method"] + " (vs " + shown.pop("compared_with") + ")")
        parts = split_columns(shown, list(shown.columns[:2]))
    else:
        parts = (REPRO_LAYOUTS[name](df, fn) if name in REPRO_LAYOUTS
                 else generic_layout(df, fn, REPRO_UNITS.get(name, "")))
    import torch

    made = (f"From `python -m experiments.repro {repro.name}`; table made on {platform.machine()} "
            f"({os.cpu_count()} cores), torch {torch.__version__}." if repro else "")
    write(df, out["md"], out["csv"], Layout(title or (repro.title if repro else name.replace("_", " ")),
                                            repro_machine(repro), caption, parts, fn.texts, [made] if made else []),
          out.get("html"))


def _in(outdir: str, stem: str) -> dict[str, str]:
    """By hand: the table's files in OUTDIR (the command line names the folder)."""
    return {ext: str(Path(outdir) / f"{stem}.{ext}") for ext in catalogue.TABLE_FORMATS}


if "snakemake" in globals():
    sm = snakemake  # noqa: F821
    if sm.params.kind == "runs":
        write_run_tables(sm.input.runs, {name: {"md": md, "csv": csv, "html": html} for name, md, csv, html in
                                         zip(sm.params.names, sm.output.md, sm.output.csv, sm.output.html)})
    else:
        write_repro_table(sm.params.name, sm.input[0],
                          {"md": sm.output.md, "csv": sm.output.csv, "html": sm.output.html}, sm.params.title)
elif __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(prog="python workflow/scripts/tables.py",
                                  description="Write tables by hand (the pipeline's rules run the same functions).")
    sub = cli.add_subparsers(dest="kind", required=True)
    for kind, what in (("runs", "the sweep's tables from runs.csv"), ("headline", "the headline table from runs.csv")):
        c = sub.add_parser(kind, help=what)
        c.add_argument("runs", help="runs.csv")
        c.add_argument("outdir", help="the folder the .md, .csv and .html files go to")
    c = sub.add_parser("repro", help="a reproduction's table from its CSV")
    c.add_argument("name", help="the reproduction (e.g. fig1, grad-fidelity)")
    c.add_argument("csv", help="its CSV (python -m experiments.repro NAME --csv ...)")
    c.add_argument("outdir", help="the folder the .md, .csv and .html files go to")
    a = cli.parse_args()
    if a.kind == "runs":
        write_run_tables(a.runs, {name: _in(a.outdir, name) for name in RUN_TABLES})
    elif a.kind == "headline":
        write_headline(a.runs, _in(a.outdir, catalogue.HEADLINE.name))
    else:
        stem = a.name.replace("-", "_")
        write_repro_table(stem, a.csv, _in(a.outdir, stem), catalogue.REPRO_BY_STEM[stem].title
                          if stem in catalogue.REPRO_BY_STEM else None)

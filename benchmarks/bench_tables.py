"""A benchmark's table as the pipeline writes its own (workflow/scripts/table_layout.py): ``OUT/<stem>.csv`` with
every column, for tools, and ``OUT/<stem>.md`` that reads alone — a title, the machine line (CPU model, cores,
torch, the load average over the run), a caption, the command, then one part per table, each a pymdownx.snippets
section a docs page can include alone.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine_line(load: list[float]) -> str:
    import torch

    sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
    from make_reference import cpu_name  # the reference set's own CPU line

    return (f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, load average (1 min) "
            f"{min(load):.1f}–{max(load):.1f} during the run")


def write_benchmark_table(df, out: str | Path, stem: str, title: str, *, caption: str, command: str,
                          load: list[float], parts: list[tuple]) -> None:
    """``parts``: (heading, formatted DataFrame, section name) each."""
    sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
    from table_layout import Layout, Part, markdown

    from lowmembp.atomic import atomic_write

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layout = Layout(title, machine_line(load), caption, [Part(h, t, section=s) for h, t, s in parts],
                    notes=[f"Command: `{command}`."]).check()
    atomic_write(out / f"{stem}.csv", df.to_csv(index=False))
    atomic_write(out / f"{stem}.md", markdown(layout))
    print(f"wrote {out / f'{stem}.md'} and .csv")

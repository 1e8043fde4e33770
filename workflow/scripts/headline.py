"""runs.csv -> the headline the report opens with: tables/headline.{md,csv,html} (table_maths.headline_table) and
figures/headline.png (plots.headline_figure) — per method, the memory it saves, the step time it costs and the
metric it changes against the method it is compared with, ours beside the papers'.

Run by Snakemake (rule headline, workflow/rules/report.smk) or by hand: ``python headline.py RUNS.csv OUTDIR``
(writes OUTDIR/tables/headline.* and OUTDIR/figures/headline.png).
"""
import sys
from pathlib import Path

import matplotlib.pyplot as plt

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
sys.path.insert(0, str(HERE))
import plots  # noqa: E402
import table_maths  # noqa: E402
import tables  # noqa: E402


def main(runs_csv, table_out: dict[str, str], figure_out: str) -> None:
    df = tables.write_headline(runs_csv, table_out)
    runs, _ = table_maths.read_runs(runs_csv)
    plots.save(plots.headline_figure(runs, df), figure_out)


if "snakemake" in globals():
    plt.switch_backend("Agg")
    sm = snakemake  # noqa: F821
    main(sm.input.runs, {"md": sm.output.md, "csv": sm.output.csv, "html": sm.output.html}, sm.output.png)
elif __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    runs_csv, outdir = by_hand.arguments("python headline.py RUNS.csv OUTDIR", sys.argv[1:], 2)
    plt.switch_backend("Agg")
    out = Path(outdir)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    main(runs_csv, {ext: str(out / "tables" / f"headline.{ext}") for ext in tables.catalogue.TABLE_FORMATS},
         str(out / "figures" / "headline.png"))

"""JSON records (one per cell) -> results/runs.csv, one row per cell.

Each record is read with ``experiments.record.load`` (the record layout's one reader: checked against
experiments/record.schema.json) and flattened with ``experiments.record_columns.flatten`` (its one flattening). A record
that does not read back — truncated, empty, not JSON, a JSON list, fields missing or of the wrong type — becomes a row
with status ``invalid``, the reason in ``message``, its path in ``record`` and its cell (task, model, method, batch
size, seed) read from the path, so a broken cell is visible instead of crashing the tables or being dropped (the path's
optimizer segment, absent for the default optimizer: workflow/sweep_config.py CELL). (The pipeline sets such records
aside and remakes their cells before it aggregates, see workflow/rules/common.smk; an ``invalid`` row means a record was
damaged after that or aggregated by hand.) The CSV is written atomically (``lowmembp.atomic``).

Run by Snakemake (rule aggregate), or by hand: ``python aggregate.py OUT.csv RECORD.json ...`` (exit 1 when a record
could not be read, the CSV written all the same; 2 without an output and at least one record).
"""

import logging
import sys
from pathlib import Path

import pandas as pd

HERE = (Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).parent).resolve()  # noqa: F821
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))
from experiments.record import RecordError, load  # noqa: E402
from experiments.record_columns import COLUMNS, flatten  # noqa: E402
from lowmembp.atomic import atomic_open  # noqa: E402
from sweep_config import CELL_PATH, optimizer_of  # noqa: E402

INVALID = "invalid"


def invalid_row(path: str, reason: str) -> dict:
    """The row of a record that does not read back: its cell from its path, status invalid, the reason."""
    row = {c: None for c in COLUMNS}
    m = CELL_PATH.search(str(path).replace("\\", "/"))
    if m:
        row.update(m.groupdict())
        row["batch_size"], row["seed"] = int(row["batch_size"]), int(row["seed"])
        row["optimizer"] = optimizer_of(row["optimizer"])
    row.update(status=INVALID, message=reason)
    return row


def row_of(path: str | Path) -> dict:
    try:
        row = flatten(load(path).to_dict())
    except RecordError as err:
        row = invalid_row(str(path), str(err))
    row["record"] = str(path)
    return row


def aggregate(paths: list[str | Path]) -> pd.DataFrame:
    rows = [row_of(p) for p in paths]
    df = pd.DataFrame(rows, columns=None if rows else COLUMNS + ["record"])
    cols = [c for c in COLUMNS if c != "record"]
    extra = sorted(c for c in df.columns if c not in cols and c != "record")
    df = df.reindex(columns=cols + extra + ["record"])
    if len(df):
        df = df.sort_values(["task", "model", "method", "optimizer", "batch_size", "seed"], kind="stable",
                            na_position="last")
    return df.reset_index(drop=True)


def write_csv(df: pd.DataFrame, out: str | Path) -> None:
    with atomic_open(out, "w") as fh:
        df.to_csv(fh, index=False)


def main(out: str, paths: list[str]) -> pd.DataFrame:
    df = aggregate(paths)
    write_csv(df, out)
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    logging.info("%d records -> %s (%s)", len(df), out, counts)
    for r in df[df["status"] == INVALID].itertuples():
        logging.warning("invalid record %s: %s", r.record, r.message)
    return df


def cli(argv: list[str]) -> int:
    """By hand: write runs.csv; exit 1 when a record could not be read (its row says why, the CSV is written)."""
    df = main(argv[0], argv[1:])
    bad = int((df["status"] == INVALID).sum())
    if bad:
        print(f"error: {bad} of {len(df)} record(s) could not be read: the rows with status {INVALID!r} in {argv[0]} "
              f"say why", file=sys.stderr)
        return 1
    return 0


if "snakemake" in globals():
    logging.basicConfig(filename=snakemake.log[0], level=logging.INFO, format="%(message)s")  # noqa: F821
    main(snakemake.output[0], list(snakemake.input.records))  # noqa: F821
elif __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(cli(by_hand.arguments("python aggregate.py OUT.csv RECORD.json ...", sys.argv[1:], 2, more=True)))

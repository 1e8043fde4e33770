"""JSON records (one per cell) -> results/runs.csv, one row per cell.

Each record is checked against experiments/record.schema.json; a record that does not validate becomes a row with
status ``invalid`` and the reason, so a broken cell is visible instead of silently dropped. The CSV is written to a
temporary file and renamed, so an interrupted aggregation leaves no half-written table.

Run by Snakemake (rule aggregate), or by hand: ``python aggregate.py OUT.csv RECORD.json ...``.
"""

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import pandas as pd

try:
    import jsonschema
except ImportError:  # validation is a check, not a requirement
    jsonschema = None

HERE = Path(snakemake.scriptdir) if "snakemake" in globals() else Path(__file__).resolve().parent  # noqa: F821
SCHEMA = HERE.parents[1] / "experiments" / "record.schema.json"
COLUMNS = ["task", "model", "method", "batch_size", "seed", "status", "message", "steps", "epochs", "dtype",
           "seq_len", "peak_bytes", "peak_how", "activation_bytes", "step_time_p20", "step_time_p50",
           "step_time_p80", "samples_per_s", "tokens_per_s", "final_loss", "metric_name", "metric_value",
           "metric_split", "device", "torch", "triton", "timm", "transformers", "git_commit", "hostname",
           "started_at", "finished_at", "record"]


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def flatten(rec: dict, path: str) -> dict:
    """One record -> one flat row; peak-memory categories and activation kinds become their own columns."""
    row = {
        "task": rec.get("task"), "model": rec.get("model"), "method": rec.get("method"),
        "batch_size": rec.get("batch_size"), "seed": rec.get("seed"), "status": rec.get("status"),
        "message": rec.get("message"), "steps": rec.get("steps"), "epochs": rec.get("epochs"),
        "dtype": rec.get("dtype"), "seq_len": rec.get("seq_len"),
        "peak_bytes": _get(rec, "peak_memory", "bytes"), "peak_how": _get(rec, "peak_memory", "how"),
        "activation_bytes": _get(rec, "activation_bytes", "total"),
        "step_time_p20": _get(rec, "step_time_s", "p20"), "step_time_p50": _get(rec, "step_time_s", "p50"),
        "step_time_p80": _get(rec, "step_time_s", "p80"),
        "samples_per_s": _get(rec, "throughput", "samples_per_s"),
        "tokens_per_s": _get(rec, "throughput", "tokens_per_s"),
        "final_loss": rec.get("final_loss"),
        "metric_name": _get(rec, "metric", "name"), "metric_value": _get(rec, "metric", "value"),
        "metric_split": _get(rec, "metric", "split"),
        "started_at": rec.get("started_at"), "finished_at": rec.get("finished_at"), "record": path,
    }
    for k in ("device", "torch", "triton", "timm", "transformers", "git_commit", "hostname"):
        row[k] = _get(rec, "env", k)
    for cat, b in (_get(rec, "peak_memory", "by_category") or {}).items():
        row[f"peak_{cat}_bytes"] = b
    for kind, b in (_get(rec, "activation_bytes", "by_kind") or {}).items():
        row[f"act_{kind}_bytes"] = b
    for opt, v in (rec.get("options") or {}).items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            row[f"opt_{opt}"] = v
    return row


def load(path: Path, schema: dict | None) -> dict:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"status": "invalid", "message": f"unreadable record: {e}", "record": str(path)}
    if schema is not None and jsonschema is not None:
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(rec), key=lambda e: list(e.path))
        if errors:
            row = flatten(rec, str(path))
            where = "/".join(map(str, errors[0].absolute_path)) or "(top)"
            row.update(status="invalid", message=f"record does not match the schema at {where}: {errors[0].message}")
            return row
    return flatten(rec, str(path))


def aggregate(paths: list[str | Path], schema_path: Path | None = SCHEMA) -> pd.DataFrame:
    schema = json.loads(Path(schema_path).read_text()) if schema_path and Path(schema_path).exists() else None
    rows = [load(Path(p), schema) for p in paths]
    df = pd.DataFrame(rows)
    extra = sorted(c for c in df.columns if c not in COLUMNS)
    df = df.reindex(columns=COLUMNS[:-1] + extra + ["record"])
    if len(df):
        df = df.sort_values(["task", "model", "method", "batch_size", "seed"], kind="stable", na_position="last")
    return df.reset_index(drop=True)


def write_csv_atomic(df: pd.DataFrame, out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        df.to_csv(tmp, index=False)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(out: str, paths: list[str], schema_path: Path | None = SCHEMA) -> pd.DataFrame:
    df = aggregate(paths, schema_path)
    write_csv_atomic(df, out)
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    logging.info("%d records -> %s (%s)", len(df), out, counts)
    return df


if "snakemake" in globals():
    logging.basicConfig(filename=snakemake.log[0], level=logging.INFO, format="%(message)s")  # noqa: F821
    main(snakemake.output[0], list(snakemake.input.records), snakemake.input.schema)  # noqa: F821
elif __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1], sys.argv[2:])

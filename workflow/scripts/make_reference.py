"""Copy a finished run's runs.csv, tables and reproductions into results/reference/ with a MACHINE.md that says
which machine made them, when, with which command and config, and how long it took (from the records' and the
benchmark files' timestamps). Only pipeline outputs are copied: nothing here is typed in by hand. Every path written
is one of the rule's outputs (input i is copied to output i), each written atomically."""
import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

import pandas as pd
import yaml

from lowmembp.atomic import atomic_write


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def sweep_span(runs: pd.DataFrame) -> tuple[str, str, float]:
    start = pd.to_datetime(runs["started_at"], utc=True, errors="coerce").min()
    end = pd.to_datetime(runs["finished_at"], utc=True, errors="coerce").max()
    return str(start), str(end), (end - start).total_seconds()


def copy(sources, targets) -> None:
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} files to copy to {len(targets)} destinations")
    for src, dst in zip(sources, targets):
        atomic_write(dst, Path(src).read_bytes())


def main(runs_csv, tables, repro, benchmarks, machine_out, runs_out, config, tables_out, repro_out) -> None:
    runs = pd.read_csv(runs_csv)
    copy(tables, tables_out)
    copy(repro, repro_out)
    start, end, span = sweep_span(runs)
    repro_s = sum(float(pd.read_csv(b, sep="\t")["s"].iloc[0]) for b in benchmarks)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    devices = ", ".join(sorted(set(runs["device"].dropna().astype(str))))
    lines = [
        f"# {devices or 'unknown device'}: {cpu_name()}, {os.cpu_count()} cores, {platform.system()}",
        "",
        "The reference result set the notebooks fall back to when `results/runs.csv` does not exist. Made by the",
        "pipeline's default configuration (config/config.yaml), not by hand, with the command:",
        "",
        "    snakemake --cores all && snakemake --cores 1 reference",
        "",
        "Beside them, made by their own commands, each named in its table: `evidence/` (config/evidence.yaml), the",
        "reproductions of config/repro.yaml and `benchmarks/` (benchmarks/cpu_ops.py, benchmarks/cpu_steps.py).",
        "",
        f"- device (from the records): {devices}",
        f"- CPU: {cpu_name()}, {os.cpu_count()} logical cores; "
        f"host {platform.node()}; Python {platform.python_version()}",
        f"- torch {runs['torch'].dropna().iloc[0] if runs['torch'].notna().any() else '?'}, "
        f"git commit {commit or '?'} (records: {', '.join(sorted(set(runs['git_commit'].dropna().astype(str))))})",
        f"- cells: {len(runs)} ({runs['status'].value_counts().to_dict()})",
        f"- training jobs ran from {start} to {end}: {span / 60:.1f} min; "
        f"reproductions {repro_s / 60:.1f} min of job time",
        f"- made {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        "",
        "Config:",
        "",
        "```yaml",
        yaml.safe_dump(config, sort_keys=False).strip(),
        "```",
        "",
    ]
    atomic_write(machine_out, "\n".join(lines))
    atomic_write(runs_out, runs.to_csv(index=False))


if "snakemake" in globals():
    sm = snakemake  # noqa: F821
    main(sm.input.runs, sm.input.tables, sm.input.repro, sm.input.benchmarks, sm.output.machine, sm.output.runs,
         dict(sm.params.config), sm.output.tables, sm.output.repro)

"""Figures the planner takes from outside the estimate, each with where it came from: GPU sizes, the allocator /
workspace margin, and step-time ratios measured by the pipeline's runs.

Margin: the estimate counts exact tensor bytes; a GPU also needs the allocator's rounding and fragmentation (a
fraction of those bytes) and a fixed reserve (CUDA context, cuBLAS/cuDNN workspaces). Until a GPU run measures
them, the defaults below are rules of thumb, said so in every plan. A measured margin is read from
``results/gpu/margin.json``: ``{"fraction": 0.07, "reserved_bytes": 805306368, "source": "what measured it"}``.

Measured ratios: a run records ``step_time_p50``; for each (task, model, batch size, device) with a baseline run,
``p50(method) / p50(baseline)`` (median over seeds), from ``results/runs.csv`` if the pipeline ran here, else the
reference set ``results/reference/runs.csv`` kept in git.
"""
from __future__ import annotations

import csv
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

__all__ = ["parse_bytes", "margin", "measured_ratios", "DEFAULT_FRACTION", "DEFAULT_RESERVED", "GiB"]

GiB = 1 << 30
DEFAULT_FRACTION = 0.10
DEFAULT_RESERVED = 1 * GiB
MARGIN_FILE = Path("results") / "gpu" / "margin.json"
RUNS_FILES = (Path("results") / "runs.csv", Path("results") / "reference" / "runs.csv")
_UNITS = {"": GiB, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": GiB, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_bytes(text: str | int | float) -> int:
    """``"24GiB"`` -> bytes (binary KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB, B; a bare number is GiB)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory size {text!r}: write a number and a unit, e.g. 24GiB, 40GB, 81920MiB "
                         "(a bare number is GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def margin(fraction: float | None = None, reserved: int | str | None = None, *,
           margin_file: str | Path | None = None) -> dict:
    """``{"fraction", "reserved_bytes", "source"}``: given values win, then a measured margin file, then defaults."""
    path = Path(margin_file) if margin_file is not None else MARGIN_FILE
    measured = {}
    if path.is_file():
        measured = json.loads(path.read_text())
        if not isinstance(measured.get("fraction"), (int, float)) or not isinstance(measured.get("reserved_bytes"),
                                                                                     int):
            raise ValueError(f"{path}: a margin file holds {{\"fraction\": float, \"reserved_bytes\": int, "
                             f"\"source\": str}}; got {measured!r}")
    parts = []
    if fraction is None:
        fraction = measured.get("fraction", DEFAULT_FRACTION)
        parts.append(f"{fraction:.0%} of the tensor bytes from " + (f"{path} ({measured.get('source', 'measured')})"
                     if "fraction" in measured else "a rule-of-thumb default (no GPU measurement yet)"))
    else:
        parts.append(f"{fraction:.0%} of the tensor bytes (given)")
    if reserved is None:
        reserved = measured.get("reserved_bytes", DEFAULT_RESERVED)
        parts.append(f"{reserved / GiB:.2f} GiB reserved (CUDA context, workspaces) from " +
                     (str(path) if "reserved_bytes" in measured else "a rule-of-thumb default"))
    else:
        reserved = parse_bytes(reserved)
        parts.append(f"{reserved / GiB:.2f} GiB reserved (given)")
    if not 0 <= float(fraction) < 10:
        raise ValueError(f"margin fraction must be in [0, 10) (0.1 = 10 %), got {fraction!r}")
    return {"fraction": float(fraction), "reserved_bytes": int(reserved), "source": "; ".join(parts)}


def measured_ratios(runs: str | Path | None = None) -> tuple[dict[str, list[dict]], str | None]:
    """``({method: [{"ratio", "where", "device"}, ...]}, file)``: measured step-time ratios to the baseline."""
    path = Path(runs) if runs is not None else next((p for p in RUNS_FILES if p.is_file()), None)
    if path is None or not path.is_file():
        return {}, None
    times: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("status") != "ok" or not row.get("step_time_p50"):
                continue
            key = (row["task"], row["model"], int(row["batch_size"]), row.get("device", ""))
            times[key][row["method"]].append(float(row["step_time_p50"]))
    out: dict[str, list[dict]] = defaultdict(list)
    for (task, model, bs, device), by_method in sorted(times.items()):
        if "baseline" not in by_method:
            continue
        base = statistics.median(by_method["baseline"])
        for method, ts in by_method.items():
            out[method].append({"ratio": statistics.median(ts) / base, "where": f"{task}/{model} bs{bs}",
                                "device": device})
    return dict(out), str(path)

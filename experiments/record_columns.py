"""A record flattened into one row of runs.csv: the one flattening (``workflow/scripts/aggregate.py`` writes runs.csv
with it; every table reads those columns).

    row = flatten(rec)        # a Record, or a dict of either schema version
    COLUMNS                   # the fixed columns, in order; the open-ended ones follow, by PREFIXES
"""
from __future__ import annotations

import dataclasses
import json

from experiments.record import Environment, Record

COLUMNS = ["task", "model", "method", "optimizer", "batch_size", "seed", "status", "message", "steps", "steps_planned",
           "epochs", "dtype", "seq_len", "peak_bytes", "peak_how", "host_peak_bytes", "host_peak_how",
           "activation_bytes",
           "step_time_p20", "step_time_p50", "step_time_p80", "step_time_n", "samples_per_s", "tokens_per_s",
           "step_time_ci95_low", "step_time_ci95_high", "reserved_peak_bytes", "capture", "synthetic_data",
           "distributed", "world_size", "peak_bytes_rank_max", "peak_bytes_rank_mean",
           "final_loss", "metric_name", "metric_value", "metric_split", "base_path", "base_sha256",
           "base_metric_before", "device", "torch", "triton", "timm", "transformers", "git_commit", "git_dirty",
           "git_diff_sha256", "hostname",
           "python", "threads", "ops_backend", "cuda", "driver", "capability", "device_memory_bytes", "notes",
           "started_at", "finished_at", "schema_version"]
"""Fixed columns of a flattened record, in order. Open-ended ones follow them, by prefix: ``peak_<category>_bytes``
and ``host_peak_<category>_bytes`` (peak by category), ``act_<kind>_bytes`` (saved bytes by kind), ``opt_<name>``
(method options), ``hp_<name>`` (hyper-parameters), ``task_<name>`` (task facts)."""
PREFIXES = ("peak_", "host_peak_", "act_", "opt_", "hp_", "task_")


def _scalar(v):
    return v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v)


def flatten(d: dict | Record) -> dict:
    """One record (a Record, or a dict of either schema version) -> one flat CSV row: :data:`COLUMNS`, then the
    prefixed ones. ``schema_version`` is the version the record was written in."""
    r = d if isinstance(d, Record) else Record.from_dict(d)
    version = r.schema_version if isinstance(d, Record) else d.get("schema_version")
    run, dev, host = r.run, r.peak.device, r.peak.host
    row = {k: getattr(run, k) for k in ("task", "model", "method", "optimizer", "batch_size", "seed", "steps",
                                         "steps_planned", "epochs", "dtype", "seq_len", "capture", "synthetic_data")}
    row.update(status=r.status, message=r.message,
               peak_bytes=dev and dev.bytes, peak_how=dev and dev.how,
               host_peak_bytes=host and host.bytes, host_peak_how=host and host.how,
               activation_bytes=r.saved_bytes and r.saved_bytes.total, final_loss=r.final_loss,
               base_path=r.base and r.base.path, base_sha256=r.base and r.base.sha256,
               base_metric_before=r.base and r.base.metric_before,
               notes="; ".join(r.notes) or None, started_at=r.started_at, finished_at=r.finished_at,
               schema_version=version)
    for k in ("p20", "p50", "p80", "n", "ci95_low", "ci95_high"):
        row[f"step_time_{k}"] = r.step_time_s and getattr(r.step_time_s, k)
    row["reserved_peak_bytes"] = dev and dev.reserved_bytes
    row["samples_per_s"] = r.throughput and r.throughput.samples_per_s
    row["tokens_per_s"] = r.throughput and r.throughput.tokens_per_s
    dp = r.distributed
    row.update(distributed=dp and dp.mode, world_size=dp.world_size if dp else 1,
               peak_bytes_rank_max=dp and dp.peak_bytes_max, peak_bytes_rank_mean=dp and dp.peak_bytes_mean)
    for k in ("name", "value", "split"):
        row[f"metric_{k}"] = r.metric and getattr(r.metric, k)
    for f in dataclasses.fields(Environment):
        row["device" if f.name == "device" else f.name] = getattr(r.environment, f.name)
    row = {c: row.get(c) for c in COLUMNS}
    for cat, b in (dev.by_category if dev else {}).items():
        row[f"peak_{cat}_bytes"] = b
    for cat, b in (host.by_category if host else {}).items():
        row[f"host_peak_{cat}_bytes"] = b
    for kind, b in (r.saved_bytes.by_kind if r.saved_bytes else {}).items():
        row[f"act_{kind}_bytes"] = b
    for k, v in r.method_options.items():
        row[f"opt_{k}"] = _scalar(v)
    for k, v in dataclasses.asdict(r.hyperparameters).items():
        row[f"hp_{k}"] = v
    for k, v in r.task_facts.items():
        row[f"task_{k}"] = _scalar(v)
    return row

"""Old records as the current layout: a schema-version-1 record (the flat layout with one mixed ``options`` object,
written before schema 2) converted to a version-2 dict, which ``experiments.record`` then checks and builds.

    d2 = from_v1(d1)        # what Record.from_dict does with a version-1 dict
"""
from __future__ import annotations

import dataclasses

from experiments.record import SCHEMA_VERSION, Environment, HyperParameters, RecordError

V1_HYPER = {f.name for f in dataclasses.fields(HyperParameters)}
V1_TASK_FACTS = ("train_pool", "test_size", "vocab", "peak_memory_error")


def _method_option_names(method) -> set | None:
    try:
        from lowmembp.methods.registry import method_options

        return set(method_options(method))
    except Exception:  # an unknown or damaged method spec: fall back to the known task facts
        return None


def from_v1(d: dict) -> dict:
    """A schema-version-1 record (flat identity, one mixed ``options`` object) as a version-2 dict."""
    def need(key):
        if key not in d:
            raise RecordError(f"(top): missing field {key!r} (schema version 1)")
        return d[key]

    options = dict(d.get("options") or {}) if isinstance(d.get("options"), dict) else {}
    hyper = {k: options.pop(k) for k in list(options) if k in V1_HYPER}
    base = None
    if "init_sha256" in options:
        meta = {k[5:]: str(options.pop(k)) for k in list(options)
                if k.startswith("init_") and k not in ("init_sha256", "init_metric_before")}
        base = {"path": str(hyper.get("init") or options.get("init") or ""), "sha256": options.pop("init_sha256"),
                "metric_before": options.pop("init_metric_before", None), "metadata": meta}
    takes = _method_option_names(d.get("method"))
    if takes is not None:  # the method's own options; the rest are what the task reported
        facts = {k: options.pop(k) for k in list(options) if k not in takes}
    else:
        facts = {k: options.pop(k) for k in list(options) if k in V1_TASK_FACTS or k == "argv"}
    notes = []
    if "peak_memory_error" in facts:
        notes.append(f"peak-memory measurement failed: {facts.pop('peak_memory_error')}")
    env = d.get("env") if isinstance(d.get("env"), dict) else {"device": "unknown"}
    env = {k: v for k, v in env.items() if k in {f.name for f in dataclasses.fields(Environment)}}
    env.setdefault("device", "unknown")
    act = d.get("activation_bytes")
    return {
        "schema_version": SCHEMA_VERSION,
        "run": {"task": need("task"), "model": need("model"), "method": need("method"),
                "batch_size": need("batch_size"), "dtype": need("dtype"), "seed": need("seed"),
                "steps": d.get("steps", 0), "seq_len": d.get("seq_len"), "epochs": d.get("epochs")},
        "status": need("status"), "message": d.get("message"),
        "method_options": options, "hyperparameters": hyper, "task_facts": facts, "base": base,
        "saved_bytes": None if act is None else {k: v for k, v in act.items() if k in ("total", "by_kind")},
        "peak": {"device": d.get("peak_memory"), "host": None},
        "step_time_s": d.get("step_time_s"), "throughput": d.get("throughput"), "final_loss": d.get("final_loss"),
        "metric": d.get("metric"), "environment": env, "notes": notes,
        "started_at": need("started_at"), "finished_at": need("finished_at"),
    }

"""One run's record (docs/design.md#record) as typed dataclasses: the one description of the layout.

    rec = Record(run=RunIdentity(...), status="ok", ...)
    write(rec, path)                  # validated, written atomically (lowmembp.atomic)
    rec = load(path)                  # a Record; RecordError with the reason if the file is damaged
    row = flatten(rec.to_dict())      # the one flattening into a CSV row; COLUMNS are its fixed columns
    d = error_record(identity, message, started)   # the crash guard's record (a dict, valid)

Sections: ``run`` (identity: task, model, method, optimizer, batch size, seq len, dtype, seed, steps),
``method_options`` (what the method spec takes, e.g. ``k``, ``rank``), ``hyperparameters`` (lr, weight decay, warm-up,
...),
``task_facts`` (what the task reported: pool sizes, ...), ``base`` (the ``--init`` weights), measurements
(``saved_bytes`` by kind, ``peak`` by category for the device and the host, ``step_time_s`` quantiles,
``throughput``), ``distributed`` (a torchrun run: mode, world size, every rank's peak), the result
(``final_loss``, ``metric``, ``status`` ok/oom/error with its ``message``), ``curve`` (the metric every N steps,
with ``--eval-every N``; null otherwise),
``environment`` and ``notes`` (warnings of the run, e.g. a failed measurement).

``record.schema.json`` is generated from these dataclasses (:func:`json_schema`; ``python -m experiments.record``
rewrites it, and a test fails when the two differ). Schema version 2; :meth:`Record.from_dict` also reads version 1
(the flat layout with a mixed ``options`` object), so old records still aggregate.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Union

SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("record.schema.json")
REPO = Path(__file__).resolve().parent.parent
Status = Literal["ok", "oom", "error"]
Dtype = Literal["fp32", "bf16", "fp16"]
Scalar = Union[int, float, str, bool, None]
# A field added after records existed, written only when it has a value: the records without it keep their bytes and
# the schema does not require it.
OMITTED_WHEN_NONE = "omitted_when_none"


class RecordError(ValueError):
    """A record that cannot be read: unreadable, truncated, not JSON, not an object, or not of the layout."""


# ----------------------------------------------------------------------------------------------------------- layout
@dataclass
class RunIdentity:
    """Which cell this is."""
    task: str
    model: str
    method: str
    batch_size: int
    dtype: Dtype
    seed: int
    steps: int = 0  # optimizer steps actually taken
    steps_planned: int | None = None
    seq_len: int | None = None  # tokens per sample (ViT: patches + cls)
    epochs: float | None = None
    optimizer: str = "adamw"  # lowmembp.methods.optimizers.OPTIMIZERS; records written before it: adamw
    # --capture: the step captured in a CUDA graph ("cuda-graphs") or compiled with torch.compile's
    # "reduce-overhead" mode; absent for an eager step (and from the records written before it)
    capture: str | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    # --synthetic-data: random weights and generated inputs of the paper's shapes (memory and speed only: no metric);
    # absent for a run on the task's data
    synthetic_data: bool | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})


@dataclass
class HyperParameters:
    """How the run was trained (the job's settings after defaults)."""
    lr: float | None = None
    lr_base: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    warmup_epochs: float | None = None
    grad_accum: int | None = None
    train_split: str | None = None
    limit: int | None = None
    eval_limit: int | None = None
    eval_batch_size: int | None = None
    max_len: int | None = None
    max_memory_mb: float | None = None
    timing_warmup: int | None = None
    threads: int | None = None
    device: str | None = None  # as asked (None: cuda when present)
    config: str | None = None
    init: str | None = None
    save_model: str | None = None


@dataclass
class BaseWeights:
    """The weights the run started from (``--init``)."""
    path: str
    sha256: str
    metric_before: float | None = None  # the base's metric on this run's test split, before training
    metadata: dict[str, str] = field(default_factory=dict)  # what the base's file says (task, steps, ...)


@dataclass
class SavedBytes:
    """Activation bytes saved for backward by one forward, by op kind."""
    total: int
    by_kind: dict[str, int]
    how: str = "lowmembp.measurement.saved.SavedTensorAccountant"


@dataclass
class PeakMemory:
    """Peak bytes of one steady training step on one memory (device or host)."""
    bytes: int
    how: str
    by_category: dict[str, int] = field(default_factory=dict)
    # CUDA: the caching allocator's reserved peak over the run (torch.cuda.max_memory_reserved); absent on a CPU
    reserved_bytes: int | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})


@dataclass
class Peak:
    """Peak memory per memory: the device the model trains on, and host memory (offloading) — each may be absent."""
    device: PeakMemory | None = None
    host: PeakMemory | None = None


@dataclass
class StepTime:
    """Wall time of the timed steps, seconds."""
    p20: float
    p50: float
    p80: float
    n: int
    how: str = ""
    # the median's 95 % interval (lowmembp.measurement.timing.median_interval: two order statistics); absent from
    # records written before it
    ci95_low: float | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    ci95_high: float | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})


@dataclass
class Throughput:
    samples_per_s: float
    tokens_per_s: float | None = None


@dataclass
class DataParallel:
    """A multi-process run (torchrun, ``--distributed``; ``experiments.distributed``): how the global batch was
    split and every rank's peak (``peak.device`` is rank 0's)."""
    mode: Literal["ddp", "fsdp"]
    world_size: int
    backend: str
    batch_per_rank: int  # --batch-size is the global batch
    peak_bytes_max: int | None = None  # over ranks
    peak_bytes_mean: float | None = None
    peak_bytes_by_rank: list[int] = field(default_factory=list)
    peak_how: str = ""


@dataclass
class Metric:
    name: str
    value: float
    split: str = ""


@dataclass
class CurvePoint:
    """The metric after ``step`` optimizer steps."""
    step: int
    metric: float
    train_loss: float | None = None  # mean training loss of the steps since the point before


@dataclass
class Curve:
    """The learning curve (``--eval-every N``): the metric on the test split every ``every`` optimizer steps and
    after the last one (that point is the record's ``metric``)."""
    every: int
    points: list[CurvePoint] = field(default_factory=list)


@dataclass
class Environment:
    device: str
    torch: str | None = None
    triton: str | None = None
    timm: str | None = None
    transformers: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None  # uncommitted changes to tracked files: git_commit alone does not name the code
    git_diff_sha256: str | None = None  # of `git diff HEAD` when dirty: two runs with equal values ran the same code
    hostname: str | None = None
    python: str | None = None
    threads: int | None = None  # torch intra-op threads
    # what lowmembp.ops ran on the run's device: "cpu" (the CPU fast path), "torch" (the PyTorch reference), "triton";
    # absent from records written before it was recorded (the reference, on a CPU)
    ops_backend: str | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    # a CUDA run: torch's CUDA version, the NVIDIA driver, the device's compute capability and memory; absent on a CPU
    cuda: str | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    driver: str | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    capability: str | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    device_memory_bytes: int | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})


@dataclass
class Record:
    run: RunIdentity
    status: Status
    started_at: str
    finished_at: str
    environment: Environment
    message: str | None = None  # the error or OOM message; None when ok
    method_options: dict[str, Any] = field(default_factory=dict)
    hyperparameters: HyperParameters = field(default_factory=HyperParameters)
    task_facts: dict[str, Any] = field(default_factory=dict)
    base: BaseWeights | None = None
    saved_bytes: SavedBytes | None = None
    peak: Peak = field(default_factory=Peak)
    step_time_s: StepTime | None = None
    throughput: Throughput | None = None  # global: every rank's samples (distributed runs)
    distributed: DataParallel | None = None
    final_loss: float | None = None
    metric: Metric | None = None
    # only with --eval-every: absent from the other records (and from those written before it)
    curve: Curve | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    notes: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return _omit_unset(self, dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: Any) -> "Record":
        """A Record from its dict (schema version 2, or version 1: converted); RecordError says what is wrong."""
        if not isinstance(d, dict):
            raise RecordError(f"a record is a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version == 1:
            d = from_v1(d)
        elif version != SCHEMA_VERSION:
            raise RecordError(f"schema_version {version!r}: this code reads versions 1 and {SCHEMA_VERSION}")
        return _build(cls, d, "")


def _omit_unset(obj, d: dict) -> dict:
    """``d`` (``asdict(obj)``) less the fields marked :data:`OMITTED_WHEN_NONE` that are None, at every depth."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get(OMITTED_WHEN_NONE) and value is None:
            del d[f.name]
        elif dataclasses.is_dataclass(value):
            _omit_unset(value, d[f.name])
    return d


# ------------------------------------------------------------------------------- typed reading, and the JSON schema
def _hints(cls) -> dict:
    return typing.get_type_hints(cls, globalns=vars(sys.modules[__name__]))


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _build(tp, value, where: str):
    """``value`` (parsed JSON) as type ``tp``; RecordError naming the place and the problem otherwise."""
    here = where or "(top)"
    if tp is Any:
        return value
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _build(arg, value, where)
            except RecordError as err:
                errors.append(str(err))
        raise RecordError(errors[0] if len(errors) == 1 else f"{here}: {value!r} is none of "
                                                               f"{', '.join(_name(a) for a in args)}")
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise RecordError(f"{here}: {value!r} is not one of {', '.join(map(repr, typing.get_args(tp)))}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecordError(f"{here}: expected an object ({tp.__name__}), got {type(value).__name__}")
        hints = _hints(tp)
        unknown = sorted(set(value) - set(hints))
        if unknown:
            raise RecordError(f"{here}: unknown field(s) {', '.join(unknown)} in {tp.__name__}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _build(hints[f.name], value[f.name], f"{where}/{f.name}" if where else f.name)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordError(f"{here}: missing field {f.name!r} of {tp.__name__}")
        return tp(**kwargs)
    origin = typing.get_origin(tp)
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise RecordError(f"{here}: expected an object, got {type(value).__name__}")
        return {str(k): _build(vt, v, f"{where}/{k}") for k, v in value.items()}
    if origin is list:
        (it,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise RecordError(f"{here}: expected a list, got {type(value).__name__}")
        return [_build(it, v, f"{where}/{i}") for i, v in enumerate(value)]
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - a type this reader does not know: a layout mistake
        raise TypeError(f"record layout: unsupported type {tp!r} at {here}")
    if not ok:
        raise RecordError(f"{here}: expected {_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _schema_of(tp) -> dict:
    if tp is Any:
        return {}
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(tp))
        simple = [_schema_of(a) for a in args]
        if all(set(s) == {"type"} and isinstance(s["type"], str) for s in simple):
            kinds = [s["type"] for s in simple] + (["null"] if nullable else [])
            return {"type": kinds if len(kinds) > 1 else kinds[0]}
        return {"anyOf": simple + ([{"type": "null"}] if nullable else [])}
    if typing.get_origin(tp) is Literal:
        return {"enum": list(typing.get_args(tp))}
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        fields = dataclasses.fields(tp)
        out = {"type": "object", "additionalProperties": False,
               "properties": {f.name: _schema_of(hints[f.name]) for f in fields},
               "required": [f.name for f in fields if not f.metadata.get(OMITTED_WHEN_NONE)]}
        if tp.__doc__ and not tp.__doc__.startswith(tp.__name__ + "("):
            out["description"] = " ".join(tp.__doc__.split())
        return out
    if typing.get_origin(tp) is dict:
        return {"type": "object", "additionalProperties": _schema_of(typing.get_args(tp)[1])}
    if typing.get_origin(tp) is list:
        return {"type": "array", "items": _schema_of(typing.get_args(tp)[0])}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]}


def json_schema() -> dict:
    """The JSON schema of a written (version 2) record, generated from :class:`Record`."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "lowmembp/record.schema.json",
              "title": "One training run (one cell of the sweep), schema version 2",
              "description": "Generated from experiments/record.py (python -m experiments.record); "
                             "written atomically by `python -m experiments.train`; see docs/design.md#record."}
    schema.update(_schema_of(Record))
    schema["properties"]["schema_version"] = {"const": SCHEMA_VERSION}
    return schema


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(record: dict) -> Record:
    """The Record of ``record`` (a dict), or RecordError saying what is wrong."""
    return Record.from_dict(record)


# ------------------------------------------------------------------------------------------------- schema version 1
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


# ------------------------------------------------------------------------------------------------ the CSV flattening
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


# ---------------------------------------------------------------------------------------------- reading and writing
def load(path: str | os.PathLike) -> Record:
    """The record at ``path``; RecordError (with the path and the reason) if it is unreadable or damaged."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RecordError(f"{path}: unreadable ({err})") from err
    if not text.strip():
        raise RecordError(f"{path}: empty file")
    try:
        data = json.loads(text)
    except ValueError as err:
        raise RecordError(f"{path}: not valid JSON, truncated or damaged ({err})") from err
    try:
        return Record.from_dict(data)
    except RecordError as err:
        raise RecordError(f"{path}: {err}") from None


def write(record: Record | dict, path: str | os.PathLike) -> Path:
    """Check ``record`` against the layout and write it to ``path`` atomically (JSON, indented)."""
    from lowmembp.atomic import atomic_write

    d = record.to_dict() if isinstance(record, Record) else record
    Record.from_dict(d)  # refuse to write what could not be read back
    return atomic_write(path, json.dumps(d, indent=2) + "\n")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def error_record(identity: RunIdentity | dict, message: str, started: str, *, environment: dict | None = None,
                 status: Status = "error", **sections) -> dict:
    """A valid record of a run that failed before reporting (the crash guard's, or the job's own last resort).

    ``identity``: a :class:`RunIdentity` or a dict of its fields (missing ones: task/model/method ``"?"``, batch
    size 1, dtype fp32, seed 0); ``sections``: any other Record fields already known (e.g. ``task_facts``)."""
    if isinstance(identity, RunIdentity):
        identity = dataclasses.asdict(identity)
    known = {f.name for f in dataclasses.fields(RunIdentity)}
    ident = {"task": "?", "model": "?", "method": "?", "batch_size": 1, "dtype": "fp32", "seed": 0}
    ident.update({k: v for k, v in dict(identity).items() if k in known and v is not None})
    env = environment or {"device": "unknown (the job died before reporting)", "hostname": platform.node()}
    d = {"schema_version": SCHEMA_VERSION, "run": ident, "status": status, "message": message,
         "started_at": started, "finished_at": now(), "environment": env, **sections}
    return Record.from_dict(d).to_dict()


# ------------------------------------------------------------------------------------------------------ environment
def _version(dist: str) -> str | None:
    """The installed version from the package metadata (no import: importing transformers or timm costs seconds)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


SENT_COMMIT = "LOWMEMBP_GIT_COMMIT"  # "<sha>" or "<sha> dirty": the commit a copied tree (stale or no .git) came from


def _sent_commit() -> tuple[str, bool | None] | None:
    line = os.environ.get(SENT_COMMIT, "").strip()
    if not line:
        return None
    sha, _, rest = line.partition(" ")
    return sha, ("dirty" in rest) if rest else None


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD's commit of the repository this file is in: one ``git rev-parse`` with a short timeout; where
    ``$LOWMEMBP_GIT_COMMIT`` is set (a tree copied to another machine, e.g. the GPU run's), that commit instead."""
    sent = _sent_commit()
    if sent:
        return sent[0]
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=3)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@lru_cache(maxsize=1)
def git_changes() -> tuple[bool | None, str | None]:
    """(dirty, sha256 of ``git diff HEAD``) of the repository's tracked files; (None, None) without git. With
    ``$LOWMEMBP_GIT_COMMIT``: its dirty flag, and no diff hash (the copy's .git cannot say)."""
    import hashlib

    sent = _sent_commit()
    if sent:
        return sent[1], None
    try:
        out = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--binary"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if out.returncode != 0:
        return None, None
    return (True, hashlib.sha256(out.stdout).hexdigest()[:16]) if out.stdout else (False, None)


@lru_cache(maxsize=1)
def nvidia_driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return lines[0].strip() if lines else None


def environment(device=None) -> Environment:
    """What the run ran on. Never raises: a part that cannot be read is recorded as such."""
    dirty, diff = git_changes()
    env = Environment(device="unknown", hostname=platform.node(), python=platform.python_version(),
                      git_commit=git_commit(), git_dirty=dirty, git_diff_sha256=diff, triton=_version("triton"),
                      timm=_version("timm"), transformers=_version("transformers"))
    try:
        import torch

        env.torch = torch.__version__
        env.threads = torch.get_num_threads()
        kind = getattr(device, "type", None) or (str(device) if device is not None else "cpu")
        if kind.startswith("cuda"):
            env.device = torch.cuda.get_device_name(device)
            props = torch.cuda.get_device_properties(device)
            env.cuda, env.driver = torch.version.cuda, nvidia_driver()
            env.capability, env.device_memory_bytes = f"{props.major}.{props.minor}", int(props.total_memory)
        else:
            env.device = f"cpu ({platform.machine()}, {env.threads} threads)"  # processor() runs `uname -p`
    except Exception as err:  # e.g. cuda asked for on a machine without it
        env.device = f"unknown ({type(err).__name__}: {err})"
    try:
        import torch

        from lowmembp.ops.backend import backend_for

        env.ops_backend = backend_for(torch.empty(0, device=device if device is not None else "cpu"))
    except Exception as err:  # e.g. LOWMEMBP_BACKEND=cpu for a CUDA run
        env.ops_backend = f"unknown ({type(err).__name__}: {err})"
    return env


if __name__ == "__main__":  # regenerate record.schema.json from the dataclasses
    from lowmembp.atomic import atomic_write

    atomic_write(SCHEMA_PATH, json.dumps(json_schema(), indent=2) + "\n")
    print(f"wrote {SCHEMA_PATH}")

"""One run's record (docs/design.md#record) as typed dataclasses: the one description of the layout.

    rec = Record(run=RunIdentity(...), status="ok", ...)
    write(rec, path)                  # validated, written atomically (lowmembp.atomic)
    rec = load(path)                  # a Record; RecordError with the reason if the file is damaged
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
(the flat layout with a mixed ``options`` object: ``experiments.record_migration``), so old records still aggregate.
The other jobs around the record: ``experiments.record_columns`` (the flattening into a runs.csv row),
``experiments.provenance`` (what the run ran on: machine, versions, git commit).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Union

SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("record.schema.json")
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
            from experiments.record_migration import from_v1  # imported here: that module imports this one

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


if __name__ == "__main__":  # regenerate record.schema.json from the dataclasses
    from lowmembp.atomic import atomic_write

    atomic_write(SCHEMA_PATH, json.dumps(json_schema(), indent=2) + "\n")
    print(f"wrote {SCHEMA_PATH}")

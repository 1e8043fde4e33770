"""One run's record (docs/design.md#record): its layout as typed dataclasses, read and checked through the JSON schema
it ships (``record.schema.json``), and written atomically.

    rec = Record(run=RunIdentity(...), status="ok", ...)
    write(rec, path)                  # checked against the schema, written atomically (lowmembp.atomic)
    rec = load(path)                  # a Record; RecordError with the reason if the file is damaged
    rec = Record.from_dict(d)         # the same from a dict (version 1 converted first)
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

The dataclasses are the one description of the layout: ``record.schema.json`` is generated from them
(``python -m experiments.record_schema``; a test fails when the two differ), and a record is checked against that
file (``jsonschema``) before the dataclasses are built from it. Schema version 2; :meth:`Record.from_dict` also reads
version 1 (``experiments.record_migration``), so old records still aggregate. The other jobs around the record:
``experiments.record_columns`` (the flattening into a runs.csv row), ``experiments.provenance`` (what the run ran
on: machine, versions, git commit).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
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
        return _build(cls, validate(d))


def _omit_unset(obj, d: dict) -> dict:
    """``d`` (``asdict(obj)``) less the fields marked :data:`OMITTED_WHEN_NONE` that are None, at every depth."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get(OMITTED_WHEN_NONE) and value is None:
            del d[f.name]
        elif dataclasses.is_dataclass(value):
            _omit_unset(value, d[f.name])
    return d


# -------------------------------------------------------------------------------- reading: the schema, then the types
@lru_cache(maxsize=1)
def schema() -> dict:
    """``record.schema.json``: the JSON schema of a (version 2) record."""
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=1)
def _validator():
    import jsonschema  # the `experiments` extra

    return jsonschema.Draft202012Validator(schema())


# JSON schema types as the messages name them (Python's names, as a record's writer knows them)
_KINDS = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "object": "an object",
          "array": "a list", "null": "null"}


def _expected(sub: dict) -> str:
    """What a (sub)schema takes, in words: ``int or null``, ``an object (BaseWeights)``, ``one of 'ok', 'oom'``."""
    if "title" in sub:
        return f"an object ({sub['title']})"
    if "enum" in sub:
        return f"one of {', '.join(map(repr, sub['enum']))}"
    if "anyOf" in sub:
        return " or ".join(_expected(s) for s in sub["anyOf"])
    kinds = sub.get("type", [])
    return " or ".join(_KINDS[k] for k in ([kinds] if isinstance(kinds, str) else kinds)) or "anything"


def _reason(err) -> str:
    """A jsonschema error as the reader says it: the field's path (``run/batch_size``), then what is wrong."""
    where = "/".join(map(str, err.absolute_path)) or "(top)"
    value, sub = err.instance, err.schema
    if err.validator == "required":
        missing = [k for k in err.validator_value if k not in value]
        return f"{where}: missing field {missing[0]!r} of {sub.get('title', 'the section')}"
    if err.validator == "additionalProperties":
        unknown = sorted(set(value) - set(sub.get("properties", {})))
        return f"{where}: unknown field(s) {', '.join(unknown)} in {sub.get('title', 'the section')}"
    if err.validator == "enum":
        return f"{where}: {value!r} is not {_expected(sub)}"
    if err.validator in ("type", "anyOf"):
        return f"{where}: expected {_expected(sub)}, got {type(value).__name__} {value!r}"
    return f"{where}: {err.message}"  # pragma: no cover - a keyword the generated schema does not use


def validate(d: dict) -> dict:
    """``d`` (a version-2 record as a dict) checked against ``record.schema.json``; RecordError naming the field and
    what is wrong otherwise (the most relevant error, as ``jsonschema.exceptions.best_match`` picks it)."""
    from jsonschema.exceptions import best_match

    err = best_match(_validator().iter_errors(d))
    if err is not None:
        raise RecordError(_reason(err))
    return d


def _build(tp, value):
    """``value`` (checked against the schema) as type ``tp``: the nested dataclasses built, the numbers of float
    fields made floats and those of int fields ints (JSON schema's integer takes ``4.0``). The layout's unions are all
    ``X | None``."""
    if value is None or tp is Any:
        return value
    if typing.get_origin(tp) in (Union, types.UnionType):
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{k: _build(hints[k], v) for k, v in value.items()})
    if typing.get_origin(tp) is list:
        return [_build(typing.get_args(tp)[0], v) for v in value]
    if typing.get_origin(tp) is dict:
        return {k: _build(typing.get_args(tp)[1], v) for k, v in value.items()}
    return float(value) if tp is float else int(value) if tp is int else value


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

"""experiments.record: the typed record read and checked through its schema, damaged files, writing, the crash
guard's record."""
from __future__ import annotations

import dataclasses
import json
import stat

import jsonschema
import pytest

from experiments import record as R
from experiments.record_columns import flatten
from lowmembp.atomic import file_mode
from record_samples import full_record


def test_round_trip_and_the_schema_agree():
    rec = full_record()
    d = rec.to_dict()
    assert d["schema_version"] == 2
    jsonschema.Draft202012Validator(R.schema()).validate(d)
    assert R.Record.from_dict(json.loads(json.dumps(d))) == rec
    jsonschema.Draft202012Validator(R.schema()).validate(R.Record.from_dict({**d, "base": None}).to_dict())



def test_a_curve_is_written_only_when_there_is_one():
    d = full_record().to_dict()
    assert "curve" not in d  # a run without --eval-every: the record's bytes as before the field existed
    assert "curve" not in R.schema()["required"] and "run" in R.schema()["required"]
    curve = R.Curve(every=2, points=[R.CurvePoint(step=2, metric=0.5, train_loss=1.5),
                                     R.CurvePoint(step=3, metric=0.75)])
    rec = dataclasses.replace(full_record(), curve=curve)
    d = rec.to_dict()
    assert d["curve"] == {"every": 2, "points": [{"step": 2, "metric": 0.5, "train_loss": 1.5},
                                                 {"step": 3, "metric": 0.75, "train_loss": None}]}
    jsonschema.Draft202012Validator(R.schema()).validate(d)
    assert R.Record.from_dict(json.loads(json.dumps(d))) == rec
    d["curve"]["points"][0]["metric"] = "high"
    with pytest.raises(R.RecordError, match="curve/points/0/metric"):
        R.Record.from_dict(d)



@pytest.mark.parametrize("change, needle", [
    (lambda d: d["run"].pop("task"), "missing field 'task'"),
    (lambda d: d["run"].update(batch_size="4"), "run/batch_size: expected int"),
    (lambda d: d["run"].update(batch_size=True), "expected int"),
    (lambda d: d.update(status="fine"), "'fine' is not one of"),
    (lambda d: d.update(extra=1), "unknown field(s) extra"),
    (lambda d: d["peak"]["device"].update(bytes=1.5), "peak/device/bytes"),
    (lambda d: d.update(schema_version=7), "schema_version 7"),
    (lambda d: d.update(base=3), "base: expected an object (BaseWeights) or null, got int 3"),
    (lambda d: d["peak"]["device"].pop("bytes"), "peak/device: missing field 'bytes' of PeakMemory"),
    (lambda d: d["saved_bytes"]["by_kind"].update(act="4"), "saved_bytes/by_kind/act: expected int, got str '4'"),
])
def test_from_dict_refuses_what_the_schema_refuses(change, needle):
    d = full_record().to_dict()
    change(d)
    with pytest.raises(R.RecordError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        R.Record.from_dict(d)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(R.schema()).validate(d)


def test_a_record_written_before_the_later_fields_reads_them_as_their_defaults():
    """A field added to the layout with a default (run.optimizer, steps_planned, distributed, ...) is not required by
    the schema, which says the default: a version-2 record written before it reads as that default."""
    d = full_record().to_dict()
    for key in ("steps", "steps_planned", "seq_len", "epochs", "optimizer"):
        del d["run"][key]
    for key in ("message", "method_options", "hyperparameters", "task_facts", "base", "distributed", "notes"):
        del d[key]
    jsonschema.Draft202012Validator(R.schema()).validate(d)
    rec = R.Record.from_dict(d)
    assert (rec.run.optimizer, rec.run.steps, rec.run.seq_len, rec.distributed, rec.notes) == ("adamw", 0, None, None,
                                                                                              [])
    assert rec.hyperparameters == R.HyperParameters() and rec.method_options == {}
    run = R.schema()["properties"]["run"]
    assert "optimizer" not in run["required"] and run["properties"]["optimizer"]["default"] == "adamw"
    assert "schema_version" in R.schema()["required"]


def test_numbers_read_as_their_fields_types():
    """JSON schema's integer takes a whole number written as ``4.0``: it reads as the int 4; an int in a float field
    reads as a float."""
    d = full_record().to_dict()
    d["run"]["batch_size"], d["final_loss"] = 4.0, 1
    rec = R.Record.from_dict(d)
    assert rec.run.batch_size == 4 and type(rec.run.batch_size) is int and type(rec.final_loss) is float


@pytest.mark.parametrize("content, needle", [
    ("", "empty file"), ('{"schema_version": 2, "run": {', "not valid JSON"), ("[1, 2]", "got list"),
    ("3.5", "got float"), ('{"schema_version": 1, "model": "x"}', "missing field"),
])
def test_load_damaged_files_raise_record_error_with_the_path(tmp_path, content, needle):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(R.RecordError, match=needle) as err:
        R.load(path)
    assert str(path) in str(err.value)
    with pytest.raises(R.RecordError, match="unreadable"):
        R.load(tmp_path / "missing.json")



def test_write_then_load_and_readable_permissions(tmp_path):
    out = tmp_path / "runs" / "r.json"
    R.write(full_record(), out)
    assert R.load(out) == full_record()
    assert stat.S_IMODE(out.stat().st_mode) == file_mode()  # 0o666 & ~umask, not mkstemp's 0600
    bad = full_record().to_dict()
    bad["status"] = "nope"
    with pytest.raises(R.RecordError):
        R.write(bad, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()



def test_error_record_is_valid_and_fills_unknown_identity():
    d = R.error_record({"task": "mnist5k", "method": "mesa", "batch_size": 4, "seed": None, "steps": 2}, "boom",
                       R.now(), task_facts={"argv": ["--x"]})
    jsonschema.Draft202012Validator(R.schema()).validate(d)
    rec = R.Record.from_dict(d)
    assert (rec.run.task, rec.run.model, rec.run.seed, rec.run.steps, rec.status, rec.message) == \
        ("mnist5k", "?", 0, 2, "error", "boom")
    ident = R.RunIdentity(task="t", model="m", method="baseline", batch_size=2, dtype="bf16", seed=1)
    assert R.Record.from_dict(R.error_record(ident, "x", "s")).run == ident



def test_gpu_fields_are_omitted_when_unset_and_read_back_when_set():
    """The fields of a CUDA run (reserved peak, the median's interval, driver, capture, synthetic data) are absent
    from a CPU record, so its layout is the one before them; set, they validate and flatten into their columns."""
    d = full_record().to_dict()
    for section, key in (("run", "capture"), ("run", "synthetic_data"), ("environment", "driver"),
                         ("environment", "cuda")):
        assert key not in d[section]
    d["run"].update(capture="cuda-graphs", synthetic_data=True)
    d["environment"].update(cuda="13.0", driver="580.1", capability="9.0", device_memory_bytes=80 * 2**30)
    d["step_time_s"] = {"p20": 0.02, "p50": 0.021, "p80": 0.022, "n": 20, "how": "cuda events", "ci95_low": 0.0205,
                        "ci95_high": 0.0215}
    d["peak"]["device"]["reserved_bytes"] = 123
    jsonschema.Draft202012Validator(R.schema()).validate(d)
    row = flatten(d)
    assert (row["capture"], row["synthetic_data"], row["driver"], row["reserved_peak_bytes"],
            row["step_time_ci95_low"]) == ("cuda-graphs", True, "580.1", 123, 0.0205)
    assert R.Record.from_dict(d).to_dict() == d

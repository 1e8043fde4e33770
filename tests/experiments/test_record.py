"""experiments.record: the typed record, its generated schema, version-1 records, damaged files, the one flattening."""
from __future__ import annotations

import copy
import dataclasses
import json
import stat

import jsonschema
import pytest

from experiments import record as R
from lowmembp.atomic import file_mode
from backends import force_backend

# a version-1 record as the job wrote it before schema 2 (tweets-lm, lora+lowmembp, 3 steps), trimmed env
V1 = {
    "schema_version": 1, "model": "llama-tiny", "method": "lora+lowmembp", "task": "tweets-lm", "batch_size": 4,
    "seq_len": 32, "dtype": "fp32", "seed": 0, "steps": 3, "epochs": None,
    "options": {"rank": 2, "lr": 0.01, "weight_decay": 0.01, "warmup_steps": 6, "train_split": "train",
                "save_model": None, "grad_accum": 1, "limit": 48, "eval_limit": 8, "max_len": 32,
                "max_memory_mb": None, "config": None, "train_pool": 48, "test_size": 8, "vocab": "bytes"},
    "status": "ok", "message": None,
    "peak_memory": {"bytes": 7910508, "how": "cpu storage tracker (exact bytes)",
                    "by_category": {"parameters": 3506560, "gradients": 0, "optimizer_state": 156384,
                                    "activations": 3981324, "temporaries": 266240, "other": 0}},
    "activation_bytes": {"total": 4024324, "by_kind": {"act": 44032, "norm": 69632, "attention": 868352,
                                                        "linear": 1499136, "product": 1409024, "other": 134148}},
    "step_time_s": {"p20": 0.0446, "p50": 0.0446, "p80": 0.0446, "n": 1, "how": "perf_counter per step"},
    "throughput": {"samples_per_s": 89.59, "tokens_per_s": 2866.9}, "final_loss": 5.6089,
    "metric": {"name": "perplexity", "value": 251.11, "split": "test (8)"},
    "env": {"device": "cpu (x86_64, 1 threads)", "torch": "2.14.1+cu130", "triton": "3.8.0", "timm": "1.0.31",
            "transformers": "5.24.0", "git_commit": None, "hostname": "vm"},
    "started_at": "2026-12-01T08:15:40+00:00", "finished_at": "2026-12-01T08:15:44+00:00",
}


def full_record() -> R.Record:
    return R.Record(
        run=R.RunIdentity(task="mnist5k", model="vit-mnist", method="tokentune", batch_size=4, dtype="fp16", seed=3,
                          steps=5, steps_planned=5, seq_len=17),
        status="ok", started_at="a", finished_at="b", environment=R.Environment(device="cpu", threads=1),
        method_options={"k": 3, "targets": ["qkv", "fc1"]}, hyperparameters=R.HyperParameters(lr=1e-3, max_len=9),
        task_facts={"train_pool": 48, "max_len": 7},
        base=R.BaseWeights(path="b.safetensors", sha256="ab", metric_before=0.5, metadata={"steps": "3"}),
        saved_bytes=R.SavedBytes(total=10, by_kind={"act": 4, "norm": 6}),
        peak=R.Peak(device=R.PeakMemory(bytes=100, how="t", by_category={"activations": 60, "parameters": 40}),
                    host=R.PeakMemory(bytes=7, how="h")),
        step_time_s=R.StepTime(p20=1.0, p50=2.0, p80=3.0, n=4, how="x"),
        throughput=R.Throughput(samples_per_s=2.0, tokens_per_s=34.0), final_loss=0.25,
        metric=R.Metric(name="accuracy", value=0.75, split="test (8)"), notes=["a note"])


def test_schema_file_is_the_one_generated_from_the_dataclasses():
    # a field added to a dataclass and not to the file (or the reverse) fails here: `python -m experiments.record`
    assert R.schema() == R.json_schema(), "record.schema.json is stale: run `python -m experiments.record`"


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
])
def test_from_dict_refuses_what_the_schema_refuses(change, needle):
    d = full_record().to_dict()
    change(d)
    with pytest.raises(R.RecordError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        R.Record.from_dict(d)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(R.schema()).validate(d)


def test_version_1_records_still_load_with_their_sections_split():
    rec = R.Record.from_dict(copy.deepcopy(V1))
    assert (rec.run.task, rec.run.method, rec.run.steps, rec.run.seq_len) == ("tweets-lm", "lora+lowmembp", 3, 32)
    assert rec.method_options == {"rank": 2}
    assert rec.hyperparameters.lr == 0.01 and rec.hyperparameters.eval_limit == 8
    assert rec.task_facts == {"train_pool": 48, "test_size": 8, "vocab": "bytes"}
    assert rec.peak.device.bytes == 7910508 and rec.peak.host is None
    assert rec.saved_bytes.total == 4024324 and rec.environment.hostname == "vm"
    jsonschema.Draft202012Validator(R.schema()).validate(rec.to_dict())


def test_version_1_base_and_crash_guard_records():
    v1 = copy.deepcopy(V1)
    v1["options"].update(init="b.safetensors", init_sha256="ff", init_metric_before=40.5, init_task="tweets-lm",
                         init_steps="60")
    rec = R.Record.from_dict(v1)
    assert rec.base == R.BaseWeights(path="b.safetensors", sha256="ff", metric_before=40.5,
                                     metadata={"task": "tweets-lm", "steps": "60"})
    guard = {"schema_version": 1, "model": "?", "method": "?", "task": "?", "batch_size": 1, "seq_len": None,
             "dtype": "fp32", "seed": 0, "steps": 0, "epochs": None, "options": {"argv": ["--task", "x"]},
             "status": "error", "message": "died", "peak_memory": None, "activation_bytes": None,
             "step_time_s": None, "throughput": None, "final_loss": None, "metric": None,
             "env": {"device": "unknown (the job died before reporting)", "hostname": "vm"},
             "started_at": "a", "finished_at": "b"}
    rec = R.Record.from_dict(guard)
    assert rec.status == "error" and rec.task_facts == {"argv": ["--task", "x"]}


def test_flatten_has_fixed_columns_first_and_prefixed_sections():
    row = R.flatten(full_record().to_dict())
    assert list(row)[:len(R.COLUMNS)] == R.COLUMNS
    assert (row["task"], row["peak_bytes"], row["host_peak_bytes"], row["activation_bytes"]) == \
        ("mnist5k", 100, 7, 10)
    assert (row["step_time_p50"], row["metric_value"], row["base_metric_before"], row["notes"]) == \
        (2.0, 0.75, 0.5, "a note")
    assert (row["peak_activations_bytes"], row["act_norm_bytes"], row["opt_k"], row["opt_targets"]) == \
        (60, 6, 3, '["qkv", "fc1"]')
    assert (row["hp_max_len"], row["task_max_len"], row["hp_lr"]) == (9, 7, 1e-3)  # no collision any more
    extra = [c for c in row if c not in R.COLUMNS]
    assert all(c.startswith(R.PREFIXES) for c in extra)
    assert R.flatten(full_record()) == row
    v1 = R.flatten(copy.deepcopy(V1))
    assert (v1["opt_rank"], v1["hp_lr"], v1["task_train_pool"], v1["peak_bytes"], v1["schema_version"]) == \
        (2, 0.01, 48, 7910508, 1)


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


def test_environment_never_raises():
    env = R.environment("cuda:7")  # no such device here (or anywhere)
    assert isinstance(env, R.Environment) and env.device and env.torch
    assert dataclasses.asdict(R.environment("cpu"))["device"].startswith("cpu")


def test_ops_backend_is_recorded_and_records_without_it_still_valid(monkeypatch):
    """A run's record says which ops ran on its device; a record written before the field existed is valid (JSON
    schema and loader) and flattens with it empty."""
    force_backend(monkeypatch, None)
    assert R.environment("cpu").ops_backend == "cpu"
    force_backend(monkeypatch, "torch")
    assert R.environment("cpu").ops_backend == "torch"
    force_backend(monkeypatch, "nonsense")
    env = R.environment("cpu")
    assert env.ops_backend.startswith("unknown (ValueError") and env.device.startswith("cpu")
    d = full_record().to_dict()
    assert "ops_backend" not in R.schema()["properties"]["environment"]["required"]
    d["environment"].pop("ops_backend", None)  # unset: omitted by to_dict
    jsonschema.Draft202012Validator(R.schema()).validate(d)
    assert R.Record.from_dict(d).environment.ops_backend is None and R.flatten(d)["ops_backend"] is None


def test_the_columns_tables_read_since_version_1_are_still_there():
    v1_columns = ["task", "model", "method", "batch_size", "seed", "status", "message", "steps", "epochs", "dtype",
                  "seq_len", "peak_bytes", "peak_how", "activation_bytes", "step_time_p20", "step_time_p50",
                  "step_time_p80", "samples_per_s", "tokens_per_s", "final_loss", "metric_name", "metric_value",
                  "metric_split", "device", "torch", "triton", "timm", "transformers", "git_commit", "hostname",
                  "started_at", "finished_at"]
    assert [c for c in R.COLUMNS if c in v1_columns] == v1_columns
    assert len(set(R.COLUMNS)) == len(R.COLUMNS)


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
    row = R.flatten(d)
    assert (row["capture"], row["synthetic_data"], row["driver"], row["reserved_peak_bytes"],
            row["step_time_ci95_low"]) == ("cuda-graphs", True, "580.1", 123, 0.0205)
    assert R.Record.from_dict(d).to_dict() == d


def test_a_copied_tree_names_the_commit_it_was_sent_from(monkeypatch):
    R.git_commit.cache_clear()
    R.git_changes.cache_clear()
    monkeypatch.setenv("LOWMEMBP_GIT_COMMIT", "abc123 dirty")
    try:
        assert R.git_commit() == "abc123" and R.git_changes() == (True, None)
    finally:
        R.git_commit.cache_clear()
        R.git_changes.cache_clear()

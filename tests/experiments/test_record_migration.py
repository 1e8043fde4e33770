"""experiments.record_migration: version-1 records still load, their sections split."""
from __future__ import annotations

import copy

import jsonschema

from experiments import record as R
from record_samples import V1


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


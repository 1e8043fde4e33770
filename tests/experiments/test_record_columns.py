"""experiments.record_columns: the one flattening of a record into a runs.csv row."""
from __future__ import annotations

import copy

from experiments.record_columns import COLUMNS, PREFIXES, flatten
from record_samples import V1, full_record


def test_flatten_has_fixed_columns_first_and_prefixed_sections():
    row = flatten(full_record().to_dict())
    assert list(row)[:len(COLUMNS)] == COLUMNS
    assert (row["task"], row["peak_bytes"], row["host_peak_bytes"], row["activation_bytes"]) == \
        ("mnist5k", 100, 7, 10)
    assert (row["step_time_p50"], row["metric_value"], row["base_metric_before"], row["notes"]) == \
        (2.0, 0.75, 0.5, "a note")
    assert (row["peak_activations_bytes"], row["act_norm_bytes"], row["opt_k"], row["opt_targets"]) == \
        (60, 6, 3, '["qkv", "fc1"]')
    assert (row["hp_max_len"], row["task_max_len"], row["hp_lr"]) == (9, 7, 1e-3)  # no collision any more
    extra = [c for c in row if c not in COLUMNS]
    assert all(c.startswith(PREFIXES) for c in extra)
    assert flatten(full_record()) == row
    v1 = flatten(copy.deepcopy(V1))
    assert (v1["opt_rank"], v1["hp_lr"], v1["task_train_pool"], v1["peak_bytes"], v1["schema_version"]) == \
        (2, 0.01, 48, 7910508, 1)



def test_the_columns_tables_read_since_version_1_are_still_there():
    v1_columns = ["task", "model", "method", "batch_size", "seed", "status", "message", "steps", "epochs", "dtype",
                  "seq_len", "peak_bytes", "peak_how", "activation_bytes", "step_time_p20", "step_time_p50",
                  "step_time_p80", "samples_per_s", "tokens_per_s", "final_loss", "metric_name", "metric_value",
                  "metric_split", "device", "torch", "triton", "timm", "transformers", "git_commit", "hostname",
                  "started_at", "finished_at"]
    assert [c for c in COLUMNS if c in v1_columns] == v1_columns
    assert len(set(COLUMNS)) == len(COLUMNS)


"""experiments.provenance: what a run ran on, for its record's environment section."""
from __future__ import annotations

import dataclasses

import jsonschema

from backends import force_backend
from experiments import provenance as P
from experiments import record as R
from experiments.record_columns import flatten
from record_samples import full_record


def test_environment_never_raises():
    env = P.capture_environment("cuda:7")  # no such device here (or anywhere)
    assert isinstance(env, R.Environment) and env.device and env.torch
    assert dataclasses.asdict(P.capture_environment("cpu"))["device"].startswith("cpu")



def test_ops_backend_is_recorded_and_records_without_it_still_valid(monkeypatch):
    """A run's record says which ops ran on its device; a record written before the field existed is valid (JSON
    schema and loader) and flattens with it empty."""
    force_backend(monkeypatch, None)
    assert P.capture_environment("cpu").ops_backend == "cpu"
    force_backend(monkeypatch, "torch")
    assert P.capture_environment("cpu").ops_backend == "torch"
    force_backend(monkeypatch, "nonsense")
    env = P.capture_environment("cpu")
    assert env.ops_backend.startswith("unknown (ValueError") and env.device.startswith("cpu")
    d = full_record().to_dict()
    assert "ops_backend" not in R.schema()["properties"]["environment"]["required"]
    d["environment"].pop("ops_backend", None)  # unset: omitted by to_dict
    jsonschema.Draft202012Validator(R.schema()).validate(d)
    assert R.Record.from_dict(d).environment.ops_backend is None and flatten(d)["ops_backend"] is None



def test_a_copied_tree_names_the_commit_it_was_sent_from(monkeypatch):
    P.read_git_commit.cache_clear()
    P.read_git_changes.cache_clear()
    monkeypatch.setenv("LOWMEMBP_GIT_COMMIT", "abc123 dirty")
    try:
        assert P.read_git_commit() == "abc123" and P.read_git_changes() == (True, None)
    finally:
        P.read_git_commit.cache_clear()
        P.read_git_changes.cache_clear()

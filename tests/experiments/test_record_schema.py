"""experiments.record_schema: record.schema.json is the one generated from the record's dataclasses."""
from __future__ import annotations

from experiments import record as R
from experiments.record_schema import json_schema


def test_schema_file_is_the_one_generated_from_the_dataclasses():
    # a field added to a dataclass and not to the file (or the reverse) fails here:
    # `python -m experiments.record_schema` rewrites the file
    assert R.schema() == json_schema(), "record.schema.json is stale: run `python -m experiments.record_schema`"


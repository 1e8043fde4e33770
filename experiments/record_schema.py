"""``record.schema.json`` generated from the record's dataclasses (``experiments.record``), their one description.

    python -m experiments.record_schema      # rewrite experiments/record.schema.json after changing a dataclass

tests/experiments/test_record_schema.py fails when the file and :func:`json_schema` differ. Only this rewrite and that
test use this module: records are read and checked through the file.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal, Union

from experiments.record import SCHEMA_PATH, SCHEMA_VERSION, Record


def schema_of(tp) -> dict:
    """The JSON schema of the type ``tp`` of the layout (a dataclass: an object titled with its name)."""
    if tp is Any:
        return {}
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(tp))
        simple = [schema_of(a) for a in args]
        if all(set(s) == {"type"} and isinstance(s["type"], str) for s in simple):
            kinds = [s["type"] for s in simple] + (["null"] if nullable else [])
            return {"type": kinds if len(kinds) > 1 else kinds[0]}
        return {"anyOf": simple + ([{"type": "null"}] if nullable else [])}
    if typing.get_origin(tp) is Literal:
        return {"enum": list(typing.get_args(tp))}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = dataclasses.fields(tp)
        out = {"title": tp.__name__, "type": "object", "additionalProperties": False,
               "properties": {f.name: {**schema_of(hints[f.name]), **_default(f)} for f in fields},
               "required": [f.name for f in fields if not _default(f)]}
        if tp.__doc__ and not tp.__doc__.startswith(tp.__name__ + "("):
            out["description"] = " ".join(tp.__doc__.split())
        return out
    if typing.get_origin(tp) is dict:
        return {"type": "object", "additionalProperties": schema_of(typing.get_args(tp)[1])}
    if typing.get_origin(tp) is list:
        return {"type": "array", "items": schema_of(typing.get_args(tp)[0])}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]}


def _default(f: dataclasses.Field) -> dict:
    """``{"default": value}`` for a field that has one (a record without the field reads as that: the records written
    before it was added), else ``{}``: the field is required."""
    if f.default is not dataclasses.MISSING:
        return {"default": f.default}
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return {"default": dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value}
    return {}


def json_schema() -> dict:
    """The JSON schema of a written (version 2) record, generated from :class:`experiments.record.Record`."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "lowmembp/record.schema.json",
              "title": "Record",
              "description": f"One training run (one cell of the sweep), schema version {SCHEMA_VERSION}. Generated "
                             "from the dataclasses of experiments/record.py (python -m experiments.record_schema); "
                             "written atomically by `python -m experiments.train`; read and checked through this "
                             "file by experiments.record.load; see docs/design.md#record.",
              **schema_of(Record)}
    schema["properties"]["schema_version"] = {"const": SCHEMA_VERSION}
    schema["required"].append("schema_version")  # a record without it is of no version this code reads
    return schema


def write_schema() -> None:
    """Rewrite ``record.schema.json`` from the dataclasses."""
    from lowmembp.atomic import atomic_write

    atomic_write(SCHEMA_PATH, json.dumps(json_schema(), indent=2) + "\n")
    print(f"wrote {SCHEMA_PATH}")


if __name__ == "__main__":
    write_schema()

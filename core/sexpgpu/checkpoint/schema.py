"""The schemas of ``experiment.json`` and ``state.json``, and reading JSON a checkpoint
holds without trusting it: nesting is bounded before anything walks it, and every
record is checked against its schema (JSON Schema, by ``jsonschema``) before use.

What a schema cannot say (a path listed twice, states of a parameter that is not
there, the step against the folder's name) is checked in
:mod:`sexpgpu.checkpoint.records`.
"""

from __future__ import annotations

import json
from typing import Any

from sexpgpu.checkpoint.keys import E_TOO_DEEP
from sexpgpu.errors import CheckpointError

MAX_DEPTH = 32
"""The deepest nesting read from a checkpoint's JSON; sexpgpu writes at most 6 (a knob
holding a list), and walking deeper JSON is how a forged file exhausts the stack."""

_MAX_INT = 2**63 - 1
"""Integers beyond int64 are no count, seed or position sexpgpu writes (``10**30`` is a forgery)."""

SLUG_PATTERN = r"^[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?-[0-9a-f]{6}$"
"""The slugs ``sexpgpu.metrics.new_slug`` makes: a file stem and 6 hex digits, one folder name."""

_COUNT = {"type": "integer", "minimum": 0, "maximum": _MAX_INT}
_INT = {"type": "integer", "minimum": -_MAX_INT - 1, "maximum": _MAX_INT}
# A knob, counter or pass name: a symbol of a `.sx` file, so no space, separator or control.
_NAME = {"type": "string", "pattern": r"^[^\s/\\\x00-\x1f\x7f]+$", "maxLength": 200}
_TEXT = {"type": "string", "maxLength": 4096}
_CRC32C = {"type": "string", "pattern": r"^[A-Za-z0-9+/]{6}==$"}

# A JSON value with every integer in range (knob values, loader positions).
_VALUE = {
    "anyOf": [
        {"type": ["string", "boolean", "null"]},
        {"type": "number", "not": {"type": "integer"}},
        _INT,
        {"type": "array", "items": {"$ref": "#/$defs/value"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
    ]
}

# A knob's value: any number the writer can write, a float of any size (1e20, -0.0)
# or an integer of any length a `.sx` file may hold, since the run took it; JSON
# Schema counts 1e20 as an integer, so the int64 bound of _VALUE cannot apply here.
_KNOB_VALUE = {
    "anyOf": [
        {"type": ["string", "boolean", "null", "number"]},
        {"type": "array", "items": {"$ref": "#/$defs/knob"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/knob"}},
    ]
}

_PARAM = {
    "type": "object",
    "required": ["path", "shape", "dtype", "trainable"],
    "properties": {
        "path": {"type": "string"},
        "shape": {"type": "array", "items": _COUNT, "maxItems": 64},
        "dtype": {"enum": ["f32", "bf16"]},
        "trainable": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "load": {
            "type": "object",
            # the identity of the file read, which a resume compares: a run always
            # writes both (E-CKPT-003 for an entry without them)
            "required": ["uri", "size", "version"],
            "properties": {
                "uri": {"type": "string"},
                "tensor": {"type": ["string", "null"]},
                "size": _COUNT,
                "version": {"type": "string", "minLength": 1},
            },
        },
    },
}

EXPERIMENT_SCHEMA: dict[str, Any] = {
    "$defs": {"value": _VALUE, "knob": _KNOB_VALUE},
    "type": "object",
    "required": ["format", "params", "sources", "knobs", "choices", "slug"],
    "properties": {
        "format": _COUNT,
        "sexpgpu": _TEXT,
        "run": _TEXT,
        "file": _TEXT,
        "slug": {"type": "string", "pattern": SLUG_PATTERN, "maxLength": 200},
        "finished": {"type": "boolean"},
        "written": {"type": "number", "minimum": 0},
        "sources": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "sha256"],
                "properties": {
                    "name": {**_TEXT, "pattern": r"^[^\x00-\x1f\x7f]+$"},
                    "sha256": {"type": "string", "pattern": r"^[0-9a-f]{64}$"},
                    # a file's real path, or its path in a bundle (escaped when shown)
                    "path": {**_TEXT, "minLength": 1},
                },
            },
        },
        "variant": _TEXT,
        "knobs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "value"],
                "properties": {"name": _NAME, "value": {"$ref": "#/$defs/knob"}, "source": _TEXT},
            },
        },
        "params": {"type": "array", "items": _PARAM},
        "states": {
            "type": "object",
            "additionalProperties": {
                "type": "array",
                "items": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
            },
        },
        "counters": {"type": "array", "items": _NAME},
        "precision": _TEXT,
        "seed": _INT,
        "devices": {**_COUNT, "minimum": 1},
        "nodes": {**_COUNT, "minimum": 1},
        "choices": {"type": "object", "additionalProperties": _TEXT},
        "files": {
            "type": "object",
            "propertyNames": {"enum": ["params.safetensors", "states.safetensors", "state.json"]},
            "additionalProperties": {
                "type": "object",
                "required": ["size", "crc32c"],
                "properties": {"size": _COUNT, "crc32c": _CRC32C},
            },
        },
    },
}
"""What ``experiment.json`` may hold (docs/checkpoints.md); keys it does not name are kept."""

STATE_SCHEMA: dict[str, Any] = {
    "$defs": {"value": _VALUE, "knob": _KNOB_VALUE},
    "type": "object",
    "required": ["step", "stage", "records", "seed"],
    "properties": {
        "step": _COUNT,
        "stage": _COUNT,
        "records": _COUNT,
        "seed": _INT,
        "counters": {"type": "object", "additionalProperties": _COUNT},
        "loader": {
            "anyOf": [
                {"type": "null"},
                {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
            ]
        },
        "evals_pending": {"type": "array", "items": _NAME, "uniqueItems": True},
    },
}
"""What ``state.json`` may hold."""

_VALIDATORS: dict[int, Any] = {}  # by the schema's id; made when first asked (see violation)


def too_deep(where: str) -> CheckpointError:
    """The error for JSON at ``where`` nested beyond :data:`MAX_DEPTH`."""
    return CheckpointError(
        f"{where} is damaged: its JSON is nested deeper than {MAX_DEPTH} levels", code=E_TOO_DEEP
    )


def nesting_depth(value: Any) -> int:
    """How deep parsed JSON ``value`` nests (stopping once past :data:`MAX_DEPTH`),
    walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            todo.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def load_json(data: bytes | memoryview, where: str, damaged: Any) -> Any:
    """``data`` decoded as JSON, nested at most :data:`MAX_DEPTH` deep.

    ``damaged(where, what)`` makes the error for bytes that are not JSON; JSON
    nested too deep is ``E-CKPT-007``, never a ``RecursionError``.
    """
    try:
        value = json.loads(bytes(data).decode("utf-8"))
    except RecursionError:
        raise too_deep(where) from None
    except (UnicodeDecodeError, ValueError):
        raise damaged(where, "it is not valid JSON (truncated?)") from None
    if nesting_depth(value) > MAX_DEPTH:
        raise too_deep(where)
    return value


def _said(error: Any) -> str:
    """One short line for a schema violation: where in the record, and what is wrong,
    without echoing the (untrusted, possibly huge) value itself."""
    place = "/".join(str(p) for p in error.absolute_path) or "the record"
    kind = error.validator
    if kind == "required":
        missing = error.message.split(" is a required")[0].strip("'\"")
        return (
            f"its {missing} is missing"
            if place == "the record"
            else f"{place}/{missing} is missing"
        )
    wanted = {
        "type": lambda v: f"is not {' or '.join(v) if isinstance(v, list) else v}",
        "pattern": lambda v: "is not of the form sexpgpu writes",
        "minimum": lambda v: f"is below {v}",
        "maximum": lambda v: f"is above {v}",
        "enum": lambda v: "is not one of " + ", ".join(json.dumps(x) for x in v),
        "maxLength": lambda v: f"is longer than {v} characters",
        "maxItems": lambda v: f"has more than {v} items",
        "uniqueItems": lambda v: "names one twice",
        "anyOf": lambda v: "is not a value sexpgpu writes",
        "propertyNames": lambda v: "names a file a checkpoint does not have",
    }.get(str(kind))
    return f"{place} {wanted(error.validator_value)}" if wanted else f"{place}: {kind}"


def violation(record: Any, schema: dict[str, Any]) -> str | None:
    """The first way ``record`` breaks ``schema`` in one line, or ``None`` when it fits."""
    # jsonschema is imported here, not with the module: a run that reads no
    # checkpoint never pays its import (about 0.3 s, with attrs)
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    if id(schema) not in _VALIDATORS:
        _VALIDATORS[id(schema)] = Draft202012Validator(schema)
    error = best_match(_VALIDATORS[id(schema)].iter_errors(record))
    return None if error is None else _said(error)

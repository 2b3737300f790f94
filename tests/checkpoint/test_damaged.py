"""Damaged and foreign checkpoints are refused with one clear line, never taken for a fresh start."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from sexpgpu import checkpoint as ckpt
from sexpgpu.errors import CheckpointError

from .helpers import write


def _rewrite_json(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def _set(name, value):
    def change(record):
        record[name] = value

    return change


def _tensors(path: Path, change) -> None:
    # Rewrite a tensor file with the reference writer, after changing its tensors.
    from safetensors.numpy import load, save

    tensors = load(path.read_bytes())
    change(tensors)
    path.write_bytes(save(tensors))


def _rename(old, new):
    def change(tensors):
        tensors[new] = tensors.pop(old)

    return change


def _header_length(path: Path, length: int) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", length)
    path.write_bytes(bytes(data))


def _first_param(change):
    def outer(record):
        change(record["params"][0])

    return outer


P, S, E, T = "params.safetensors", "states.safetensors", "experiment.json", "state.json"

CASES = {
    # name: (damage(folder), words the error must contain, code)
    "params truncated": (
        lambda f: (f / P).write_bytes((f / P).read_bytes()[:-100]),
        [P, "truncated"],
        "E-CKPT-002",
    ),
    "params zero-length": (
        lambda f: (f / P).write_bytes(b""),
        [P, "0 bytes is too short"],
        "E-CKPT-002",
    ),
    "states cut inside the header": (
        lambda f: (f / S).write_bytes((f / S).read_bytes()[:20]),
        [S, "goes beyond the file"],
        "E-CKPT-002",
    ),
    "header length beyond the file": (
        lambda f: _header_length(f / P, 1 << 40),
        [P, "header length 1099511627776 goes beyond the file"],
        "E-CKPT-002",
    ),
    "header not JSON": (
        lambda f: (f / P).write_bytes(struct.pack("<Q", 8) + b"{not js}"),
        [P, "header is not JSON"],
        "E-CKPT-002",
    ),
    "bytes after the tensors": (
        lambda f: (f / P).write_bytes((f / P).read_bytes() + b"extra"),
        [P, "5 bytes after its tensors"],
        "E-CKPT-002",
    ),
    "experiment.json not JSON": (
        lambda f: (f / E).write_text('{"format": 1, "params": ['),
        [E, "not valid JSON"],
        "E-CKPT-002",
    ),
    "state.json not JSON": (
        lambda f: (f / T).write_bytes(b"\xff\xfe"),
        [T, "not valid JSON"],
        "E-CKPT-002",
    ),
    "state.json without a step": (
        lambda f: _rewrite_json(f / T, lambda r: r.pop("step")),
        [T, "its step is missing"],
        "E-CKPT-002",
    ),
    "params file missing": (
        lambda f: (f / P).unlink(),
        [P, "is missing from the checkpoint"],
        "E-CKPT-002",
    ),
    "states file missing": (
        lambda f: (f / S).unlink(),
        [S, "is missing from the checkpoint"],
        "E-CKPT-002",
    ),
    "state.json missing": (
        lambda f: (f / T).unlink(),
        [T, "is missing from the checkpoint"],
        "E-CKPT-002",
    ),
    "experiment.json from a newer format": (
        lambda f: _rewrite_json(f / E, _set("format", 2)),
        [E, "format 2, from a newer sexpgpu", "upgrade sexpgpu"],
        "E-CKPT-003",
    ),
    "experiment.json without a format": (
        lambda f: _rewrite_json(f / E, lambda r: r.pop("format")),
        [E, "not a sexpgpu checkpoint's"],
        "E-CKPT-003",
    ),
    "experiment.json not an object": (
        lambda f: (f / E).write_text("[1, 2]"),
        [E, "not a sexpgpu checkpoint's"],
        "E-CKPT-003",
    ),
    "a parameter path that climbs": (
        lambda f: _rewrite_json(f / E, _first_param(lambda p: p.update(path="model/../../x"))),
        [E, "'model/../../x' that is not a dotted path"],
        "E-CKPT-003",
    ),
    "a parameter path with an empty part": (
        lambda f: _rewrite_json(f / E, _first_param(lambda p: p.update(path="model..embed"))),
        [E, "'model..embed' that is not a dotted path"],
        "E-CKPT-003",
    ),
    "a load entry without its file's size and version": (
        lambda f: _rewrite_json(f / E, _first_param(lambda p: p.update(load={"uri": "t.st"}))),
        [E, "not a sexpgpu checkpoint's"],
        "E-CKPT-003",
    ),
    "a load entry with a null version": (
        lambda f: _rewrite_json(
            f / E,
            _first_param(lambda p: p.update(load={"uri": "t.st", "size": 8, "version": None})),
        ),
        [E, "not a sexpgpu checkpoint's"],
        "E-CKPT-003",
    ),
    "a tensor name that climbs": (
        lambda f: _tensors(f / P, _rename("model.embed", "../model.embed")),
        [P, "'../model.embed', which is no parameter name"],
        "E-CKPT-003",
    ),
    "a parameter tensor with a separator": (
        lambda f: _tensors(f / P, _rename("model.embed", "model/embed")),
        [P, "'model/embed', which is no parameter name"],
        "E-CKPT-003",
    ),
    "a state tensor with a separator too many": (
        lambda f: _tensors(f / S, _rename("model.embed/m", "model.embed/m/x")),
        [S, "'model.embed/m/x', which is no state name"],
        "E-CKPT-003",
    ),
    "a tensor experiment.json does not list": (
        lambda f: _tensors(f / P, lambda t: t.update({"model.extra": np.zeros(2, np.float32)})),
        [P, "it has model.extra that experiment.json does not list"],
        "E-CKPT-002",
    ),
    "a tensor missing": (
        lambda f: _tensors(f / P, lambda t: t.pop("model.head")),
        [P, "it lacks model.head"],
        "E-CKPT-002",
    ),
    "a state missing": (
        lambda f: _tensors(f / S, lambda t: t.pop("model.head/v")),
        [S, "it lacks model.head/v"],
        "E-CKPT-002",
    ),
    "a shape experiment.json does not declare": (
        lambda f: _tensors(
            f / P, lambda t: t.update({"model.head": np.zeros((8, 31), np.float32)})
        ),
        [P, "model.head has the shape [8, 31], where experiment.json says [8, 32]"],
        "E-CKPT-002",
    ),
    "a state of another shape": (
        lambda f: _tensors(f / S, lambda t: t.update({"model.head/m": np.zeros(3, np.float32)})),
        [S, "model.head/m has the shape [3], where its parameter is [8, 32]"],
        "E-CKPT-002",
    ),
    "a parameter stored as another dtype": (
        lambda f: _tensors(f / P, lambda t: t.update({"model.noise": np.zeros(8, np.float64)})),
        [P, "model.noise is float64, where a parameter is stored as F32"],
        "E-CKPT-002",
    ),
    "a declared shape the file does not have": (
        lambda f: _rewrite_json(f / E, _first_param(lambda p: p.update(shape=[32, 9]))),
        [P, "model.embed has the shape [32, 8], where experiment.json says [32, 9]"],
        "E-CKPT-002",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_checkpoint_is_refused(case, storage, location, program):
    damage, words, code = CASES[case]
    key = write(storage, program, 4)[0]
    damage(Path(location) / key)
    with pytest.raises(CheckpointError) as caught:
        ckpt.load_checkpoint(storage, key)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{code}: ")
    assert caught.value.code == code
    for word in words:
        assert word in message
    assert f"{location}/{key}" in message  # says which checkpoint


def test_states_are_not_read_for_evaluation(storage, location, program):
    key = write(storage, program, 4)[0]
    (Path(location) / key / S).write_bytes(b"")
    assert ckpt.load_checkpoint(storage, key, with_states=False).step == 4


def test_no_pickle_is_ever_loaded(storage, location, program):
    # A torch.save-style pickle in place of a tensor file is damage, not code to run.
    import pickle

    key = write(storage, program, 4)[0]
    (Path(location) / key / P).write_bytes(pickle.dumps({"model.embed": [1.0]}))
    with pytest.raises(CheckpointError, match="E-CKPT-002"):
        ckpt.load_checkpoint(storage, key)


NAMES = ["a tensor name that climbs", "a parameter tensor with a separator",
         "a state tensor with a separator too many"]  # fmt: skip


@pytest.mark.parametrize("case", NAMES)
def test_a_foreign_tensor_name_is_one_code_to_a_resume_and_to_describe(
    case, storage, location, program
):
    """``sexpgpu checkpoint`` (describe) names a tensor name sexpgpu never writes as a
    resume does (its command then says E-CKPT-003: one damage, one code)."""
    damage, words, code = CASES[case]
    key = write(storage, program, 4)[0]
    damage(Path(location) / key)
    with pytest.raises(CheckpointError) as resumed:
        ckpt.load_checkpoint(storage, key)
    described = ckpt.describe_checkpoint(storage, key)
    assert resumed.value.code == code == "E-CKPT-003" and described.problems
    assert str(resumed.value) == f"{code}: {location}/{key}/{described.foreign}"

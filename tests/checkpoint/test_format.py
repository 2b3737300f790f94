"""Writing checkpoints and reading them back: names, bytes, the four files, finding the latest."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from sexpgpu import checkpoint as ckpt
from sexpgpu.errors import CheckpointError, StorageError, UsageError
from tests.catalogs import open_location

from .helpers import CORE_SHA, adam_states, make_program, write

SPEC = Path("/work/shared/spec/checkpoints-and-resume.md")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"


def test_step_keys_round_trip():
    assert ckpt.step_key(4) == "step-00000004"
    assert ckpt.step_key(123456789) == "step-123456789"
    for step in (0, 4, 99999999, 123456789):
        assert ckpt.parse_step_key(ckpt.step_key(step)) == step
    for name in ("step-4", "step-0000004x", "notes", "step-00000004.tmp", "xstep-00000004"):
        assert ckpt.parse_step_key(name) is None
    with pytest.raises(ValueError):
        ckpt.step_key(-1)


@pytest.mark.parametrize(
    "tensors",
    [
        {
            "model.b": np.arange(6, dtype=np.float32).reshape(2, 3),
            "model.a": np.ones(3, np.float32),
        },
        {
            "x/m": np.zeros((2, 2), np.float32),
            "x/step": np.array(3, np.int64),
            "mask": np.array([True, False]),
            "empty": np.zeros((0, 4), np.float32),
            "h": np.ones(5, np.float16),
        },
        {},
    ],
)
def test_encoded_bytes_are_what_safetensors_writes(tensors):
    # Byte-for-byte the reference writer's output, so any safetensors reader takes it.
    encoded = bytes(ckpt.encode_safetensors(tensors))
    assert encoded == st_save(tensors)
    back = st_load(encoded)
    assert sorted(back) == sorted(tensors)
    for name, array in tensors.items():
        assert back[name].dtype == array.dtype and back[name].tobytes() == array.tobytes()


def test_big_endian_and_non_contiguous_arrays_are_stored_as_their_values():
    base = np.arange(12, dtype=">f4").reshape(3, 4)
    tensors = {"t": base.T, "b": base}
    back = ckpt.decode_safetensors(bytes(ckpt.encode_safetensors(tensors)), "x")
    assert np.array_equal(back["t"], base.T) and back["t"].dtype == np.float32
    assert np.array_equal(back["b"], base)


def test_write_then_load_is_byte_exact(storage, location, program):
    key, params, states, state, experiment = write(storage, program, 4, finished=True)
    assert key == "step-00000004"
    folder = Path(location) / key
    assert sorted(p.name for p in folder.iterdir()) == sorted(ckpt.FILES)

    loaded = ckpt.load_checkpoint(storage, key)
    assert loaded.location == f"{location}/step-00000004"
    assert loaded.step == 4
    # experiment.json is what was handed over, plus each file's size and CRC32C and the time
    stored = dict(loaded.experiment)
    files = stored.pop("files")
    assert isinstance(stored.pop("written"), float)
    assert stored == experiment
    for name in (ckpt.PARAMS_FILE, ckpt.STATES_FILE, ckpt.STATE_FILE):
        data = (folder / name).read_bytes()
        assert files[name] == {"size": len(data), "crc32c": ckpt.crc32c(data)}
    assert loaded.state == state
    for got, want in ((loaded.params, params), (loaded.states, states)):
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            assert got[name].shape == want[name].shape
            assert got[name].tobytes() == want[name].tobytes()
            got[name][...] = 0  # handed over writable, for torch.from_numpy
    # Written files are exactly what was given, as the reference reader sees them.
    on_disk = st_load((folder / "params.safetensors").read_bytes())
    assert all(on_disk[n].tobytes() == params[n].tobytes() for n in params)
    assert json.loads((folder / "state.json").read_text()) == state

    without = ckpt.load_checkpoint(storage, key, with_states=False)
    assert without.states == {} and sorted(without.params) == sorted(params)


def test_experiment_json_holds_the_run_identity(program):
    record = ckpt.experiment_record(
        make_program(variant="small"),
        choices={"b": "y", "a": "x"},
        slug="s-000000",
        devices=2,
        nodes=1,
        finished=False,
        state_names=adam_states(program),
    )
    assert record["format"] == ckpt.FORMAT
    assert record["sexpgpu"] == "0.1.0"
    assert record["variant"] == "small"
    assert record["sources"][0] == {"name": "<core>", "sha256": CORE_SHA}
    assert record["knobs"] == [
        {"name": "lr", "value": 0.5, "source": "default"},
        {"name": "steps", "value": 4, "source": "default"},
    ]
    assert record["params"][2] == {
        "path": "model.noise",
        "shape": [8],
        "dtype": "f32",
        "trainable": False,
        "tags": [],
    }
    assert record["states"] == {"model.embed": ["m", "v"], "model.head": ["m", "v"]}
    assert (record["counters"], record["precision"], record["seed"]) == (["tokens"], "f32", 7)
    assert (record["devices"], record["nodes"], record["finished"]) == (2, 1, False)
    assert record["choices"] == {"a": "x", "b": "y"}
    assert (
        ckpt.experiment_record(
            make_program(), choices={}, slug="s-000000", devices=1, nodes=1, finished=True
        )["variant"]
        == "-"
    )
    json.dumps(record, allow_nan=False)  # it is plain JSON


def test_experiment_json_is_written_last(location, program):
    # A storage that remembers the order of writes: experiment.json only after the rest.
    real = open_location(location)
    order: list[list[str]] = []

    class Recording:
        uri = real.uri

        def __getattr__(self, name):
            return getattr(real, name)

        def write_many(self, items):
            real.write_many(items)
            order.append(sorted(items))

        def write(self, key, data):
            real.write(key, data)
            order.append([key])

    write(Recording(), program, 2)
    assert order == [
        [
            "step-00000002/params.safetensors",
            "step-00000002/state.json",
            "step-00000002/states.safetensors",
        ],
        ["step-00000002/experiment.json"],
    ]


def test_rewriting_a_step_replaces_it_whole(storage, program):
    write(storage, program, 2, seed=1)
    _, params, *_ = write(storage, program, 2, seed=2)
    loaded = ckpt.load_checkpoint(storage, "step-00000002")
    assert loaded.params["model.embed"].tobytes() == params["model.embed"].tobytes()


def test_find_latest_takes_the_highest_complete_step(storage, location, program):
    assert ckpt.find_latest(storage) is None  # nothing there yet: a fresh start
    write(storage, program, 2)
    write(storage, program, 4)
    write(storage, program, 6)
    # step 6 cut off before experiment.json; step 8 only begun; other names ignored
    storage.delete("step-00000006/experiment.json")
    storage.write("step-00000008/params.safetensors", b"partial")
    storage.write("step-9/experiment.json", b"{}")
    storage.write("notes/experiment.json", b"{}")
    storage.write("step-00000010.old/experiment.json", b"{}")
    assert ckpt.find_latest(storage) == "step-00000004"


def test_find_latest_refuses_a_location_it_cannot_list(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    with pytest.raises(StorageError):
        ckpt.find_latest(open_location(str(blocker)))


def test_resolve_resume(storage, location, program, tmp_path):
    with pytest.raises(UsageError, match=r"^E-CKPT-005: --resume latest needs a checkpoint"):
        ckpt.resolve_resume("latest", None, open_location)
    assert ckpt.resolve_resume("latest", location, open_location) is None
    write(storage, program, 2)
    write(storage, program, 4)
    found_storage, key = ckpt.resolve_resume("latest", location, open_location)
    assert (found_storage.uri, key) == (location, "step-00000004")

    found_storage, key = ckpt.resolve_resume(f"{location}/step-00000002/", None, open_location)
    assert ckpt.location_of(found_storage, key) == f"{location}/step-00000002"
    assert ckpt.load_checkpoint(found_storage, key).step == 2

    with pytest.raises(
        CheckpointError, match=r"^E-CKPT-001: there is no checkpoint at .*step-00000008$"
    ):
        ckpt.resolve_resume(f"{location}/step-00000008", location, open_location)
    storage.delete("step-00000004/experiment.json")
    with pytest.raises(
        CheckpointError, match="not a complete checkpoint: it has no experiment.json"
    ):
        ckpt.resolve_resume(f"{location}/step-00000004", location, open_location)

    # A copied checkpoint under any folder name is read in place.
    copy = tmp_path / "best"
    copy.mkdir()
    for name in ckpt.FILES:
        (copy / name).write_bytes((Path(location) / "step-00000002" / name).read_bytes())
    found_storage, key = ckpt.resolve_resume(str(copy), None, open_location)
    assert key == "" and ckpt.load_checkpoint(found_storage, key).step == 2


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_loading_one_elsewhere_runs_as_documented(storage, location, program):
    key, params, states, _, _ = write(storage, program, 4)
    snippet = _python_blocks(DOCS.read_text())[0]
    if SPEC.exists():  # the user docs show the spec's snippet as it is
        assert snippet == _python_blocks(SPEC.read_text())[0]
    # Only the checkpoint's location differs from the documented one.
    assert snippet.count('"/tmp/my-run/step-00000004"') == 1
    code = snippet.replace('"/tmp/my-run/step-00000004"', repr(f"{location}/{key}"))
    scope: dict = {}
    exec(compile(code, "docs/checkpoints.md", "exec"), scope)
    assert sorted(scope["params"]) == sorted(params)
    assert sorted(scope["states"]) == sorted(states)
    assert scope["states"]["model.embed/m"].tobytes() == states["model.embed/m"].tobytes()
    assert scope["identity"]["params"][0]["path"] == "model.embed"


def test_laid_out_tensors_are_stored_without_a_copy():
    specs = {"model.b": ((2, 3), "float32"), "model.a": ((3,), "float32"), "n": ((), "int64")}
    arrays = ckpt.layout_tensors(specs)
    assert all(not a.any() for a in arrays.values())
    arrays["model.b"][...] = np.arange(6).reshape(2, 3)
    arrays["model.a"][...] = 7
    arrays["n"][...] = 5
    encoded = ckpt.encode_safetensors(arrays)
    plain = {name: array.copy() for name, array in arrays.items()}
    assert bytes(encoded) == st_save(plain)
    # The very buffer the arrays live in: writing into an array changes the file.
    arrays["model.a"][0] = 1
    assert st_load(bytes(encoded))["model.a"][0] == 1

    # An array swapped for one of its own is copied, and the file still right.
    swapped = dict(arrays, **{"model.a": np.full(3, 9, np.float32)})
    other = ckpt.encode_safetensors(swapped)
    assert bytes(other) == st_save({k: v.copy() for k, v in swapped.items()})
    arrays["model.b"][0, 0] = 42
    assert st_load(bytes(other))["model.b"][0, 0] == 0


def test_laid_out_tensors_round_trip_through_a_checkpoint(storage, program):
    arrays = ckpt.layout_tensors({p.path: (p.type.shape, "float32") for p in program.params})
    for i, array in enumerate(arrays.values()):
        array[...] = i + 0.5
    state = ckpt.state_record(step=1, stage=0, records=0, counters={}, loader=None, seed=7)
    experiment = ckpt.experiment_record(
        program, choices={}, slug="s-000000", devices=1, nodes=1, finished=False
    )
    key = ckpt.write_checkpoint(storage, 1, arrays, {}, state, experiment)
    loaded = ckpt.load_checkpoint(storage, key)
    assert all(loaded.params[n].tobytes() == a.tobytes() for n, a in arrays.items())

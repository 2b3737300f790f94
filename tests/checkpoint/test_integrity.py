"""Checksums, schemas, listing and tidying of the checkpoint layer: unit tests, and
`sexpgpu checkpoint LOCATION` through the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from sexpgpu import checkpoint as ckpt
from sexpgpu.checkpoint.storage import redact
from sexpgpu.errors import CheckpointError, StorageError
from sexpgpu.metrics import new_slug
from tests import inprocess
from tests.catalogs import open_location
from tests.profiles import suite_env

from .helpers import write

ENV = suite_env()


def _sexpgpu(*args: str) -> subprocess.CompletedProcess:
    """`sexpgpu ARGS` (a command that trains nothing) in this process: tests/inprocess.py;
    tests/checkpoint/test_cli.py runs the console script."""
    return inprocess.sexpgpu(*args, env=ENV)


# ------------------------------------------------------------------ checksums


@pytest.mark.parametrize("size", [0, 1, 7, 4096, (8 << 20) + 3])
def test_crc32c_is_the_one_google_crc32c_computes_for_any_buffer(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    want = google_crc32c.value(data.tobytes()).to_bytes(4, "big")
    import base64

    expected = base64.b64encode(want).decode()
    assert ckpt.crc32c(data) == expected  # writable numpy buffer, no copy
    assert ckpt.crc32c(data.tobytes()) == expected  # read-only bytes
    assert ckpt.crc32c(memoryview(data.tobytes())) == expected


def test_a_known_crc32c():
    # RFC 3720's check value of CRC32C over "123456789" is 0xE3069283.
    assert ckpt.crc32c(b"123456789") == "4waSgw=="


def test_experiment_json_records_every_other_files_size_and_crc32c(storage, location, program):
    key, *_ = write(storage, program, 4)
    files = json.loads((Path(location) / key / ckpt.EXPERIMENT_FILE).read_text())["files"]
    assert sorted(files) == sorted(ckpt.FILES[:-1])
    for name, record in files.items():
        data = (Path(location) / key / name).read_bytes()
        assert record == {"size": len(data), "crc32c": ckpt.crc32c(data)}


@pytest.mark.parametrize("name", ["params.safetensors", "states.safetensors", "state.json"])
def test_a_byte_changed_anywhere_is_refused_naming_the_file(storage, location, program, name):
    key, *_ = write(storage, program, 4)
    path = Path(location) / key / name
    data = bytearray(path.read_bytes())
    # A byte of the data that keeps every structural check happy: the last of a tensor,
    # or a space of state.json's layout turned into another one.
    if name == "state.json":
        data[data.index(b"\n ")] = ord(" ")
    else:
        data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is not the file")) as caught:
        ckpt.load_checkpoint(storage, key)
    assert caught.value.code == ckpt.E_CHECKSUM


# ------------------------------------------------------------------ schemas


def test_the_slug_new_slug_makes_fits_the_schema_and_nothing_that_climbs_does():
    pattern = re.compile(ckpt.SLUG_PATTERN)
    for stem in ("my-run", "a b/../c", "..", "-x-", "ünï", ""):
        assert pattern.match(new_slug(stem)), new_slug(stem)
    for slug in ("../../ESCAPED", "/tmp/x-abcdef", "a/b-abcdef", "..-abcdef", "x-ABCDEF", "x"):
        assert not pattern.match(slug), slug


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda r: r.update(step=-1), "step is below 0"),
        (lambda r: r.update(step=True), "step is not integer"),
        (lambda r: r.update(counters=[1]), "counters is not object"),
        (lambda r: r.update(loader={"index": 10**30}), "loader/index is not a value"),
        (lambda r: r.update(evals_pending=["e", "e"]), "evals_pending names one twice"),
        (lambda r: r.pop("seed"), "its seed is missing"),
    ],
)
def test_state_json_is_checked_against_its_schema(storage, location, program, change, said):
    key, *_ = write(storage, program, 4)
    path = Path(location) / key / ckpt.STATE_FILE
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=re.escape(said)) as caught:
        ckpt.read_state(storage, key)
    assert caught.value.code == ckpt.E_DAMAGED


def test_json_nested_deep_is_one_error_not_a_recursion_error(storage, location, program):
    key, *_ = write(storage, program, 4)
    for levels in (33, 5_000, 1_000_000):
        (Path(location) / key / ckpt.STATE_FILE).write_text("[" * levels + "]" * levels)
        with pytest.raises(CheckpointError) as caught:
            ckpt.read_state(storage, key)
        assert caught.value.code == ckpt.E_TOO_DEEP


# ------------------------------------------------------------------ listing and tidying


def test_sexpgpu_checkpoint_on_a_location_lists_its_checkpoints(storage, location, program):
    write(storage, program, 2)
    write(storage, program, 4, finished=True)
    storage.write("step-00000006/params.safetensors", b"cut off")
    done = _sexpgpu("checkpoint", location)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"checkpoints in {location}"
    assert re.fullmatch(r"  step\s+complete\s+finished\s+size\s+written", lines[1])
    assert re.fullmatch(
        r"  2\s+yes\s+false\s+\d+\.\d kB\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", lines[2]
    )
    assert re.fullmatch(r"  4\s+yes\s+true\s+\d+\.\d kB\s+\d{4}-.* UTC", lines[3])
    assert re.fullmatch(r"  6\s+no \(cut off\)\s+-\s+-\s+-", lines[4])
    assert len(lines) == 5

    latest = _sexpgpu("checkpoint", f"{location}/latest")
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.startswith(f"checkpoint {location}/step-00000004\nstep       4\n")


def test_latest_of_a_location_without_a_complete_checkpoint(location):
    done = _sexpgpu("checkpoint", f"{location}/latest")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"sexpgpu checkpoint: E-CKPT-001: there is no complete checkpoint under {location}"
    )


def test_leftovers_of_cut_off_writes_are_removed_when_a_later_checkpoint_is_stored(
    storage, location, program
):
    root = Path(location)
    write(storage, program, 2)
    # Cut off: step 3 without experiment.json, temp files in steps 2 and 3 and the
    # step being rewritten, and a step after the one stored next.
    storage.write("step-00000003/params.safetensors", b"cut off")
    for folder in ("step-00000002", "step-00000003", "step-00000004"):
        (root / folder).mkdir(exist_ok=True)
        (root / folder / ".sexpgpu-tmp-params.safetensors-0a0b0c0d").write_bytes(b"x" * 100)
    storage.write("step-00000009/params.safetensors", b"a later cut-off write")

    # The resume is another process: a location opened afresh.
    write(open_location(location), program, 4)

    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000004", "step-00000009"]
    assert sorted(os.listdir(root / "step-00000002")) == sorted(ckpt.FILES)
    assert sorted(os.listdir(root / "step-00000004")) == sorted(ckpt.FILES)
    assert os.listdir(root / "step-00000009") == ["params.safetensors"]
    assert ckpt.find_latest(storage) == "step-00000004"


def test_tidying_never_removes_a_complete_checkpoint_it_cannot_read(storage, location, program):
    write(storage, program, 2)
    (Path(location) / "step-00000002" / "state.json").write_text("damaged")
    assert ckpt.remove_leftovers(storage, 4) == []
    assert sorted(os.listdir(Path(location) / "step-00000002")) == sorted(ckpt.FILES)


# ------------------------------------------------------------------ local files


def test_the_local_backend_reads_regular_files_only(tmp_path):
    storage = open_location(str(tmp_path))
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/dev/zero", tmp_path / "zero")
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "linked")
    for key in ("fifo", "zero", "linked/x"):
        for read in (storage.read, lambda k: storage.read_range(k, 0, 8), storage.exists):
            with pytest.raises(StorageError) as caught:
                read(key)
            assert caught.value.code == "E-STORAGE-007", key
    with pytest.raises(StorageError):
        storage.write("linked/x", b"never written through a link")
    assert list((tmp_path / "real").iterdir()) == []


def test_credentials_in_urls_are_redacted():
    assert redact("cannot list http://user:secret@host:9000/b: refused") == (
        "cannot list http://***@host:9000/b: refused"
    )
    assert redact("see https://token@example.com/x and s3://bucket/k") == (
        "see https://***@example.com/x and s3://bucket/k"
    )
    assert redact("no url here") == "no url here"

"""`sexpgpu checkpoint --verify`: every file's size and CRC32C read and checked, file by
file, on a local folder, s3:// (moto) and gs:// (the GCS emulator), in chunks (memory
bounded whatever the file's size); without it, the last line says the data was not
verified. The command runs as the console script in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sexpgpu import checkpoint as ckpt
from sexpgpu.checkpoint.verify import verify_checkpoint
from tests.catalogs import open_location
from tests.e2e_storage.buckets import gcs_admin_client, s3_admin_client
from tests.profiles import suite_env
from tests.servers import new_bucket_name, point_gcs_at, point_s3_at, unique_prefix

from .helpers import make_program, param, write
from .test_cli import CountingStorage

SEXPGPU = str(Path(sys.executable).parent / "sexpgpu")
STEP = "step-00000004"
CHECKED = ("params.safetensors", "states.safetensors", "state.json")
"""The files experiment.json records a size and CRC32C of, in the order they are shown."""
NOT_VERIFIED = (
    "data       not verified: headers only (--verify reads every file and checks its CRC32C)"
)
VERIFIED = "data       verified: every file has the size and CRC32C experiment.json records"


class Counting(CountingStorage):
    """The real local storage, remembering every byte range read, buffer fills too."""

    def read_range_into(self, key, start, buffer):
        got = self.real.read_range_into(key, start, buffer)
        self.reads.append((key, start, got, len(buffer)))
        return got


class CountingRanges(CountingStorage):
    """The real local storage less ``read_range_into``, as a bucket's backend is."""

    read_range_into = None  # the protocol's default: every read through read_range


# Runs the command given after the file to write its peak resident memory to (in kB).
MEASURE = """\
import resource, subprocess, sys
done = subprocess.run(sys.argv[2:])
with open(sys.argv[1], "w") as out:
    out.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(done.returncode)
"""


def _env() -> dict[str, str]:
    return suite_env()


def _sexpgpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SEXPGPU, *args], capture_output=True, text=True, env=_env(), timeout=120)


def _records(storage, key: str = STEP) -> dict:
    return json.loads(storage.read(f"{key}/experiment.json"))["files"]


def _verified_lines(records: dict) -> list[str]:
    return [
        f"  {name.ljust(18)}  verified   {records[name]['size']} bytes, "
        f"CRC32C {records[name]['crc32c']}"
        for name in CHECKED
    ]


def _flip(data: bytes, name: str) -> bytes:
    """``data`` with one bit changed where no check but the checksum sees it: in a tensor's
    data, or in state.json's seed (7 -> 6), which keeps it a valid record."""
    changed = bytearray(data)
    at = data.rindex(b'"seed": 7') + len('"seed": ') if name == "state.json" else len(data) - 5
    changed[at] ^= 0x01
    return bytes(changed)


def _refused_line(location: str, name: str, found: str, recorded: str) -> str:
    return (
        f"sexpgpu checkpoint: E-CKPT-006: {location}/{STEP}/{name} is not the file its "
        f"checkpoint wrote: its CRC32C is {found} where experiment.json records {recorded}\n"
    )


# ------------------------------------------------------------------ a local folder


def test_without_verify_the_last_line_says_the_data_was_not_verified(storage, location, program):
    write(storage, program, 4)
    done = _sexpgpu("checkpoint", f"{location}/{STEP}")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.endswith("  model.head/v   F32  [8, 32]\n" + NOT_VERIFIED + "\n")
    assert "checksums" not in done.stdout


def test_verify_says_each_file_is_verified(storage, location, program):
    write(storage, program, 4)
    done = _sexpgpu("checkpoint", f"{location}/{STEP}", "--verify")
    assert (done.returncode, done.stderr) == (0, "")
    records = _records(storage)
    tail = ["  model.head/v   F32  [8, 32]", "checksums", *_verified_lines(records), VERIFIED]
    assert done.stdout.splitlines()[-6:] == tail
    assert NOT_VERIFIED not in done.stdout
    # LOCATION/latest is the same checkpoint
    latest = _sexpgpu("checkpoint", f"{location}/latest", "--verify")
    assert (latest.returncode, latest.stdout) == (0, done.stdout)


@pytest.mark.parametrize("name", CHECKED)
def test_a_flipped_byte_is_the_resumes_e_ckpt_006(storage, location, program, name):
    write(storage, program, 4)
    folder = Path(location) / STEP
    recorded = _records(storage)[name]["crc32c"]
    (folder / name).write_bytes(_flip((folder / name).read_bytes(), name))
    found = ckpt.crc32c((folder / name).read_bytes())
    line = _refused_line(location, name, found, recorded)

    done = _sexpgpu("checkpoint", f"{location}/{STEP}", "--verify")
    assert (done.returncode, done.stderr) == (1, line)
    if name == "state.json":  # read to show the step, so checked before anything is shown
        assert done.stdout == ""
        return
    rows = done.stdout.splitlines()
    assert rows[-5] == "checksums"
    assert (
        f"! {name}  damaged    its CRC32C is {found} where experiment.json records {recorded}"
        in (rows[-4:-1])
    )
    assert rows[-1] == "data       damaged: 1 of 3 files is not the one its checkpoint wrote"
    # without --verify only the headers are read: the flipped data byte goes unseen
    assert _sexpgpu("checkpoint", f"{location}/{STEP}").returncode == 0


def test_two_damaged_files_are_one_line_naming_the_first(storage, location, program):
    write(storage, program, 4)
    folder = Path(location) / STEP
    records = _records(storage)
    for name in CHECKED[:2]:
        (folder / name).write_bytes(_flip((folder / name).read_bytes(), name))
    done = _sexpgpu("checkpoint", f"{location}/{STEP}", "--verify")
    assert done.returncode == 1
    found = ckpt.crc32c((folder / CHECKED[0]).read_bytes())
    first = _refused_line(location, CHECKED[0], found, records[CHECKED[0]]["crc32c"])
    assert done.stderr == first[:-1] + " (1 more damaged, flagged with ! above)\n"
    flagged = [row.split()[1] for row in done.stdout.splitlines() if row.startswith("! ")]
    assert flagged == list(CHECKED[:2])
    assert done.stdout.endswith(
        "data       damaged: 2 of 3 files are not the ones its checkpoint wrote\n"
    )


def test_a_checkpoint_written_before_checksums_is_not_verified(storage, location, program):
    write(storage, program, 4)
    path = Path(location) / STEP / "experiment.json"
    record = json.loads(path.read_text())
    del record["files"]
    path.write_text(json.dumps(record))
    done = _sexpgpu("checkpoint", f"{location}/{STEP}", "--verify")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[-5:] == [
        "checksums",
        *(
            f"  {name.ljust(18)}  unchecked  experiment.json records no size or CRC32C of it"
            for name in CHECKED
        ),
        "data       not verified: experiment.json records no checksums (written before them)",
    ]


def test_verify_on_a_location_of_several_checkpoints_is_a_usage_error(storage, location, program):
    write(storage, program, 2)
    write(storage, program, 4)
    done = _sexpgpu("checkpoint", location, "--verify")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"sexpgpu checkpoint: --verify checks one checkpoint and {location} holds 2: name "
        f"one ({location}/step-<n>, or {location}/latest for the newest complete one)\n"
    )


def test_memory_stays_bounded_for_a_big_file(tmp_path):
    # A 320 MiB frozen parameter: read whole, the file alone would take 320 MiB.
    storage = open_location(str(tmp_path / "big"))
    program = make_program(params=(param("model.big", (20480, 4096), trainable=False),))
    params = ckpt.layout_tensors({"model.big": ((20480, 4096), np.float32)})
    params["model.big"][::997] = 1.5  # not only zero pages
    state = ckpt.state_record(step=1, stage=0, records=1, counters={}, loader=None, seed=7)
    experiment = ckpt.experiment_record(
        program, choices={}, slug="my-run-3f9a1c", devices=1, nodes=1, finished=True
    )
    key = ckpt.write_checkpoint(storage, 1, params, {}, state, experiment)
    del params
    size = _records(storage, key)["params.safetensors"]["size"]
    assert size > 320 << 20

    # The peak of the command's own process, measured by a small parent of its own: a
    # child's peak on Linux starts from the resident size of the process it was forked
    # from, which for this test's process grows with the tests run before it.
    peak_file = tmp_path / "peak"
    target = str(tmp_path / "big" / key)
    measure = [sys.executable, "-c", MEASURE, str(peak_file)]
    args = [*measure, SEXPGPU, "checkpoint", target, "--verify"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=_env())
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert f"  params.safetensors  verified   {size} bytes, CRC32C " in done.stdout
    assert done.stdout.endswith(VERIFIED + "\n")
    peak = int(peak_file.read_text()) * 1024  # kilobytes on Linux
    assert peak < size // 2, f"peak resident memory {peak >> 20} MiB for a {size >> 20} MiB file"


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096, 1 << 20])
@pytest.mark.parametrize("backend", [Counting, CountingRanges])
def test_the_files_are_read_in_chunks_never_whole(storage, location, program, chunk, backend):
    # The core API under the command: reads of `chunk` bytes, into buffers or not, a few
    # at a time, and the same verdict whatever the chunk (a file a multiple of it too).
    key, *_ = write(storage, program, 4)
    counting = backend(open_location(location))
    checks = list(verify_checkpoint(counting, key, chunk=chunk))
    records = _records(storage)
    assert [(c.name, c.size, c.crc32c, c.damage) for c in checks] == [
        (name, records[name]["size"], records[name]["crc32c"], None) for name in CHECKED
    ]
    for name in CHECKED:
        reads = [read for read in counting.reads if read[0] == f"{key}/{name}"]
        if backend is Counting:  # buffers of `chunk` bytes filled
            assert all(len(read) == 4 and read[3] == chunk for read in reads)
        else:
            assert all(len(read) == 3 and read[2] <= chunk for read in reads)
        starts = sorted(read[1] for read in reads)
        assert starts == list(range(0, records[name]["size"] + 1, chunk))


def test_a_file_longer_than_its_record_is_read_to_its_end(storage, location, program):
    key, *_ = write(storage, program, 4)
    path = Path(location) / key / "experiment.json"
    record = json.loads(path.read_text())
    record["files"]["params.safetensors"]["size"] -= 100
    path.write_text(json.dumps(record))
    size = (Path(location) / key / "params.safetensors").stat().st_size
    (check, *_) = verify_checkpoint(storage, key, chunk=64)
    assert check.damage == f"{size} bytes where experiment.json records {size - 100}"


# ------------------------------------------------------------------ buckets


@pytest.fixture(params=["s3", "gs"])
def bucket(request, monkeypatch, tmp_path):
    """A fresh prefix in a fresh bucket on the session's moto server or GCS emulator,
    this process's environment (and so the subprocesses') pointed at it; returns
    (location, put), ``put(key, data)`` storing an object through the client library."""
    name = new_bucket_name("sx-verify")
    if request.param == "s3":
        endpoint = request.getfixturevalue("moto_s3").url
        point_s3_at(monkeypatch, endpoint, tmp_path)
        client = s3_admin_client(endpoint)
        client.create_bucket(Bucket=name)

        def put(key: str, data: bytes) -> None:
            client.put_object(Bucket=name, Key=key, Body=data)

    else:
        endpoint = request.getfixturevalue("gcs_emulator").url
        point_gcs_at(monkeypatch, endpoint)
        blobs = gcs_admin_client(endpoint).create_bucket(name)

        def put(key: str, data: bytes) -> None:
            blobs.blob(key).upload_from_string(data)

    prefix = unique_prefix()
    return f"{request.param}://{name}/{prefix}", lambda key, data: put(f"{prefix}/{key}", data)


@pytest.mark.slow
def test_verify_on_a_bucket(bucket, program):
    location, put = bucket
    storage = open_location(location)
    write(storage, program, 4)
    records = _records(storage)
    done = _sexpgpu("checkpoint", f"{location}/{STEP}", "--verify")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[-5:] == ["checksums", *_verified_lines(records), VERIFIED]

    for name in CHECKED:
        good = storage.read(f"{STEP}/{name}")
        put(f"{STEP}/{name}", _flip(good, name))
        found = ckpt.crc32c(_flip(good, name))
        done = _sexpgpu("checkpoint", f"{location}/{STEP}", "--verify")
        line = _refused_line(location, name, found, records[name]["crc32c"])
        assert (done.returncode, done.stderr) == (1, line), name
        assert "Traceback" not in done.stdout
        put(f"{STEP}/{name}", good)

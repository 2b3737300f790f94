"""`sexpgpu checkpoint`: the console layout of the spec, header-only reads, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sexpgpu import checkpoint as ckpt
from sexpgpu.lang.ir import LoadSpec, Source
from sexpgpu_cli.commands.checkpoint import render_checkpoint
from tests.catalogs import open_location
from tests.profiles import suite_env

from .helpers import CORE_SHA, RUN_SHA, make_program, param, write

SEXPGPU = str(Path(sys.executable).parent / "sexpgpu")
LIB_SHA = "0" * 64
ENV = suite_env()


def _sexpgpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SEXPGPU, *args], capture_output=True, text=True, env=ENV, timeout=120)


def test_the_console_layout(storage, location):
    program = make_program(
        sources=(
            Source("<core>", None, CORE_SHA),
            Source("my-run.sx", "/x/my-run.sx", RUN_SHA),
            Source("layers/transformer.sx", "/x/layers/transformer.sx", LIB_SHA),
        )
    )
    write(storage, program, 4, finished=True)
    done = _sexpgpu("checkpoint", f"{location}/step-00000004")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == (
        f"checkpoint {location}/step-00000004\n"
        "step       4\n"
        "sexpgpu    0.1.0\n"
        "variant    -\n"
        "devices    1\n"
        "precision  f32\n"
        "seed       7\n"
        "counters   tokens\n"
        "sources\n"
        f"  <core>                    {CORE_SHA}\n"
        f"  my-run.sx                 {RUN_SHA}\n"
        f"  layers/transformer.sx     {LIB_SHA}\n"
        "slug       my-run-3f9a1c\n"
        "finished   true\n"
        "knobs\n"
        "  lr     0.5  default\n"
        "  steps  4    default\n"
        "choices\n"
        "  stack:model.blocks  unrolled\n"
        "loaded\n"
        "params.safetensors  3 tensors\n"
        "  model.embed  F32  [32, 8]\n"
        "  model.head   F32  [8, 32]  no-decay\n"
        "  model.noise  F32  [8]  frozen\n"
        "states.safetensors  4 tensors\n"
        "  model.embed/m  F32  [32, 8]\n"
        "  model.embed/v  F32  [32, 8]\n"
        "  model.head/m   F32  [8, 32]\n"
        "  model.head/v   F32  [8, 32]\n"
        "data       not verified: headers only (--verify reads every file and checks its CRC32C)\n"
    )


def test_a_location_without_experiment_json_is_an_error(storage, location, program):
    write(storage, program, 4)
    storage.delete("step-00000004/experiment.json")
    done = _sexpgpu("checkpoint", f"{location}/step-00000004")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        f"sexpgpu checkpoint: E-CKPT-001: {location}/step-00000004 is not a complete "
        "checkpoint: it has no experiment.json (its writing was cut off)\n"
    )
    done = _sexpgpu("checkpoint", f"{location}/step-00000009")
    assert (done.returncode, done.stderr) == (
        1,
        f"sexpgpu checkpoint: E-CKPT-001: there is no checkpoint at {location}/step-00000009\n",
    )


def test_a_damaged_header_is_one_line(storage, location, program):
    write(storage, program, 4)
    target = Path(location) / "step-00000004" / "states.safetensors"
    target.write_bytes(target.read_bytes()[:-1])
    done = _sexpgpu("checkpoint", f"{location}/step-00000004")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"sexpgpu checkpoint: E-CKPT-002: {target} is damaged: ")
    assert "truncated" in done.stderr


def test_checkpoint_command_imports_no_torch(storage, location, program):
    write(storage, program, 4)
    target = f"{location}/step-00000004"
    code = f"from sexpgpu_cli.main import main; main(['checkpoint', {target!r}])"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"checkpoint {location}/step-00000004\n")
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "sexpgpu.checkpoint" in imported  # the measurement saw the command's own modules
    for heavy in ("torch", "boto3", "google.cloud.storage"):
        assert heavy not in imported, f"sexpgpu checkpoint imported {heavy}"


class CountingStorage:
    """The real local storage, remembering every byte range read."""

    def __init__(self, real):
        self.real, self.uri, self.reads = real, real.uri, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def read(self, key):
        data = self.real.read(key)
        self.reads.append((key, 0, len(data)))
        return data

    def read_range(self, key, start, length):
        data = self.real.read_range(key, start, length)
        self.reads.append((key, start, len(data)))
        return data

    def identity(self, key):
        raise AssertionError("describing must not hash or stat whole objects")


def test_describe_reads_only_records_and_headers(storage, location, program):
    write(storage, program, 4)
    counting = CountingStorage(open_location(location))
    ckpt.describe_checkpoint(counting, "step-00000004")
    folder = Path(location) / "step-00000004"
    tensor_reads = [r for r in counting.reads if r[0].endswith(".safetensors")]
    assert {r[0] for r in tensor_reads} == {
        "step-00000004/params.safetensors",
        "step-00000004/states.safetensors",
    }
    for key, _, _ in tensor_reads:
        size = (folder / key.split("/")[1]).stat().st_size
        header = 8 + int.from_bytes((folder / key.split("/")[1]).read_bytes()[:8], "little")
        assert sum(n for k, _, n in tensor_reads if k == key) <= header + 1 < size


def test_loaded_parameters_are_named_not_copied(storage, location):
    teacher = LoadSpec("teacher.safetensors", "teacher.embed.weight")
    base = make_program()
    program = make_program(
        params=(
            *base.params[:2],
            param("teacher.embed", (32, 8), trainable=False, load=teacher),
        )
    )
    params = {p.path: np.zeros(p.type.shape, np.float32) for p in program.params[:2]}
    experiment = ckpt.experiment_record(
        program,
        choices={},
        slug="s-000000",
        devices=1,
        nodes=1,
        finished=False,
        loaded={"teacher.embed": {"size": 2216, "version": "sha256:f2fb0b73" + "a" * 56}},
    )
    state = ckpt.state_record(step=1, stage=0, records=1, counters={}, loader=None, seed=7)
    key = ckpt.write_checkpoint(storage, 1, params, {}, state, experiment)
    text = render_checkpoint(ckpt.describe_checkpoint(storage, key))
    assert (
        "loaded\n"
        "  teacher.embed  teacher.embed.weight in teacher.safetensors, 2216 bytes, sha256:f2fb0b73...\n"
        "params.safetensors  2 tensors\n"
        "  model.embed  F32  [32, 8]\n"
        "  model.head   F32  [8, 32]  no-decay\n"
        "states.safetensors  0 tensors\n"
    ) in text
    loaded = ckpt.load_checkpoint(storage, key)
    assert sorted(loaded.params) == ["model.embed", "model.head"]
    assert loaded.experiment["params"][2]["load"] == {
        "uri": "teacher.safetensors",
        "tensor": "teacher.embed.weight",
        "size": 2216,
        "version": "sha256:f2fb0b73" + "a" * 56,
    }


@pytest.mark.parametrize("name", ["step-00000004", "step-00000004/"])
def test_open_checkpoint_splits_the_step_off(location, name):
    storage, key = ckpt.open_checkpoint(f"{location}/{name}", open_location)
    assert (storage.uri, key) == (location, "step-00000004")


def test_open_checkpoint_at_the_top_of_a_file_system_or_here(monkeypatch, tmp_path):
    storage, key = ckpt.open_checkpoint("/step-00000004", open_location)
    assert (storage.uri, key) == ("/", "step-00000004")
    assert ckpt.location_of(storage, key) == "/step-00000004"
    monkeypatch.chdir(tmp_path)
    storage, key = ckpt.open_checkpoint("step-00000004", open_location)
    assert (storage.uri, key) == (".", "step-00000004")

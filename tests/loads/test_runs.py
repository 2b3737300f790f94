"""`sexpgpu run` with :load and with-loaded, in subprocesses, on a local folder: what a
checkpoint holds, `sexpgpu checkpoint`, the spec's snippet, bit-exact resume,
E-LOAD-001, a moved file, and bad files."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.e2e.helpers import assert_same_tensors, sexpgpu_in_process

from .helpers import experiment, head_tensors, run_sexpgpu, said, teacher_tensors, write_project


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A project whose 4-step run checkpointed every step (``ckpt/step-<n>``)."""
    work = tmp_path_factory.mktemp("trained")
    write_project(work)
    done = run_sexpgpu("run", "loads.sx", "--checkpoint-dir", "ckpt", cwd=work)
    assert done.returncode == 0, done.stderr
    return work


def test_a_checkpoint_pins_loaded_parameters_and_copies_only_trainable_ones(trained: Path) -> None:
    step = trained / "ckpt" / "step-00000004"
    params = {e["path"]: e for e in experiment(step)["params"]}
    teacher, head = trained / "teacher.safetensors", trained / "head.safetensors"
    assert params["teacher.embed"] == {
        "path": "teacher.embed",
        "shape": [32, 8],
        "dtype": "f32",
        "trainable": False,
        "tags": [],
        "load": {
            "uri": "teacher.safetensors",
            "tensor": "teacher.embed.weight",
            "size": teacher.stat().st_size,
            "version": sha256(teacher),
        },
    }
    assert params["model.head"]["trainable"] is True
    assert params["model.head"]["load"] == {
        "uri": "head.safetensors",
        "tensor": "lm_head.weight",
        "size": head.stat().st_size,
        "version": sha256(head),
    }
    assert "load" not in params["model.embed"]
    # the order of roots: model.* first, then the teacher
    assert [e["path"] for e in experiment(step)["params"]] == [
        "model.embed",
        "model.head",
        "teacher.embed",
        "teacher.head",
    ]
    stored = load_file(str(step / "params.safetensors"))
    assert sorted(stored) == ["model.embed", "model.head"]
    states = load_file(str(step / "states.safetensors"))
    assert not [name for name in states if name.startswith("teacher.")]


def test_a_trainable_parameter_starts_from_its_file(trained: Path) -> None:
    # Adam's first step moves each value by about lr (0.01): the head is the file's, moved.
    first = load_file(str(trained / "ckpt" / "step-00000001" / "params.safetensors"))
    start = head_tensors()["lm_head.weight"].astype(np.float32)
    moved = np.abs(first["model.head"] - start)
    assert moved.max() < 0.0101
    assert moved.max() > 0.0


def test_sexpgpu_checkpoint_prints_the_loaded_section(trained: Path) -> None:
    done = sexpgpu_in_process("checkpoint", "ckpt/step-00000004", cwd=trained)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("loaded")
    teacher_id = sha256(trained / "teacher.safetensors")[:15] + "..."
    head_id = sha256(trained / "head.safetensors")[:15] + "..."
    teacher_size = (trained / "teacher.safetensors").stat().st_size
    head_size = (trained / "head.safetensors").stat().st_size
    assert lines[start : start + 7] == [
        "loaded",
        f"  model.head     lm_head.weight in head.safetensors, {head_size} bytes, {head_id}",
        f"  teacher.embed  teacher.embed.weight in teacher.safetensors, {teacher_size} bytes, {teacher_id}",
        f"  teacher.head   teacher.head.weight in teacher.safetensors, {teacher_size} bytes, {teacher_id}",
        "params.safetensors  2 tensors",
        "  model.embed  F32  [32, 8]",
        "  model.head   F32  [8, 32]",
    ]
    assert "teacher." not in "\n".join(lines[start + 4 :])


def test_the_specs_loading_snippet_takes_the_load_branch(trained: Path) -> None:
    snippet = textwrap.dedent(
        """\
        import json
        from safetensors.numpy import load_file  # safetensors.torch.load_file for tensors

        step = "/tmp/my-run/step-00000004"
        identity = json.load(open(f"{step}/experiment.json"))
        params = load_file(f"{step}/params.safetensors")   # {"model.net.embed.table": array, ...}
        states = load_file(f"{step}/states.safetensors")   # {"model.net.embed.table/m": array, ...}
        for declared in identity["params"]:
            if declared["path"] not in params:  # frozen and read from a file
                source = declared["load"]       # {"uri", "tensor", "size", "version"}
                continue
            assert list(params[declared["path"]].shape) == declared["shape"]
        """
    )
    snippet = snippet.replace("/tmp/my-run/step-00000004", str(trained / "ckpt" / "step-00000004"))
    done = subprocess.run(
        [sys.executable, "-c", snippet + "print(json.dumps(source))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout)["tensor"] == "teacher.head.weight"


@pytest.mark.parametrize("k", [1, 2, 3])
def test_stopped_after_any_step_and_resumed_is_byte_identical(
    trained: Path, tmp_path: Path, k: int
) -> None:
    shutil.copytree(trained / "ckpt" / f"step-{k:08d}", tmp_path / "ckpt" / f"step-{k:08d}")
    done = run_sexpgpu(
        "run",
        "loads.sx",
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--resume",
        "latest",
        "--metrics-dir",
        tmp_path / "metrics",
        cwd=trained,
    )
    assert done.returncode == 0, done.stderr
    assert_same_tensors(trained / "ckpt" / "step-00000004", tmp_path / "ckpt" / "step-00000004")


def test_a_changed_file_is_refused_with_e_load_001(tmp_path: Path) -> None:
    write_project(tmp_path)
    first = run_sexpgpu("run", "loads.sx", "--checkpoint-dir", "ckpt", "--steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    teacher = tmp_path / "teacher.safetensors"
    old_size, old = teacher.stat().st_size, sha256(teacher)
    save_file(teacher_tensors(seed=5), str(teacher))
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    events = sorted((tmp_path / "sexpgpu-runs").rglob("events.jsonl"))
    sizes = [p.stat().st_size for p in events]
    done = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "ckpt", "--resume", "latest", cwd=tmp_path
    )
    assert done.returncode == 1
    new = sha256(teacher)
    size = teacher.stat().st_size
    assert said(done.stderr) == [
        "sexpgpu run: E-LOAD-001: a loaded parameter's file is not the one the checkpoint's run read:",
        f"  teacher.embed: teacher.embed.weight in teacher.safetensors, {old_size} bytes, {old}"
        f" -> teacher.embed.weight in teacher.safetensors, {size} bytes, {new}",
        f"  teacher.head: teacher.head.weight in teacher.safetensors, {old_size} bytes, {old}"
        f" -> teacher.head.weight in teacher.safetensors, {size} bytes, {new}",
        "restore that file, or start the run again",
    ]
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
    assert [p.stat().st_size for p in events] == sizes


def test_the_same_bytes_at_another_path_are_recorded(trained: Path, tmp_path: Path) -> None:
    project = tmp_path / "moved"
    project.mkdir()
    (project / "weights").mkdir()
    shutil.copy(trained / "teacher.safetensors", project / "weights" / "teacher.safetensors")
    shutil.copy(trained / "head.safetensors", project / "head.safetensors")
    write_project(project, teacher_uri="weights/teacher.safetensors", files=False)
    shutil.copytree(trained / "ckpt" / "step-00000002", project / "ckpt" / "step-00000002")
    done = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "ckpt", "--resume", "latest", cwd=project
    )
    assert done.returncode == 0, done.stderr
    (events,) = (project / "sexpgpu-runs").rglob("events.jsonl")
    texts = [
        json.loads(line)["text"]
        for line in events.read_text().splitlines()
        if '"resumed from' in line
    ]
    lines = texts[0].splitlines()
    assert "load teacher.embed teacher.safetensors -> weights/teacher.safetensors" in lines
    assert "load teacher.head teacher.safetensors -> weights/teacher.safetensors" in lines
    assert not [line for line in lines if line.startswith("load model.")]
    assert_same_tensors(trained / "ckpt" / "step-00000004", project / "ckpt" / "step-00000004")
    pinned = {
        e["path"]: e.get("load") for e in experiment(project / "ckpt" / "step-00000004")["params"]
    }
    assert pinned["teacher.head"]["uri"] == "weights/teacher.safetensors"


BAD = [
    (
        {"names": "{path}.wieght"},
        "E-LOAD-003: teacher.embed: teacher.embed.wieght is not in teacher.safetensors; "
        "nearest: teacher.embed.weight, teacher.head.weight",
    ),
    ({"head_uri": "nowhere.safetensors"}, "E-STORAGE-003: ./nowhere.safetensors does not exist"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
@pytest.mark.parametrize("command", ["check", "run"])
def test_bad_load_input_is_one_line_with_a_code_and_the_position(
    tmp_path: Path, change: dict, message: str, command: str
) -> None:
    write_project(tmp_path, **change)
    where = ["--checkpoint-dir", "ckpt"] if command == "run" else []
    # `run` trains, so a process of its own; `check` trains nothing: this one
    sexpgpu = run_sexpgpu if command == "run" else sexpgpu_in_process
    done = sexpgpu(command, "loads.sx", *where, cwd=tmp_path)
    assert done.returncode == 1
    (line,) = said(done.stderr)
    # the .sx position of the parameter, then the code (check prints source errors bare)
    assert line.removeprefix(f"sexpgpu {command}: ").startswith("loads.sx:")
    assert line.endswith(message)
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())
    assert not (tmp_path / "sexpgpu-runs").exists()


def test_a_truncated_file_is_refused_before_any_step(tmp_path: Path) -> None:
    write_project(tmp_path)
    data = (tmp_path / "teacher.safetensors").read_bytes()
    (tmp_path / "teacher.safetensors").write_bytes(data[:-64])
    checked = sexpgpu_in_process("check", "loads.sx", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr  # check reads headers only
    done = run_sexpgpu("run", "loads.sx", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = said(done.stderr)
    assert (
        "E-LOAD-002: teacher.safetensors is truncated: teacher.head.weight needs 1024 bytes" in line
    )
    assert not (tmp_path / "ckpt").exists()  # a refused run leaves no folder behind
    assert not (tmp_path / "sexpgpu-runs").exists()


def test_check_lists_what_each_parameter_is_read_from(tmp_path: Path) -> None:
    write_project(tmp_path)
    done = sexpgpu_in_process("check", "loads.sx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "load teacher.head.weight from teacher.safetensors" in done.stdout
    assert "load lm_head.weight from head.safetensors" in done.stdout

"""`:load` files that are symbolic links, as Hugging Face's cache stores every file
(``snapshots/<rev>/model.safetensors -> ../../blobs/<sha256>``), in `sexpgpu`
subprocesses: read and pinned as the file they lead to, named as given, resumed
bit-exact, a replaced blob refused like a changed file; and links to what is not a
regular file refused in one line, without waiting on it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import save_file

from tests.e2e.helpers import assert_same_tensors

from .helpers import (
    experiment,
    head_tensors,
    run_sexpgpu,
    said,
    teacher_tensors,
    write_project,
)

REPO_DIR = "hub/models--acme--tiny"
REVISION = "7e1f6f3c2b0a9d8e7f6a5b4c3d2e1f0a9b8c7d6e"
SNAPSHOT = f"{REPO_DIR}/snapshots/{REVISION}"
TEACHER = f"{SNAPSHOT}/model.safetensors.index.json"
HEAD = f"{SNAPSHOT}/head.safetensors"
SHARDS = {
    "teacher.embed.weight": "model-00001-of-00002.safetensors",
    "teacher.head.weight": "model-00002-of-00002.safetensors",
}
HANG = 60
"""Seconds after which a `sexpgpu` that reads a FIFO is taken to wait on it forever."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def add_blob(repo: Path, name: str, data: bytes, blob: str | None = None) -> Path:
    """``snapshots/<rev>/<name>`` as the hub's cache writes it: a relative link to a
    blob named by the sha256 of its bytes (the git blob id of a small text file)."""
    if blob is None:
        blob = hashlib.sha256(data).hexdigest()
        if name.endswith(".json"):
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    (repo / "blobs" / blob).write_bytes(data)
    link = repo / "snapshots" / REVISION / name
    link.unlink(missing_ok=True)
    link.symlink_to(Path("..") / ".." / "blobs" / blob)
    return link


def hf_cache(work: Path) -> None:
    """A model repository in the hub cache's layout under ``work/hub``: a sharded
    teacher (an index and two shards) and the head's file, each a link to a blob."""
    repo = work / REPO_DIR
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    staging = work / "staging"
    staging.mkdir()
    teacher = teacher_tensors()
    for tensor, shard in SHARDS.items():
        save_file({tensor: teacher[tensor]}, str(staging / shard))
        add_blob(repo, shard, (staging / shard).read_bytes())
    index = {"metadata": {"total_size": 2048}, "weight_map": SHARDS}
    add_blob(repo, "model.safetensors.index.json", json.dumps(index).encode())
    save_file(head_tensors(), str(staging / "head.safetensors"))
    add_blob(repo, "head.safetensors", (staging / "head.safetensors").read_bytes())
    shutil.rmtree(staging)
    write_project(work, head_uri=HEAD, teacher_uri=TEACHER, files=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A project reading its weights through the hub cache's links, whose 4-step run
    checkpointed every step."""
    work = tmp_path_factory.mktemp("linked")
    hf_cache(work)
    done = run_sexpgpu("run", "loads.sx", "--checkpoint-dir", "ckpt", cwd=work)
    assert done.returncode == 0, done.stderr
    return work


def test_a_linked_file_is_read_and_pinned_as_the_blob_it_leads_to(trained: Path) -> None:
    params = {e["path"]: e for e in experiment(trained / "ckpt" / "step-00000004")["params"]}
    shard = trained / SNAPSHOT / SHARDS["teacher.head.weight"]
    blob = shard.resolve()
    assert shard.is_symlink() and blob.parent.name == "blobs"
    # named as the program names it (the shard beside the index), pinned by the
    # blob's bytes: for a hub file, the blob's own name is that sha256
    assert params["teacher.head"]["load"] == {
        "uri": f"{SNAPSHOT}/{SHARDS['teacher.head.weight']}",
        "tensor": "teacher.head.weight",
        "size": blob.stat().st_size,
        "version": f"sha256:{blob.name}",
    }
    assert params["model.head"]["load"]["uri"] == HEAD
    assert params["model.head"]["load"]["version"] == f"sha256:{sha256(trained / HEAD)}"


def test_sexpgpu_checkpoint_names_the_path_the_program_gave(trained: Path) -> None:
    done = run_sexpgpu("checkpoint", "ckpt/step-00000004", cwd=trained)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("loaded")
    head = trained / HEAD
    embed = trained / SNAPSHOT / SHARDS["teacher.embed.weight"]
    assert lines[start + 1] == (
        f"  model.head     lm_head.weight in {HEAD}, {head.stat().st_size} bytes, "
        f"sha256:{sha256(head)[:8]}..."
    )
    assert lines[start + 2] == (
        f"  teacher.embed  teacher.embed.weight in {SNAPSHOT}/{SHARDS['teacher.embed.weight']}, "
        f"{embed.stat().st_size} bytes, sha256:{embed.resolve().name[:8]}..."
    )
    assert "blobs" not in done.stdout


def test_a_resume_through_the_links_is_byte_identical(trained: Path, tmp_path: Path) -> None:
    shutil.copytree(trained / "ckpt" / "step-00000002", tmp_path / "ckpt" / "step-00000002")
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


def rewrite_the_blob(repo: Path, name: str, data: bytes) -> None:
    """The blob the link leads to gets other bytes, the link untouched."""
    (repo / "snapshots" / REVISION / name).resolve().write_bytes(data)


def point_the_link_elsewhere(repo: Path, name: str, data: bytes) -> None:
    """The link leads to another blob, as a new download of the file leaves it."""
    add_blob(repo, name, data)


@pytest.mark.parametrize("change", [rewrite_the_blob, point_the_link_elsewhere])
def test_another_blob_behind_the_link_is_refused_with_e_load_001(
    trained: Path, tmp_path: Path, change
) -> None:
    work = tmp_path / "work"
    shutil.copytree(trained, work, symlinks=True, ignore=shutil.ignore_patterns("sexpgpu-runs"))
    for step in (work / "ckpt").iterdir():
        if step.name != "step-00000002":
            shutil.rmtree(step)
    shard = SHARDS["teacher.head.weight"]
    old = work / SNAPSHOT / shard
    old_size, old_sha = old.stat().st_size, sha256(old)
    staging = tmp_path / "other.safetensors"
    save_file({"teacher.head.weight": teacher_tensors(seed=5)["teacher.head.weight"]}, str(staging))
    change(work / REPO_DIR, shard, staging.read_bytes())
    assert (work / SNAPSHOT / shard).is_symlink()
    new_size, new_sha = (work / SNAPSHOT / shard).stat().st_size, sha256(work / SNAPSHOT / shard)
    done = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "ckpt", "--resume", "latest", cwd=work
    )
    assert done.returncode == 1
    uri = f"{SNAPSHOT}/{shard}"
    assert said(done.stderr) == [
        "sexpgpu run: E-LOAD-001: a loaded parameter's file is not the one the checkpoint's run read:",
        f"  teacher.head: teacher.head.weight in {uri}, {old_size} bytes, sha256:{old_sha}"
        f" -> teacher.head.weight in {uri}, {new_size} bytes, sha256:{new_sha}",
        "restore that file, or start the run again",
    ]
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == ["step-00000002"]


def fifo(path: Path) -> None:
    os.mkfifo(path.parent / "pipe")
    path.symlink_to("pipe")


def loop(path: Path) -> None:
    (path.parent / "other.safetensors").symlink_to(path.name)
    path.symlink_to("other.safetensors")


HOSTILE = {
    "a link to a FIFO": (
        fifo,
        "E-LOAD-002: {uri} is a symbolic link to {folder}/pipe, which is not a regular file (a FIFO)",
    ),
    "a FIFO": (os.mkfifo, "E-LOAD-002: {uri} is not a regular file (a FIFO)"),
    "a link to /dev/zero": (
        lambda p: p.symlink_to("/dev/zero"),
        "E-LOAD-002: {uri} is a symbolic link to /dev/zero, which is not a regular file "
        "(a character device)",
    ),
    "a dangling link": (
        lambda p: p.symlink_to("../../blobs/0000"),
        "E-STORAGE-003: {uri} is a symbolic link to {repo}/blobs/0000, which does not exist",
    ),
    "a loop": (loop, "E-LOAD-002: {uri} is a loop of symbolic links"),
    "a link to a folder": (
        lambda p: p.symlink_to("../../blobs"),
        "E-LOAD-002: {uri} is a symbolic link to {repo}/blobs, which is not a regular file "
        "(a folder)",
    ),
}


# `run` checks the headers as `check` does; it is run too for the two that could
# hang a reader or fill its memory
HOSTILE_RUNS = [(case, "check") for case in HOSTILE] + [
    ("a link to a FIFO", "run"),
    ("a link to /dev/zero", "run"),
]


@pytest.mark.parametrize(("case", "command"), HOSTILE_RUNS)
def test_a_link_to_what_is_not_a_regular_file_is_one_line(
    tmp_path: Path, case: str, command: str
) -> None:
    hf_cache(tmp_path)
    head = tmp_path / HEAD
    head.unlink()
    make, message = HOSTILE[case]
    make(head)
    where = ["--checkpoint-dir", "ckpt"] if command == "run" else []
    # the timeout only turns a hang into a failure; nothing here is timed
    done = run_sexpgpu(command, "loads.sx", *where, cwd=tmp_path, timeout=HANG)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = said(done.stderr)
    real = tmp_path.resolve()
    expected = message.format(uri=HEAD, folder=real / SNAPSHOT, repo=real / REPO_DIR)
    # the parameter's .sx position, then the code
    assert line.removeprefix(f"sexpgpu {command}: ").startswith("loads.sx:")
    assert line.endswith(expected)
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())

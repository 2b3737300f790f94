"""The local backend makes each checkpoint file durable before it counts: its data is
fsynced before the rename that puts it in place, and the folder after the rename,
on every path a run takes through it (the probe of ``check_writable``, the files
``write_many`` writes, ``experiment.json`` last); a folder it makes is fsynced into
its parent before a checkpoint in it counts.

A kill -9 cannot show a missing fsync (the page cache outlives the process), so the
calls are recorded instead: ``os.write``, ``os.fsync``, ``os.rename``/``os.replace``
and ``os.mkdir`` in call order, each file or folder told by its inode, which a rename
keeps."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from sexpgpu.session import Selection
from sexpgpu.train import RunOptions, run
from tests.catalogs import project, tiny_program

PROGRAM = tiny_program("durable", checkpoint_every=2)
MARKER = "experiment.json"  # written last: the checkpoint counts once it exists


@dataclass(frozen=True)
class Call:
    what: str  # write, fsync, rename, mkdir
    inode: tuple[int, int]  # the file written, synced or renamed; the folder made
    path: Path | None = None  # where a rename puts the file; the folder made
    folder: tuple[int, int] | None = None  # the inode of that path's folder


def inode(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """The file system calls of this process, in order, from every thread (the backend
    writes a checkpoint's files concurrently); each is passed on to the real one."""
    recorded: list[Call] = []
    lock = threading.Lock()
    real = {name: getattr(os, name) for name in ("write", "fsync", "rename", "replace", "mkdir")}

    def note(call: Call) -> None:
        with lock:
            recorded.append(call)

    def write(fd, data):
        note(Call("write", inode(os.fstat(fd))))
        return real["write"](fd, data)

    def fsync(fd):
        note(Call("fsync", inode(os.fstat(fd))))
        return real["fsync"](fd)

    def renaming(name):
        def rename(src, dst, **kw):
            moved = inode(os.lstat(src))  # before: the name is gone afterwards
            result = real[name](src, dst, **kw)
            target = Path(os.path.abspath(dst))
            note(Call("rename", moved, target, inode(os.stat(target.parent))))
            return result

        return rename

    def mkdir(path, *args, **kw):
        result = real["mkdir"](path, *args, **kw)
        made = Path(os.path.abspath(path))
        note(Call("mkdir", inode(os.stat(made)), made, inode(os.stat(made.parent))))
        return result

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", renaming("rename"))
    monkeypatch.setattr(os, "replace", renaming("replace"))
    monkeypatch.setattr(os, "mkdir", mkdir)
    return recorded


def test_every_file_a_run_checkpoints_is_synced_before_its_rename_and_its_folder_after(
    calls, tmp_path
):
    (tmp_path / "durable.sx").write_text(PROGRAM)
    location = tmp_path / "ck"
    options = RunOptions(
        Selection(str(tmp_path / "durable.sx")),
        metrics_dir=str(tmp_path / "m"),
        checkpoint_dir=str(location),
    )
    outcome = run(options, project())
    assert outcome.exit_code == 0, outcome.message

    order = list(calls)
    renames = [
        (i, c) for i, c in enumerate(order) if c.what == "rename" and location in c.path.parents
    ]
    # every file of every checkpoint was put in place by a rename, and so was the
    # probe check_writable writes before the first step
    placed = {c.path.relative_to(location).as_posix() for _, c in renames}
    stored = {p.relative_to(location).as_posix() for p in location.rglob("*") if p.is_file()}
    assert stored == {
        f"step-{step:08d}/{name}"
        for step in (2, 4)
        for name in ("params.safetensors", "states.safetensors", "state.json", MARKER)
    }
    assert stored < placed
    assert [p for p in placed - stored if not p.startswith(".sexpgpu-probe-")] == []

    for i, rename in renames:
        name = rename.path.relative_to(location).as_posix()
        # its data: written, then fsynced after its last write and before the rename
        writes = [
            j for j, c in enumerate(order[:i]) if c.what == "write" and c.inode == rename.inode
        ]
        assert writes, f"{name}: no write of the file renamed into place"
        synced = [
            j
            for j, c in enumerate(order[writes[-1] : i])
            if c.what == "fsync" and c.inode == rename.inode
        ]
        assert synced, f"{name}: its data was not fsynced before its rename"
        # the rename: the folder fsynced after it; for a file of a checkpoint, before
        # the marker that makes the checkpoint count is renamed into the same folder
        folder_synced = [
            j
            for j, c in enumerate(order)
            if j > i and c.what == "fsync" and c.inode == rename.folder
        ]
        assert folder_synced, f"{name}: its folder was not fsynced after the rename"
        if rename.path.parent != location and rename.path.name != MARKER:
            (marker,) = [j for j, c in renames if j > i and c.path == rename.path.with_name(MARKER)]
            assert folder_synced[0] < marker, (
                f"{name}: its folder was not fsynced between its rename and {MARKER}'s"
            )


def test_a_folder_a_run_makes_for_its_checkpoints_is_synced_into_its_parent(calls, tmp_path):
    # A file renamed into a new folder is durable only once the folder's own name is:
    # after a power cut a step folder whose parent was never fsynced may be gone,
    # with the checkpoint the status file named and the older ones retention deleted.
    (tmp_path / "durable.sx").write_text(PROGRAM)
    location = tmp_path / "ck"
    options = RunOptions(
        Selection(str(tmp_path / "durable.sx")),
        metrics_dir=str(tmp_path / "m"),
        checkpoint_dir=str(location),
        keep_last=1,
    )
    outcome = run(options, project())
    assert outcome.exit_code == 0, outcome.message

    order = list(calls)
    made = [
        (i, c)
        for i, c in enumerate(order)
        if c.what == "mkdir" and location in (c.path, *c.path.parents)
    ]
    assert {c.path for _, c in made} == {
        location,
        location / "step-00000002",
        location / "step-00000004",
    }
    for i, folder in made:
        synced = [
            j
            for j, c in enumerate(order)
            if j > i and c.what == "fsync" and c.inode == folder.folder
        ]
        assert synced, f"{folder.path}: its parent was not fsynced after it was made"
        markers = [
            j for j, c in enumerate(order) if c.what == "rename" and c.path == folder.path / MARKER
        ]
        if markers:  # a step folder: its name is durable before the checkpoint counts
            assert synced[0] < markers[0], f"{folder.path}: made durable only after {MARKER}"

"""The folders a bundle run unpacks into: removed at its end; after a `kill -9`, by the
next run that makes one, once the killed process is gone; never while a process holds
one, nor another user's."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sexpgpu_bundle import scratch
from sexpgpu_bundle.scratch import OWNER, PREFIX, remove_abandoned
from tests.e2e.helpers import EXAMPLES, run_sexpgpu, sexpgpu_env, start_sexpgpu


def _gone_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def _folder(root: Path, pid: int, *, lock: bool = True) -> Path:
    folder = root / f"{PREFIX}{pid}-abc"
    (folder / "unpacked" / "sources").mkdir(parents=True)
    (folder / "unpacked" / "sources" / "run.sx").write_text("(defknob a 1)")
    if lock:
        (folder / OWNER).write_text("")
    return folder


def test_a_folder_whose_process_is_gone_is_removed_and_no_other(tmp_path: Path) -> None:
    gone = _folder(tmp_path, _gone_pid())
    unlocked_gone = _folder(tmp_path, _gone_pid(), lock=False)
    # a live process, its lock file not made yet: judged by its pid
    starting = _folder(tmp_path, os.getppid(), lock=False)
    mine = _folder(tmp_path, os.getpid())
    unnamed = tmp_path / f"{PREFIX}notapid-x"  # an older sexpgpu's: whose, nobody knows
    unnamed.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    link = tmp_path / f"{PREFIX}{_gone_pid()}-link"
    link.symlink_to(victim)
    assert sorted(remove_abandoned(str(tmp_path))) == sorted([gone, unlocked_gone])
    assert not gone.exists() and not unlocked_gone.exists()
    assert starting.exists() and mine.exists() and unnamed.exists() and link.is_symlink()
    assert (victim / "keep").read_text() == "mine"


def test_a_folder_whose_lock_is_held_is_kept_whatever_its_name_says(tmp_path: Path) -> None:
    folder = _folder(tmp_path, _gone_pid())  # a pid reused, or another pid namespace's
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n",
         str(folder / OWNER)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert remove_abandoned(str(tmp_path)) == [] and folder.exists()
    finally:
        holder.kill()
        holder.wait()
    assert remove_abandoned(str(tmp_path)) == [folder] and not folder.exists()


def test_another_user_s_folder_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path, _gone_pid())
    uid = os.getuid()
    monkeypatch.setattr(scratch.os, "getuid", lambda: uid + 1)
    assert remove_abandoned(str(tmp_path)) == [] and folder.exists()


def test_a_new_folder_is_named_for_its_process_and_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scratch.tempfile, "tempdir", str(tmp_path))
    folder = scratch.new_scratch_folder()
    try:
        assert folder.parent == tmp_path and folder.name.startswith(f"{PREFIX}{os.getpid()}-")
        lock = os.open(folder / OWNER, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # another open file: the lock is held
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(lock)
    finally:
        os.close(scratch._HELD.pop())
        (folder / OWNER).unlink()
        folder.rmdir()


def _scratch_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX))


def _wait_for_unpacked(root: Path, process: subprocess.Popen, seconds: float = 120) -> Path:
    """The folder ``process`` unpacked its bundle into, under ``root``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [
            p
            for p in _scratch_folders(root)
            if p.name.startswith(f"{PREFIX}{process.pid}-") and (p / "unpacked").exists()
        ]
        if found:
            return found[0]
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError("the run never unpacked its bundle")


def test_a_killed_run_s_folder_is_removed_by_the_next_run_and_a_live_one_s_kept(
    tmp_path: Path,
) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = sexpgpu_env(TMPDIR=str(temporary))
    made = run_sexpgpu("bundle", EXAMPLES / "my-run.sx", "-o", "run.sxb", cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    long = ("run", "run.sxb", "--steps", "1000000", "--metrics-dir", "m")
    killed = start_sexpgpu(*long, cwd=tmp_path, env=env)
    left = _wait_for_unpacked(temporary, killed)
    assert left.name.startswith(f"{PREFIX}{killed.pid}-")
    killed.kill()  # SIGKILL: no exit handler runs
    killed.communicate()
    assert left.exists()
    alive = start_sexpgpu(*long, cwd=tmp_path, env=env)
    try:
        held = _wait_for_unpacked(temporary, alive)
        assert not left.exists()  # the next run removed it
        again = run_sexpgpu("run", "run.sxb", "--steps", "1", "--metrics-dir", "m", cwd=tmp_path,
                            env=env)  # fmt: skip
        assert again.returncode == 0, again.stderr[-3000:]
        assert _scratch_folders(temporary) == [held]  # a live run's, kept; its own, removed
    finally:
        alive.kill()
        alive.communicate()

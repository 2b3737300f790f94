"""Temporary folders a bundle command works in, and the removal of those a killed one left.

A run from a bundle unpacks it into a folder of its own under the system's temporary
folder and removes it at exit; ``kill -9`` leaves it. So each folder names the process
that made it (``sexpgpu-bundle-<pid>-<random>``) and holds a lock file that process
keeps locked (``flock``) for as long as it lives: the kernel lets go of the lock when
the process dies, however it dies. The next command that makes such a folder first
removes every one whose lock nobody holds, of its own user, and never one of a live
process: a folder without its lock file yet is judged by its pid alone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "sexpgpu-bundle-"
"""The name every such folder starts with."""

OWNER = ".owner.lock"
"""The lock file in each folder, locked by the process that made it."""

_HELD: list[int] = []  # this process's lock files, open (and so locked) until it ends
_NAMED = re.compile(rf"^{re.escape(PREFIX)}(\d{{1,9}})-")  # no pid is longer


def new_scratch_folder() -> Path:
    """A new, empty folder of this process under the temporary folder, held until the
    process ends; folders of processes that are gone are removed first."""
    remove_abandoned()
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    lock = os.open(folder / OWNER, flags, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    _HELD.append(lock)
    return folder


def remove_abandoned(root: str | None = None) -> list[Path]:
    """Remove each of this user's scratch folders under ``root`` (the temporary folder)
    whose process is gone; returns them."""
    removed = []
    base = root or tempfile.gettempdir()
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        named = _NAMED.match(entry.name)
        if named is None or int(named.group(1)) == os.getpid():
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if _remove_if_abandoned(Path(entry.path), int(named.group(1))):
            removed.append(Path(entry.path))
    return removed


def _remove_if_abandoned(folder: Path, pid: int) -> bool:
    """Remove ``folder`` when nobody holds its lock (or, without a lock file, when the
    process ``pid`` is gone); whether it was removed."""
    try:
        lock = os.open(folder / OWNER, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        if _alive(pid):
            return False  # made a moment ago, its lock file not yet there
        shutil.rmtree(folder, ignore_errors=True)
        return True
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return False  # its process (or a child it forked) still holds it
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(lock)
    return True


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True

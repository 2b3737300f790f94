"""A local file read once, front to back, while a thread of its own hashes it.

A local ``:load`` file's identity is its sha256, a pass over every byte. The read
does not wait for the hash (sha256 is slower than a read from the page cache),
only for the scratch chunks it reads the bytes no tensor takes into; so the
values are ready at the read's speed and the identity follows
(:meth:`Hashing.result`). A file that changes before it is hashed is ``E-LOAD-005``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from queue import SimpleQueue
from typing import TYPE_CHECKING, Protocol

import numpy as np

from sexpgpu.checkpoint.storage import NO_SUCH_LOCATION, READ_FAILED
from sexpgpu.errors import SexpError
from sexpgpu.extension import ObjectIdentity

if TYPE_CHECKING:
    from sexpgpu.extension import Storage

__all__ = ["E_MOVED_UNDER", "Hashing", "LocalFile", "changed", "moved", "read_into", "stat_of"]

E_MOVED_UNDER = "E-LOAD-005"
"""A file that changed while the run was reading it."""
CHUNK = 8 << 20
"""Bytes per read: few calls, and a chunk is still in the processor's cache when
the hashing thread takes it."""
SCRATCH = 4
"""Scratch chunks (bytes no tensor takes) read and not yet hashed, at most."""


class LocalFile(Protocol):
    """What a pass needs of a local safetensors file (``loads.LocalFile``)."""

    uri: str
    path: str | None
    key: str
    storage: Storage
    header_bytes: bytes


class Hashing:
    """A file's sha256 on a daemon thread of its own, fed its chunks in file order;
    :meth:`result` waits for it. A daemon, so a run that stops early does not wait."""

    def __init__(self, file: LocalFile, before: os.stat_result) -> None:
        self.file = file
        self.before = before
        self.room = threading.Semaphore(SCRATCH)
        """Scratch chunks that may wait to be hashed; each is freed once hashed."""
        self._chunks: SimpleQueue[tuple[memoryview, bool] | None] = SimpleQueue()
        self._done = threading.Event()
        self._identity: ObjectIdentity | None = None
        self._error: SexpError | None = None
        self._stopped = False
        threading.Thread(target=self._run, name="sexpgpu-sha256", daemon=True).start()

    def feed(self, view: memoryview, *, scratch: bool) -> None:
        """Hash ``view`` after what came before it (a scratch chunk frees its room)."""
        self._chunks.put((view, scratch))

    def finish(self) -> None:
        """Every chunk is fed: check the file did not change, and name its identity."""
        self._chunks.put(None)

    def stop(self) -> None:
        """The read failed: end the thread without an identity."""
        self._stopped = True
        self._chunks.put(None)

    def result(self) -> ObjectIdentity:
        """The file's identity once hashed; ``E-LOAD-005`` if it changed meanwhile."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._identity is not None
        return self._identity

    def _run(self) -> None:
        digest = hashlib.sha256()
        try:
            while (chunk := self._chunks.get()) is not None:
                view, scratch = chunk
                digest.update(view)
                if scratch:
                    self.room.release()
            if not self._stopped:
                if moved(self.before, stat_of(self.file)):
                    raise changed(self.file.uri)
                version = f"sha256:{digest.hexdigest()}"
                self._identity = ObjectIdentity(size=self.before.st_size, version=version)
        except SexpError as error:
            self._error = error
        finally:
            self._done.set()


def read_into(file: LocalFile, plan: list[tuple[int, memoryview | None]], hashing: Hashing) -> None:
    """Read ``file`` up to the last place in ``plan`` (``(start, where its bytes go)``,
    in file order; ``None`` for the end), feeding every byte to ``hashing`` in order."""
    into = file.storage.read_range_into
    expected = len(file.header_bytes).to_bytes(8, "little") + file.header_bytes
    offset = 0

    def read(view: memoryview, scratch: bool) -> None:
        nonlocal offset
        if into(file.key, offset, view) != len(view):
            raise changed(file.uri)  # shorter than it was a moment ago
        hashing.feed(view, scratch=scratch)
        offset += len(view)

    for start, target in plan:
        while offset < start:  # bytes no tensor wanted: the header, other tensors
            hashing.room.acquire()  # a scratch chunk hashed: its memory may go
            view = memoryview(np.empty(min(CHUNK, start - offset), np.uint8))
            at = offset
            read(view, True)
            if at < len(expected):
                seen = min(len(view), len(expected) - at)
                if view[:seen] != expected[at : at + seen]:
                    raise changed(file.uri)
        if target is not None:
            for at in range(0, len(target), CHUNK):
                read(target[at : at + CHUNK], False)


def stat_of(file: LocalFile) -> os.stat_result:
    assert file.path is not None
    try:
        return os.stat(file.path)
    except FileNotFoundError:
        raise SexpError(f"{file.uri} was removed", code=NO_SUCH_LOCATION) from None
    except OSError as exc:
        raise SexpError(
            f"cannot read {file.uri}: {exc.strerror or type(exc).__name__}", code=READ_FAILED
        ) from None


def moved(before: os.stat_result, after: os.stat_result) -> bool:
    fields = ("st_dev", "st_ino", "st_size", "st_mtime_ns")
    return any(getattr(before, f) != getattr(after, f) for f in fields)


def changed(uri: str) -> SexpError:
    return SexpError(
        f"{uri} changed while it was being read; run again once it is written",
        code=E_MOVED_UNDER,
    )

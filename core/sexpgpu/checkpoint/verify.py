"""Checking a checkpoint's data: every file ``experiment.json`` records a size and
CRC32C for is read whole, in chunks, and compared with its record by the checks a
resume makes (:mod:`sexpgpu.checkpoint.integrity`), never held in memory whole.

``sexpgpu checkpoint --verify`` reports the result file by file. A resume needs no
pass of its own: it checks each file as it reads it
(:func:`sexpgpu.checkpoint.load_checkpoint`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.integrity import Crc32c, difference
from sexpgpu.checkpoint.keys import EXPERIMENT_FILE, FILES, file_key, location_of
from sexpgpu.checkpoint.read import missing, read_experiment
from sexpgpu.checkpoint.storage import NO_SUCH_LOCATION
from sexpgpu.errors import StorageError

if TYPE_CHECKING:
    from sexpgpu.extension import Storage

CHUNK = 8 << 20
"""How many bytes of a file one read asks for."""

# Reads in flight at once: a bucket serves several ranged GETs of an object faster
# than one after another. Memory stays under (_AHEAD + 1) * CHUNK per file.
_AHEAD = 4


@dataclass(frozen=True)
class FileCheck:
    """One file of a checkpoint against what ``experiment.json`` records of it."""

    name: str
    """The file's name in the checkpoint (``params.safetensors``)."""
    location: str
    """Where it is, as users write it (for messages)."""
    recorded: Mapping[str, Any] | None
    """``{"size", "crc32c"}`` as ``experiment.json`` records it; ``None`` in a checkpoint
    written before checksums, and then the file is not read."""
    size: int | None = None
    """The bytes the file holds, ``None`` when it was not read."""
    crc32c: str | None = None
    """Its CRC32C (base64 of the 4 big-endian bytes), ``None`` when it was not read."""
    damage: str | None = None
    """How it differs from its record, worded as a resume words it after the file's
    name (:func:`sexpgpu.checkpoint.integrity.not_written` makes the resume's
    ``E-CKPT-006`` of it); ``None`` when it does not differ, or was not read."""

    @property
    def verified(self) -> bool:
        """Whether the file was read and has the recorded size and CRC32C."""
        return self.recorded is not None and self.damage is None


def verify_checkpoint(storage: Storage, key: str, *, chunk: int = CHUNK) -> Iterator[FileCheck]:
    """Every file of the checkpoint at ``key`` but ``experiment.json`` (which holds the
    records) checked against its recorded size and CRC32C, in the order they are
    written, each yielded once it is read (a file of many GB takes a while).

    Reads each file in ``chunk``-byte ranged reads, a few at a time, so memory stays
    bounded whatever the file's size. A file that is missing is ``E-CKPT-002``; a
    location without ``experiment.json`` ``E-CKPT-001``.
    """
    if chunk < 1:
        raise ValueError("chunk must be at least 1 byte")
    records = read_experiment(storage, key).get("files") or {}
    for name in FILES:
        if name == EXPERIMENT_FILE:
            continue
        path = file_key(key, name)
        recorded = records.get(name)
        check = FileCheck(name, location_of(storage, path), recorded)
        if recorded is not None:
            size, checksum = _checksum(storage, path, recorded["size"], chunk)
            said = difference(recorded, size, checksum)
            check = FileCheck(check.name, check.location, recorded, size, checksum, said)
        yield check


def _checksum(storage: Storage, path: str, expected: int, chunk: int) -> tuple[int, str]:
    """The size and CRC32C of the file at ``path``, read in order in ``chunk``-byte
    pieces with up to ``_AHEAD`` reads in flight. Reads are asked for up to the byte
    after the ``expected`` size (to see a longer file), and on while they come back
    full, so a file of the recorded size costs one request per chunk."""
    crc = Crc32c()
    # A backend that fills a buffer is handed the same few again and again: no
    # allocation per chunk, which the worker threads' malloc arenas would keep.
    fills = storage.read_range_into is not None
    free: list[Any] = []
    pending: deque[tuple[Future[memoryview], Any]] = deque()
    start = 0
    pool = ThreadPoolExecutor(max_workers=_AHEAD, thread_name_prefix="sexpgpu-verify")
    try:
        while True:
            while len(pending) < _AHEAD and start <= expected:
                buffer = (free.pop() if free else _buffer(chunk)) if fills else None
                future = pool.submit(_read, storage, path, start, chunk, buffer)
                pending.append((future, buffer))
                start += chunk
            if not pending:  # every byte up to the recorded size was there and full
                expected = start  # a longer file than recorded: read on to its end
                continue
            future, buffer = pending.popleft()
            piece = future.result()
            crc.update(piece)
            if buffer is not None:
                free.append(buffer)  # checksummed: the next read may fill it
            if len(piece) < chunk:  # the end of the file
                return crc.size, crc.text()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _buffer(size: int) -> Any:
    import numpy as np

    # np.empty writes none of its bytes: a small file's read touches little more than its own.
    return np.empty(size, dtype=np.uint8)


def _read(storage: Storage, path: str, start: int, chunk: int, buffer: Any) -> memoryview:
    """``chunk`` bytes of ``path`` from ``start``, fewer at its end: filled into
    ``buffer`` by the backend's ``read_range_into`` when one is given, else as
    ``read_range`` returns them. A file that is not there is ``E-CKPT-002``."""
    try:
        if buffer is not None:
            view = memoryview(buffer)
            return view[: storage.read_range_into(path, start, view)]  # type: ignore[attr-defined]
        return memoryview(storage.read_range(path, start, chunk))
    except StorageError as exc:
        if exc.code != NO_SUCH_LOCATION:
            raise
        raise missing(storage, path) from None

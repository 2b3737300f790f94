"""A checkpoint location in a folder: atomic writes (temp file, fsync, rename), sha256 identity."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import secrets
import stat
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from sexpgpu.checkpoint.storage import (
    ACCESS_DENIED,
    CANNOT_LIST,
    NO_SUCH_LOCATION,
    NOT_A_FILE,
    PROBE_PREFIX,
    READ_FAILED,
    WRITE_FAILED,
)
from sexpgpu.errors import StorageError
from sexpgpu.extension import ObjectIdentity, Storage

TEMP_PREFIX = ".sexpgpu-tmp-"
"""Names of files being written; never listed, so a cut-off write is invisible."""


_MAX_WORKERS = 8
_HASH_CHUNK = 4 << 20
_WRITE_CHUNK = 8 << 20


def path_of(uri: str) -> Path:
    """The folder a plain path or ``file://`` URI names, made absolute."""
    if uri.lower().startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(
                f"{uri}: a file:// location must be on this machine (file:///path)",
                code=NO_SUCH_LOCATION,
            )
        raw = unquote(parsed.path)
    else:
        raw = uri
    return Path(os.path.abspath(os.path.expanduser(raw)))


# The code of an operation that failed on the way to its file; a permission refused
# is ACCESS_DENIED but for a listing, which is CANNOT_LIST as in list_children.
_FAILED = {"read": READ_FAILED, "list": CANNOT_LIST, "write": WRITE_FAILED, "delete": WRITE_FAILED}


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


class LocalStorage(Storage):
    """A folder on a local or mounted file system, opened as a checkpoint location."""

    def __init__(self, uri: str) -> None:
        self.root = path_of(uri)
        self.uri = uri.rstrip("/") or "/"

    # -- helpers

    def _path(self, key: str, doing: str = "read") -> Path:
        """The path of ``key``, refusing a key that climbs out and any symbolic link
        on the way below the location (a step folder linked elsewhere would be read,
        and written through, as if it were this run's).

        A folder on the way that cannot be searched (no permission on a ``step-<n>``)
        is a StorageError for ``doing`` (``read``, ``list``, ``write``, ``delete``), like the
        operation itself failing there."""
        parts = [p for p in key.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            raise StorageError(
                f"{self.uri}: the key {key!r} leaves the location", code=NO_SUCH_LOCATION
            )
        path = self.root
        for depth, part in enumerate(parts, 1):
            path = path / part
            try:
                linked = path.is_symlink()
            except OSError as exc:  # is_symlink passes on EACCES, EIO...
                denied = isinstance(exc, PermissionError) and doing != "list"
                code = ACCESS_DENIED if denied else _FAILED[doing]
                raise StorageError(
                    f"cannot {doing} {self._where(key)}: {_reason(exc)}", code=code
                ) from None
            if linked:
                raise StorageError(
                    f"{self._where('/'.join(parts[:depth]))} is a symbolic link; a checkpoint "
                    "location holds only real folders and files",
                    code=NOT_A_FILE,
                )
        return path

    def _where(self, key: str) -> str:
        return f"{self.uri}/{key}" if key else self.uri

    # -- Storage

    def describe(self) -> str:
        """The folder, absolute."""
        return f"local folder {self.root}"

    def check_writable(self) -> None:
        """Write and delete a probe file in the folder, made if need be; the folders the
        probe made are removed again, so that a run refused before its first
        checkpoint leaves no folder behind (a checkpoint's write makes them)."""
        made = []
        missing = self.root
        while not missing.exists() and not missing.is_symlink() and missing != missing.parent:
            made.append(missing)
            missing = missing.parent
        try:
            _make_folders(self.root)
        except PermissionError as exc:
            raise StorageError(
                f"cannot create the checkpoint folder {self.root}: {_reason(exc)}",
                code=ACCESS_DENIED,
            ) from None
        except (FileExistsError, NotADirectoryError):
            raise StorageError(
                f"cannot use {self.root} as a checkpoint folder: a file is in the way",
                code=CANNOT_LIST,
            ) from None
        except OSError as exc:
            raise StorageError(
                f"cannot create the checkpoint folder {self.root}: {_reason(exc)}",
                code=WRITE_FAILED,
            ) from None
        self.list_children()
        probe = PROBE_PREFIX + secrets.token_hex(6)
        self.write(probe, b"sexpgpu write probe\n")
        self.delete(probe)
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break  # something else is in it now: it stays

    def list_children(self, prefix: str = "") -> list[str]:
        """Sorted names under ``prefix``; [] when the folder does not exist."""
        folder = self._path(prefix, "list")
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise StorageError(
                f"cannot list {self._where(prefix)}: it is a file, not a folder",
                code=CANNOT_LIST,
            ) from None
        except OSError as exc:
            raise StorageError(
                f"cannot list {self._where(prefix)}: {_reason(exc)}", code=CANNOT_LIST
            ) from None
        return sorted(n for n in names if not n.startswith((TEMP_PREFIX, PROBE_PREFIX)))

    def exists(self, key: str) -> bool:
        """Whether a file (not a folder) is at ``key``; a link, a device or a FIFO there
        is an error (``E-STORAGE-007``) rather than no file, so it is never passed over."""
        path = self._path(key)
        try:
            info = path.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._read_error(key, exc) from None
        if stat.S_ISDIR(info.st_mode):
            return False
        if not stat.S_ISREG(info.st_mode):
            raise StorageError(
                f"{self._where(key)} is not a regular file; a checkpoint location holds "
                "only real folders and files",
                code=NOT_A_FILE,
            )
        return True

    def _read_error(self, key: str, exc: OSError) -> StorageError:
        if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            return StorageError(f"{self._where(key)} does not exist", code=NO_SUCH_LOCATION)
        if isinstance(exc, PermissionError):
            return StorageError(
                f"cannot read {self._where(key)}: {_reason(exc)}", code=ACCESS_DENIED
            )
        return StorageError(f"cannot read {self._where(key)}: {_reason(exc)}", code=READ_FAILED)

    def _open_file(self, key: str) -> int:
        """A descriptor of the regular file at ``key``; anything else (a device, a FIFO,
        a socket, a folder, a link) is refused without blocking or reading it."""
        path = self._path(key)
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer forever.
        fd = os.open(
            path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        )
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise StorageError(
                f"{self._where(key)} is not a regular file; a checkpoint location holds "
                "only real folders and files",
                code=NOT_A_FILE,
            )
        os.set_blocking(fd, True)
        return fd

    def read(self, key: str) -> bytes:
        """The whole file, read up to the size it has (never without bound)."""
        try:
            fd = self._open_file(key)
            with open(fd, "rb") as f:
                return f.read(os.fstat(fd).st_size)
        except OSError as exc:
            raise self._read_error(key, exc) from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start``; fewer at the end of the file."""
        if start < 0 or length < 0:
            raise ValueError("start and length must not be negative")
        try:
            with open(self._open_file(key), "rb") as f:
                f.seek(start)
                return f.read(length)
        except OSError as exc:
            raise self._read_error(key, exc) from None

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Fill ``buffer`` with the bytes of ``key`` from ``start``; returns how many
        were there (fewer at the end of the file). Reads straight into the caller's
        memory: a large tensor is copied once, from the page cache."""
        if start < 0:
            raise ValueError("start must not be negative")
        try:
            fd = self._open_file(key)
            try:
                done = 0
                while done < len(buffer):
                    got = os.preadv(fd, [buffer[done:]], start + done)
                    if got == 0:
                        break
                    done += got
                return done
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._read_error(key, exc) from None

    def write(self, key: str, data: bytes | memoryview) -> None:
        """Write a temp file beside the target, fsync it, rename it over, fsync the folder."""
        _fsync_folder(self._write_file(key, data))

    def _write_file(self, key: str, data: bytes | memoryview) -> Path:
        """Write and fsync a temp file beside the target and rename it over; returns
        the folder, whose fsync (making the rename durable) is the caller's."""
        target = self._path(key, "write")
        if not key.strip("/"):
            raise StorageError(f"{self.uri}: cannot write an object without a name")
        temp: Path | None = None
        try:
            _make_folders(target.parent)
            temp = target.with_name(TEMP_PREFIX + target.name + "-" + secrets.token_hex(4))
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                # Pieces of a few MB, each handed to the disk as soon as it is written,
                # so the disk works while the next piece is copied and the fsync
                # finds little left to do (about a third off a large file's write).
                for start in range(0, len(view), _WRITE_CHUNK):
                    piece = view[start : start + _WRITE_CHUNK]
                    written = 0
                    while written < len(piece):
                        written += os.write(fd, piece[written:])
                    if _WRITEBACK is not None and len(view) > _WRITE_CHUNK:
                        _WRITEBACK(fd, start, len(piece), _SYNC_FILE_RANGE_WRITE)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, target)
            temp = None
            return target.parent
        except OSError as exc:
            code = ACCESS_DENIED if isinstance(exc, PermissionError) else WRITE_FAILED
            if exc.errno == errno.ENOSPC:
                code = WRITE_FAILED
            raise StorageError(
                f"cannot write {self._where(key)}: {_reason(exc)}", code=code
            ) from None
        finally:
            if temp is not None:
                try:
                    os.unlink(temp)
                except OSError:
                    pass

    def write_many(self, items: Mapping[str, bytes | memoryview]) -> None:
        """Write every item concurrently, the largest on the calling thread, then fsync
        each folder once; the first failure is raised once all finish."""
        order = sorted(items, key=lambda key: -memoryview(items[key]).nbytes)
        if not order:
            return
        folders: set[Path] = set()
        failures: list[StorageError] = []
        pool = (
            ThreadPoolExecutor(max_workers=min(_MAX_WORKERS, len(order) - 1))
            if len(order) > 1
            else None
        )
        try:
            futures = (
                [pool.submit(self._write_file, key, items[key]) for key in order[1:]]
                if pool
                else []
            )
            try:
                folders.add(self._write_file(order[0], items[order[0]]))
            except StorageError as exc:
                failures.append(exc)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        for future in futures:
            if future.exception() is not None:
                failures.append(future.exception())
            else:
                folders.add(future.result())
        for folder in folders:
            _fsync_folder(folder)
        if failures:
            raise failures[0]

    def delete(self, key: str) -> None:
        """Remove the file, then any folders it leaves empty (as an object store would)."""
        target = self._path(key, "delete")
        try:
            target.unlink()
        except FileNotFoundError:
            return
        except IsADirectoryError:
            raise StorageError(
                f"cannot delete {self._where(key)}: it is a folder", code=WRITE_FAILED
            ) from None
        except OSError as exc:
            code = ACCESS_DENIED if isinstance(exc, PermissionError) else WRITE_FAILED
            raise StorageError(
                f"cannot delete {self._where(key)}: {_reason(exc)}", code=code
            ) from None
        # Empty step folders would otherwise still be listed as children, unlike on S3/GCS.
        parent = target.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def remove_temporaries(self, prefix: str = "") -> None:
        """Remove the ``.sexpgpu-tmp-*`` files directly under ``prefix``: what writes
        cut off left (the checkpoint layer calls this once no write there is running)."""
        folder = self._path(prefix, "list")
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            if name.startswith(TEMP_PREFIX):
                try:
                    os.unlink(folder / name)
                except OSError:
                    pass

    def identity(self, key: str) -> ObjectIdentity:
        """Size and ``sha256:<hex>`` of the file's bytes."""
        digest = hashlib.sha256()
        size = 0
        try:
            with open(self._open_file(key), "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise self._read_error(key, exc) from None
        return ObjectIdentity(size=size, version=f"sha256:{digest.hexdigest()}")


def _writeback() -> Any:
    """Linux's ``sync_file_range`` (start writing a range to disk, without waiting), or
    ``None`` elsewhere; Python's ``os`` does not offer it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_SYNC_FILE_RANGE_WRITE = 2
_WRITEBACK = _writeback()


def _make_folders(folder: Path) -> None:
    """``folder`` and the folders missing above it, each fsynced into its parent once
    made: a file renamed into a new folder is durable only once the folder's name is,
    or a power cut could take a stored checkpoint's whole folder with it."""
    if folder.is_dir():
        return
    _make_folders(folder.parent)
    try:
        folder.mkdir()
    except FileExistsError:
        if not folder.is_dir():  # a file in the way
            raise
    # always, even when a concurrent write made it: its name may not be durable yet
    _fsync_folder(folder.parent)


def _fsync_folder(folder: Path) -> None:
    # Makes the rename itself durable; some file systems refuse to fsync a folder.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

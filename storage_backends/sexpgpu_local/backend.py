"""A checkpoint location in a folder: atomic writes (temp file, fsync, rename), sha256 identity."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote, urlparse

from sexpgpu.errors import StorageError
from sexpgpu.extension import ObjectIdentity
from sexpgpu.storage import (
    ACCESS_DENIED,
    CANNOT_LIST,
    NO_SUCH_LOCATION,
    PROBE_PREFIX,
    READ_FAILED,
    WRITE_FAILED,
)

TEMP_PREFIX = ".sexpgpu-tmp-"
"""Names of files being written; never listed, so a cut-off write is invisible."""


_MAX_WORKERS = 8
_HASH_CHUNK = 4 << 20


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


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


class LocalStorage:
    """A folder on a local or mounted file system, opened as a checkpoint location."""

    def __init__(self, uri: str) -> None:
        self.root = path_of(uri)
        self.uri = uri.rstrip("/") or "/"

    # -- helpers

    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            raise StorageError(
                f"{self.uri}: the key {key!r} leaves the location", code=NO_SUCH_LOCATION
            )
        return self.root.joinpath(*parts)

    def _where(self, key: str) -> str:
        return f"{self.uri}/{key}" if key else self.uri

    # -- Storage

    def describe(self) -> str:
        """The folder, absolute."""
        return f"local folder {self.root}"

    def check_writable(self) -> None:
        """Create the folder if needed, then write and delete a probe file."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
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

    def list_children(self, prefix: str = "") -> list[str]:
        """Sorted names under ``prefix``; [] when the folder does not exist."""
        folder = self._path(prefix)
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
        """Whether a file (not a folder) is at ``key``."""
        return self._path(key).is_file()

    def _read_error(self, key: str, exc: OSError) -> StorageError:
        if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            return StorageError(f"{self._where(key)} does not exist", code=NO_SUCH_LOCATION)
        if isinstance(exc, PermissionError):
            return StorageError(
                f"cannot read {self._where(key)}: {_reason(exc)}", code=ACCESS_DENIED
            )
        return StorageError(f"cannot read {self._where(key)}: {_reason(exc)}", code=READ_FAILED)

    def read(self, key: str) -> bytes:
        """The whole file."""
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except OSError as exc:
            raise self._read_error(key, exc) from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start``; fewer at the end of the file."""
        if start < 0 or length < 0:
            raise ValueError("start and length must not be negative")
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(length)
        except OSError as exc:
            raise self._read_error(key, exc) from None

    def write(self, key: str, data: bytes | memoryview) -> None:
        """Write a temp file beside the target, fsync it, rename it over, fsync the folder."""
        target = self._path(key)
        if not key.strip("/"):
            raise StorageError(f"{self.uri}: cannot write an object without a name")
        temp: Path | None = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = target.with_name(TEMP_PREFIX + target.name + "-" + secrets.token_hex(4))
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, target)
            temp = None
            _fsync_folder(target.parent)
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
        """Write every item on its own thread; the first failure is raised once all finish."""
        if len(items) <= 1:
            for key, data in items.items():
                self.write(key, data)
            return
        with ThreadPoolExecutor(max_workers=min(_MAX_WORKERS, len(items))) as pool:
            futures = [pool.submit(self.write, key, data) for key, data in items.items()]
        for future in futures:
            future.result()

    def delete(self, key: str) -> None:
        """Remove the file, then any folders it leaves empty (as an object store would)."""
        target = self._path(key)
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

    def identity(self, key: str) -> ObjectIdentity:
        """Size and ``sha256:<hex>`` of the file's bytes."""
        digest = hashlib.sha256()
        size = 0
        try:
            with open(self._path(key), "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise self._read_error(key, exc) from None
        return ObjectIdentity(size=size, version=f"sha256:{digest.hexdigest()}")


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

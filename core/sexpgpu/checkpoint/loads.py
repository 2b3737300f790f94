"""Reading ``:load`` and ``with-loaded`` tensors from safetensors files.

A file is opened through the storage backend that serves its scheme (a local
path, ``file://``, ``s3://``, ``gs://`` or a third party's), so nothing here
knows a scheme. Reading is lazy and bounded: the header is one ranged read
(8 bytes of length, then the JSON), each tensor a program names one more,
concurrent across tensors; a file is never read whole. A sharded checkpoint's
``model.safetensors.index.json`` names the shard that holds each tensor, and
the shard is what a checkpoint pins. A file's identity (size and version, from
the backend's ``identity``) is read once per run.

Torch-free: ``sexpgpu check`` reads headers through this module too.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sexpgpu.checkpoint.keys import is_count
from sexpgpu.errors import Pos, SexpError, SourceError, StorageError

if TYPE_CHECKING:
    from sexpgpu.extension import ObjectIdentity, Opener, Storage
    from sexpgpu.lang.ir import ParamDecl, Program

E_CHANGED = "E-LOAD-001"
"""A resume whose ``:load`` file is not the bytes the checkpoint's run read."""
E_NOT_SAFETENSORS = "E-LOAD-002"
"""A ``:load`` file that is not a whole safetensors file (or index)."""
E_NO_TENSOR = "E-LOAD-003"
"""A tensor name the file does not hold."""
E_MISMATCH = "E-LOAD-004"
"""A tensor whose shape or dtype the parameter cannot take."""
E_MOVED_UNDER = "E-LOAD-005"
"""A file that changed while the run was reading it."""

MAX_HEADER = 100_000_000
"""A header longer than this is not a safetensors file (the format's own limit)."""

# The file dtypes a float parameter takes, and how their bytes become f32.
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
_INTEGERS = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"}
_READERS = 16
"""Concurrent ranged reads; a bucket serves each tensor as its own request."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a safetensors header: dtype, shape and its bytes' place in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    length: int


@dataclass
class SafetensorsFile:
    """A safetensors file opened for ranged reads: its location and its header."""

    uri: str
    storage: Storage
    key: str
    tensors: dict[str, TensorEntry]
    header_bytes: bytes

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as f32, read with one ranged request."""
        entry = self.tensors[name]
        into = getattr(self.storage, "read_range_into", None)
        if entry.dtype == "F32" and into is not None:
            # A backend that reads into memory it is given (the local one) fills the
            # array itself: one copy from the page cache, none more.
            array = np.empty(entry.shape, dtype="<f4")
            got = into(self.key, entry.start, memoryview(array).cast("B"))
            self._check_length(name, entry, got)
            return array
        data = self.storage.read_range(self.key, entry.start, entry.length)
        self._check_length(name, entry, len(data))
        return to_f32(data, entry)

    def _check_length(self, name: str, entry: TensorEntry, got: int) -> None:
        if got != entry.length:
            raise SexpError(
                f"{self.uri} is truncated: {name} needs {entry.length} bytes at {entry.start}, "
                f"the file has {got} there",
                code=E_NOT_SAFETENSORS,
            )


def to_f32(data: bytes, entry: TensorEntry) -> np.ndarray:
    """A tensor's little-endian bytes as an f32 array of its shape (f16 and bf16 exactly).

    An F32 tensor is a read-only view of ``data``, not a copy: the trainer copies
    what it is given once, onto its device, and a large model is not held twice more.
    """
    if entry.dtype == "F32":
        flat = np.frombuffer(data, dtype="<f4")
    elif entry.dtype == "F16":
        flat = np.frombuffer(data, dtype="<f2").astype(np.float32)
    else:  # BF16 is the top half of an f32
        flat = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return flat.reshape(entry.shape)


def split_uri(uri: str) -> tuple[str, str]:
    """(folder location, key) of a file URI: the folder is opened by a storage backend."""
    folder, _, name = uri.rpartition("/")
    if not folder:
        return ".", name
    return folder, name


def open_storage(uri: str, open_location: Opener) -> tuple[Storage, str]:
    """The storage location holding ``uri`` and the file's key in it."""
    folder, key = split_uri(uri)
    return open_location(folder), key


def read_header(storage: Storage, key: str, uri: str) -> SafetensorsFile:
    """``uri``'s safetensors header, read in two ranged requests; a file that is not
    one (short, a length past its end, JSON that is not a header) is ``E-LOAD-002``."""
    first = storage.read_range(key, 0, 8)
    if len(first) < 8:
        raise SexpError(
            f"{uri} is not a safetensors file: it has {len(first)} bytes",
            code=E_NOT_SAFETENSORS,
        )
    length = int.from_bytes(first, "little")
    if length > MAX_HEADER:
        raise SexpError(
            f"{uri} is not a safetensors file: its header length {length} is past any header",
            code=E_NOT_SAFETENSORS,
        )
    raw = storage.read_range(key, 8, length)
    if len(raw) < length:
        raise SexpError(
            f"{uri} is truncated: its header length {length} goes past the end of the file",
            code=E_NOT_SAFETENSORS,
        )
    return SafetensorsFile(uri, storage, key, _entries(raw, 8 + length, uri), raw)


def _entries(raw: bytes, base: int, uri: str) -> dict[str, TensorEntry]:
    def bad(why: str) -> SexpError:
        return SexpError(f"{uri} is not a safetensors file: {why}", code=E_NOT_SAFETENSORS)

    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    entries = {}
    for name, item in header.items():
        if name == "__metadata__":
            continue
        shape = item.get("shape") if isinstance(item, dict) else None
        offsets = item.get("data_offsets") if isinstance(item, dict) else None
        if not (
            isinstance(item, dict)
            and isinstance(item.get("dtype"), str)
            and isinstance(shape, list)
            and all(is_count(n) for n in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(is_count(n) for n in offsets)
        ):
            # a fraction or a negative number is refused, never rounded or read before
            # the data
            raise bad(
                f"the header's entry for {name} has no dtype, shape and offsets "
                "(whole numbers of at least 0)"
            )
        dtype, shape, (start, end) = item["dtype"], tuple(shape), offsets
        size = _ITEMSIZE.get(dtype)
        if end < start or (size is not None and end - start != size * math.prod(shape)):
            raise bad(f"{name}'s offsets do not fit its shape and dtype")
        entries[name] = TensorEntry(dtype, shape, base + start, end - start)
    return entries


@dataclass(frozen=True)
class Source:
    """Where one parameter's start value is: the file (the shard, for an index) and tensor."""

    path: str
    uri: str
    tensor: str
    pos: Pos


class Loads:
    """A program's ``:load`` parameters and the files they are read from.

    Opens each file (and index) once, reads headers only until :meth:`read`,
    and each file's identity once (:meth:`identities`).
    """

    def __init__(self, params: Iterable[ParamDecl], open_location: Opener) -> None:
        self.params = [p for p in params if p.load is not None]
        self._open_location = open_location
        self._files: dict[str, SafetensorsFile] = {}
        self._indexes: dict[str, dict[str, str]] = {}
        self._identities: dict[str, ObjectIdentity] = {}
        self._prefetch: threading.Thread | None = None
        self._prefetch_error: BaseException | None = None
        self.sources: dict[str, Source] = {}

    @classmethod
    def of(cls, program: Program, open_location: Opener) -> Loads:
        """The ``:load`` parameters of ``program``, their files opened with
        ``open_location`` (:meth:`sexpgpu.catalog.Catalog.open_location`)."""
        return cls(program.params, open_location)

    def __bool__(self) -> bool:
        return bool(self.params)

    # -- headers

    def check(self) -> None:
        """Read every header the program names and check each tensor is there, of the
        parameter's shape and a dtype it can take; errors carry the `.sx` position."""
        for param in self.params:
            source = self._source(param)
            entry = self._file(source.uri, param.pos).tensors.get(source.tensor)
            if entry is None:
                names = self._file(source.uri, param.pos).tensors
                raise SourceError(
                    f"{param.path}: {source.tensor} is not in {source.uri}{_nearest(source.tensor, names)}",
                    code=E_NO_TENSOR,
                    pos=param.pos,
                )
            _check_entry(param, source, entry)
            self.sources[param.path] = source

    def _source(self, param: ParamDecl) -> Source:
        assert param.load is not None
        uri, tensor = param.load.uri, param.load.tensor
        if uri.endswith(".safetensors.index.json"):
            weight_map = self._index(uri, param.pos)
            shard = weight_map.get(tensor)
            if shard is None:
                raise SourceError(
                    f"{param.path}: {tensor} is not in {uri}{_nearest(tensor, weight_map)}",
                    code=E_NO_TENSOR,
                    pos=param.pos,
                )
            folder, _ = split_uri(uri)
            uri = f"{folder}/{shard}" if folder != "." else shard
        return Source(param.path, uri, tensor, param.pos)

    def _index(self, uri: str, pos: Pos) -> dict[str, str]:
        if uri not in self._indexes:
            with _at(pos):
                storage, key = open_storage(uri, self._open_location)
                try:
                    index = json.loads(storage.read(key))
                    weight_map = index["weight_map"]
                    ok = isinstance(weight_map, dict) and all(
                        isinstance(v, str) and "/" not in v for v in weight_map.values()
                    )
                except (ValueError, KeyError, TypeError, RecursionError):
                    ok = False
                if not ok:
                    raise SexpError(
                        f"{uri} is not a safetensors index: it has no weight_map of shard names",
                        code=E_NOT_SAFETENSORS,
                    )
            self._indexes[uri] = dict(weight_map)
        return self._indexes[uri]

    def _file(self, uri: str, pos: Pos) -> SafetensorsFile:
        if uri not in self._files:
            with _at(pos):
                storage, key = open_storage(uri, self._open_location)
                self._files[uri] = read_header(storage, key, uri)
        return self._files[uri]

    # -- identities and values

    def prefetch_identities(self) -> None:
        """Start reading the files' identities in the background (after :meth:`check`).

        A local file's identity is its sha256, a pass over every byte: done while
        the run lowers its program and reads the tensors, it costs no wall time.
        A daemon thread, so a run that stops early does not wait for it.
        """
        if self._prefetch is not None or not self.sources:
            return

        def identify() -> None:
            try:
                self._identify()
            except BaseException as exc:  # handed to identities(), which raises it
                self._prefetch_error = exc

        self._prefetch = threading.Thread(target=identify, name="sexpgpu-identity", daemon=True)
        self._prefetch.start()

    def identities(self) -> dict[str, dict[str, Any]]:
        """Each ``:load`` parameter's ``{"uri", "tensor", "size", "version"}``, as a
        checkpoint pins it; a file's identity is read once per run."""
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None
            if self._prefetch_error is not None:
                error, self._prefetch_error = self._prefetch_error, None
                raise error
        return self._identify()

    def _identify(self) -> dict[str, dict[str, Any]]:
        pinned = {}
        for path, source in self.sources.items():
            if source.uri not in self._identities:
                file = self._files[source.uri]
                with _at(source.pos):
                    self._identities[source.uri] = file.storage.identity(file.key)
            identity = self._identities[source.uri]
            pinned[path] = {
                "uri": source.uri,
                "tensor": source.tensor,
                "size": identity.size,
                "version": identity.version,
            }
        return pinned

    def read(self, paths: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """The named parameters' values (every ``:load`` one by default) as f32 arrays,
        one ranged read per tensor, concurrently; then each file's header is read
        again, so a file rewritten meanwhile is refused (``E-LOAD-005``)."""
        wanted = [self.sources[p] for p in (self.sources if paths is None else paths)]
        if not wanted:
            return {}

        def one(source: Source) -> np.ndarray:
            with _at(source.pos):
                return self._files[source.uri].read(source.tensor)

        with ThreadPoolExecutor(max_workers=min(_READERS, len(wanted))) as pool:
            values = dict(zip((s.path for s in wanted), pool.map(one, wanted), strict=True))
        for uri in {s.uri for s in wanted}:
            file = self._files[uri]
            again = file.storage.read_range(file.key, 8, len(file.header_bytes))
            if again != file.header_bytes:
                raise SexpError(
                    f"{uri} changed while it was being read; run again once it is written",
                    code=E_MOVED_UNDER,
                )
        return values


def _check_entry(param: ParamDecl, source: Source, entry: TensorEntry) -> None:
    where = f"{param.path}: {source.tensor} in {source.uri}"
    if entry.dtype not in _ITEMSIZE:
        kind = "an integer" if entry.dtype in _INTEGERS else "a"
        raise SourceError(
            f"{where} is {kind} {entry.dtype} tensor, and the {param.type.dtype} parameter "
            "takes F32, F16 or BF16",
            code=E_MISMATCH,
            pos=param.pos,
        )
    if tuple(entry.shape) != tuple(param.type.shape):
        raise SourceError(
            f"{where} has the shape {_shape(entry.shape)}, the parameter "
            f"{_shape(param.type.shape)}",
            code=E_MISMATCH,
            pos=param.pos,
        )


def _shape(shape: Iterable[int]) -> str:
    return "[" + " ".join(str(n) for n in shape) + "]"


def _nearest(name: str, names: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.5)
    return f"; nearest: {', '.join(close)}" if close else ""


class _at:
    """Give a storage or file error raised inside the ``.sx`` position of the parameter."""

    def __init__(self, pos: Pos) -> None:
        self.pos = pos

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        if isinstance(error, SexpError) and error.pos is None:
            cls = StorageError if isinstance(error, StorageError) else SourceError
            raise cls(error.message, code=error.code, pos=self.pos) from None
        return False

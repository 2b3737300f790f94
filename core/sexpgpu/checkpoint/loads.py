"""Reading ``:load`` and ``with-loaded`` tensors from safetensors files.

A file is opened through the storage backend that serves its scheme (a local
path, ``file://``, ``s3://``, ``gs://`` or a third party's). Reading is lazy and
bounded: the header is one ranged read (8 bytes of length, then the JSON), each
tensor a program names one more, concurrent across tensors; a file in a bucket
is never read whole. A sharded checkpoint's ``model.safetensors.index.json``
names the shard that holds each tensor, and the shard is what a checkpoint pins.
A file's identity (size and version, from the backend's ``identity``) is read
once per run.

A local file is the exception twice over. It may be a symbolic link (Hugging Face's
cache stores every file as one, to a blob): it is read, and pinned, as the regular
file it leads to, while checkpoint locations stay free of links. And its identity
is its sha256, a pass over every byte, so a run reads it once, front to back,
hashing each chunk on a second thread while the next is read into its tensor.

Torch-free: ``sexpgpu check`` reads headers through this module too.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import numpy as np

from sexpgpu.checkpoint.hashing import Hashing, changed, read_into, stat_of
from sexpgpu.checkpoint.keys import is_count
from sexpgpu.checkpoint.storage import NO_SUCH_LOCATION, scheme_of
from sexpgpu.errors import Pos, SexpError, SourceError, StorageError
from sexpgpu.extension import ObjectIdentity

if TYPE_CHECKING:
    from sexpgpu.extension import Opener, Storage
    from sexpgpu.lang.ir import ParamDecl, Program

E_CHANGED = "E-LOAD-001"
"""A resume whose ``:load`` file is not the bytes the checkpoint's run read."""
E_NOT_SAFETENSORS = "E-LOAD-002"
"""A ``:load`` file that is not a whole safetensors file (or index)."""
E_NO_TENSOR = "E-LOAD-003"
"""A tensor name the file does not hold."""
E_MISMATCH = "E-LOAD-004"
"""A tensor whose shape or dtype the parameter cannot take."""

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
    path: str | None = None
    """A local file's real path (links followed), when it is read in one pass."""

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as f32, read with one ranged request."""
        entry = self.tensors[name]
        into = self.storage.read_range_into
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
            raise SexpError(self.truncated(name, got), code=E_NOT_SAFETENSORS)

    def truncated(self, name: str, got: int) -> str:
        """What is said of tensor ``name`` when the file has only ``got`` of its bytes."""
        entry = self.tensors[name]
        return (
            f"{self.uri} is truncated: {name} needs {entry.length} bytes at {entry.start}, "
            f"the file has {got} there"
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
    # The format lays tensors side by side; a file read in one pass fills each from
    # its own bytes, so two claiming the same bytes are refused, as safetensors does.
    placed = sorted((e.start, e.start + e.length, n) for n, e in entries.items() if e.length)
    for (_, first_end, first), (second_start, _, second) in pairwise(placed):
        if second_start < first_end:
            raise bad(f"{second}'s bytes overlap {first}'s")
    return entries


def _follow(uri: str) -> tuple[str, str | None]:
    """(what to open, the real path) of a ``:load`` file: a local one's links followed
    to the regular file they lead to; another scheme's as given, with no path.

    A link that leads nowhere, a loop of links, or something that is not a regular
    file (a FIFO, a device such as ``/dev/zero``, a folder) is one line, never opened.
    """
    path = _local_path(uri) if scheme_of(uri) == "file" else None
    if path is None:
        return uri, None
    try:
        real = os.path.realpath(path, strict=True)
        info = os.stat(real)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SexpError(f"{uri} is a loop of symbolic links", code=E_NOT_SAFETENSORS) from None
        if os.path.islink(path):
            raise SexpError(
                f"{uri} is a symbolic link to {os.path.realpath(path)}, which does not exist",
                code=NO_SUCH_LOCATION,
            ) from None
        return uri, None  # not there, or not readable: the storage backend says which
    if not stat.S_ISREG(info.st_mode):
        led = f" is a symbolic link to {real}, which" if os.path.islink(path) else ""
        raise SexpError(
            f"{uri}{led} is not a regular file ({_kind(info.st_mode)})",
            code=E_NOT_SAFETENSORS,
        )
    # The real path is opened: the local backend refuses a link where it is asked
    # to read, as it must in a checkpoint location.
    return (uri if real == path else real), real


def _in_root(uri: str, root: str | None) -> str:
    """``uri`` by its path in the folder ``root`` (a bundle's, unpacked), if there."""
    if root is None or "://" in uri or not os.path.isabs(uri):
        return uri
    inside = os.path.relpath(os.path.normpath(uri), os.path.normpath(root))
    return uri if inside.startswith("..") else inside


def _local_path(uri: str) -> str | None:
    """The absolute path of a plain path or ``file://`` URI, as the local backend reads
    it; ``None`` for a ``file://`` URI of another machine (the backend says why)."""
    raw = uri
    if uri.lower().startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            return None
        raw = unquote(parsed.path)
    return os.path.abspath(os.path.expanduser(raw))


def _kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((said for test, said in kinds if test(mode)), "a special file")


def _one_pass(
    file: SafetensorsFile, wanted: Mapping[str, Pos]
) -> tuple[Hashing, dict[str, np.ndarray]]:
    """A local file read once, front to back: the tensors ``wanted`` as f32 (by name;
    each with the position blamed when the file is too short for it), and its
    identity, ``sha256:<hex>`` and size (the spec pins a local file by it, as the
    local backend does), still being hashed when this returns.

    Each chunk is read straight into its tensor's array, or into a scratch buffer
    between tensors, and handed to a thread that hashes the file in order. The read
    does not wait for the hash (sha256 is slower than a read from the page cache),
    only for scratch buffers to come back, so the values are ready at the read's
    speed. The hash reads the f32 arrays after they are handed over: nothing may
    change one before :meth:`Loads.identities` returns (a run waits for it before
    training a loaded parameter; a frozen one never changes). A file whose header is
    no longer the one checked, or that changes before it is hashed, is
    ``E-LOAD-005``, from :meth:`Hashing.result`.
    """
    assert file.path is not None
    before = stat_of(file)
    arrays: dict[str, np.ndarray] = {}
    plan: list[tuple[int, memoryview | None]] = []
    for name in sorted(wanted, key=lambda n: file.tensors[n].start):
        entry = file.tensors[name]
        if entry.start + entry.length > before.st_size:
            got = max(0, before.st_size - entry.start)
            raise SourceError(file.truncated(name, got), code=E_NOT_SAFETENSORS, pos=wanted[name])
        if entry.dtype == "F32":
            array = np.empty(entry.shape, "<f4")
        else:  # read as bytes, widened to f32 once the pass is done
            array = np.empty(entry.length, np.uint8)
        arrays[name] = array
        if entry.length:
            plan.append((entry.start, memoryview(array.reshape(-1).view(np.uint8))))
    plan.append((before.st_size, None))
    hashing = Hashing(file, before)
    try:
        read_into(file, plan, hashing)
    except BaseException:
        hashing.stop()
        raise
    hashing.finish()
    values = {
        name: array if file.tensors[name].dtype == "F32" else to_f32(array, file.tensors[name])
        for name, array in arrays.items()
    }
    return hashing, values


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

    def __init__(
        self, params: Iterable[ParamDecl], open_location: Opener, *, root: str | None = None
    ) -> None:
        self.params = [p for p in params if p.load is not None]
        self._open_location = open_location
        self._root = root
        self._files: dict[str, SafetensorsFile] = {}
        self._indexes: dict[str, dict[str, str]] = {}
        self._identities: dict[str, ObjectIdentity | Hashing] = {}
        self._values: dict[str, np.ndarray] = {}
        """Values a file's one pass read, by parameter path, until :meth:`read` takes them."""
        self._prefetch: threading.Thread | None = None
        self._prefetch_error: BaseException | None = None
        self.sources: dict[str, Source] = {}

    @classmethod
    def of(cls, program: Program, open_location: Opener, *, root: str | None = None) -> Loads:
        """The ``:load`` parameters of ``program``, their files opened with
        ``open_location`` (:meth:`sexpgpu.catalog.Catalog.open_location`); ``root``:
        the folder of the source ``program`` was opened from, a bundle unpacked
        (:meth:`identities`)."""
        return cls(program.params, open_location, root=root)

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
                storage, key = open_storage(_follow(uri)[0], self._open_location)
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
                target, real = _follow(uri)
                storage, key = open_storage(target, self._open_location)
                file = read_header(storage, key, uri)
                if real is not None and storage.read_range_into is not None:
                    file.path = real
                self._files[uri] = file
        return self._files[uri]

    # -- identities and values

    def prefetch_identities(self) -> None:
        """Start reading the files in the background (after :meth:`check`): a local
        file in one pass that reads every tensor the program names in it, for
        :meth:`read` to hand over, and hashes it (its identity is its sha256; the hash
        goes on after the read, until :meth:`identities` asks for it); another file's
        identity with one request. Done while the run lowers its program, it costs no
        wall time. A daemon thread, so a run that stops early does not wait for it.
        """
        if self._prefetch is not None or not self.sources:
            return

        def identify() -> None:
            try:
                self._identify(keep=True)
            except BaseException as exc:  # handed to identities() or read(), which raise it
                self._prefetch_error = exc

        self._prefetch = threading.Thread(target=identify, name="sexpgpu-identity", daemon=True)
        self._prefetch.start()

    def _join_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None
            if self._prefetch_error is not None:
                error, self._prefetch_error = self._prefetch_error, None
                raise error

    def identities(self) -> dict[str, dict[str, Any]]:
        """Each ``:load`` parameter's ``{"uri", "tensor", "size", "version"}``, as a
        checkpoint pins it (``uri`` as the program names it, a link's too; a file of the
        bundle the program was unpacked from by its path in the bundle, so that the runs
        of one bundle, unpacked into other folders, name it alike); a file's identity is
        read once per run, a local file's hash waited for."""
        self._join_prefetch()
        self._identify()
        pinned = {}
        for path, source in self.sources.items():
            identity = self._identities[source.uri]
            if isinstance(identity, Hashing):
                with _at(source.pos):
                    identity = self._identities[source.uri] = identity.result()
            pinned[path] = {
                "uri": _in_root(source.uri, self._root),
                "tensor": source.tensor,
                "size": identity.size,
                "version": identity.version,
            }
        return pinned

    def _identify(self, keep: bool = False) -> None:
        """Start each file's identity, once; with ``keep``, a local file's pass also
        keeps the values of every parameter read from it."""
        for uri in dict.fromkeys(source.uri for source in self.sources.values()):
            if uri not in self._identities:
                reads = [s for s in self.sources.values() if s.uri == uri] if keep else []
                self._identify_file(uri, reads)

    def _identify_file(self, uri: str, reads: list[Source]) -> None:
        """``uri``'s identity; a local file's in one pass that also reads ``reads``'
        values into :attr:`_values`."""
        file = self._files[uri]
        first = next(s for s in self.sources.values() if s.uri == uri)
        with _at(first.pos):
            if file.path is None:
                self._identities[uri] = file.storage.identity(file.key)
                return
            wanted = {}
            for source in reads:
                wanted.setdefault(source.tensor, source.pos)
            identity, arrays = _one_pass(file, wanted)
        self._identities[uri] = identity
        handed: set[str] = set()
        for source in reads:
            # two parameters read from one tensor are two arrays: the trainer owns each
            array = arrays[source.tensor]
            self._values[source.path] = array.copy() if source.tensor in handed else array
            handed.add(source.tensor)

    def read(self, paths: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """The named parameters' values (every ``:load`` one by default) as f32 arrays.

        A local file not yet identified is read once, which gives its identity too
        (:meth:`prefetch_identities` may have done it already); another is read with
        one ranged read per tensor, concurrently, and then its header again, so a file
        rewritten meanwhile is refused (``E-LOAD-005``). Values a pass read beyond
        those asked for are dropped.
        """
        wanted = [self.sources[p] for p in (self.sources if paths is None else paths)]
        self._join_prefetch()
        values = {s.path: self._values.pop(s.path) for s in wanted if s.path in self._values}
        for uri in dict.fromkeys(s.uri for s in wanted if s.path not in values):
            if uri not in self._identities and self._files[uri].path is not None:
                self._identify_file(uri, [s for s in wanted if s.uri == uri])
                values.update((s.path, self._values.pop(s.path)) for s in wanted if s.uri == uri)
        self._values.clear()
        rest = [s for s in wanted if s.path not in values]
        if rest:
            values.update(self._read_ranges(rest))
        return {s.path: values[s.path] for s in wanted}

    def _read_ranges(self, wanted: list[Source]) -> dict[str, np.ndarray]:
        def one(source: Source) -> np.ndarray:
            with _at(source.pos):
                return self._files[source.uri].read(source.tensor)

        with ThreadPoolExecutor(max_workers=min(_READERS, len(wanted))) as pool:
            values = dict(zip((s.path for s in wanted), pool.map(one, wanted), strict=True))
        for uri in {s.uri for s in wanted}:
            file = self._files[uri]
            again = file.storage.read_range(file.key, 8, len(file.header_bytes))
            if again != file.header_bytes:
                raise changed(uri)
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

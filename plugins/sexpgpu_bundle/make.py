"""What a bundle holds of a compiled program: its sources, ``:load`` files and local data.

Every file keeps its place relative to the main `.sx` file's folder when it lies
inside that folder, so the program's own relative paths (``include``, ``:load``,
a data source's ``:path``) find the bundle's copies unchanged. A file outside it
(``../lib/blocks.sx``, ``/data/teacher.safetensors``) goes under ``outside/``, and
each string in a source that named it is rewritten to the copy's path: the source's
bytes change, so its ``sha256`` is the bundle's own, and a resume across bundle and
file lists it (``source NAME old -> new``), as the spec says.

Torch-free: it reads the program's files, never a tensor.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpError
from sexpgpu_bundle.archive import identify

SOURCES = "sources"
"""The member folder that stands for the main file's folder."""

OUTSIDE = "outside"
"""The member folder of files from outside the main file's folder."""


@dataclass
class Contents:
    """The members of a bundle (name to bytes or a file to copy) and the manifest
    entries that describe them."""

    main: str
    members: dict[str, bytes | Path] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)
    data: list[dict[str, Any]] = field(default_factory=list)


def gather(
    program: Any,
    *,
    loads: Iterable[str],
    data: Iterable[str],
    with_data: bool,
    fetch: Callable[[str], Path] | None = None,
    known: Mapping[str, tuple[int, str]] | None = None,
) -> Contents:
    """The bundle contents of ``program`` (a compiled :class:`~sexpgpu.lang.ir.Program`):
    its sources, every file a ``:load`` reads (``loads``, the shards of an index
    included; one in an object store fetched to a local file by ``fetch``) and the
    local ``data`` files, copied when ``with_data`` and otherwise recorded by path,
    size and sha256. Object-store data stays a URI."""
    main_path = os.path.realpath(program.file)
    root = os.path.dirname(main_path)
    files = [s.path for s in program.sources if s.path is not None]
    local_loads = sorted({os.path.realpath(_path(u)) for u in loads if _local(u)})
    remote_loads = sorted({u for u in loads if not _local(u)})
    local_data = sorted({os.path.realpath(_path(u)) for u in data if _local(u)})
    copied = [*files, *local_loads, *(local_data if with_data else ())]
    placed = _places(root, copied, remote_loads)
    contents = Contents(main=placed[main_path])
    for source in program.sources:
        if source.path is None:
            continue  # <core>: part of sexpgpu itself
        real = os.path.realpath(source.path)
        text = Path(real).read_bytes()
        kept = () if with_data else local_data
        rewritten = _rewrite(text, source.path, placed[real], placed, kept)
        member = placed[real]
        contents.members[member] = rewritten
        contents.sources.append(
            {
                "name": source.name,
                "member": member,
                "sha256": hashlib.sha256(rewritten).hexdigest(),
                "original": source.path,
            }
        )
    known = known or {}
    for path in local_loads:
        size, digest = known[path] if path in known else identify(Path(path))
        contents.members[placed[path]] = Path(path)
        contents.loads.append({"uri": path, "member": placed[path], "size": size, "sha256": digest})
    for uri in remote_loads:
        if fetch is None:
            raise SexpError(f"{uri}: a :load file in an object store needs a way to fetch it")
        copy = fetch(uri)
        size, digest = identify(copy)
        contents.members[placed[uri]] = copy
        contents.loads.append({"uri": uri, "member": placed[uri], "size": size, "sha256": digest})
    for path in local_data:
        size, digest = known[path] if path in known else identify(Path(path))
        member = placed.get(path) if with_data else None
        if member is not None:
            contents.members[member] = Path(path)
        contents.data.append({"uri": path, "size": size, "sha256": digest, "member": member})
    return contents


def _local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def _places(root: str, paths: Iterable[str], uris: Iterable[str] = ()) -> dict[str, str]:
    """Each file's member name: its path under ``sources/`` when it lies inside
    ``root``, else ``outside/<n>/<its name>``, one ``n`` per folder (or object-store
    prefix, for ``uris``), so that the files of one folder stay together: an index
    finds its shards beside it."""
    placed: dict[str, str] = {}
    folders: dict[str, int] = {}

    def outside(folder: str, name: str) -> str:
        number = folders.setdefault(folder, len(folders) + 1)
        return f"{OUTSIDE}/{number}/{name}"

    for path in dict.fromkeys(os.path.realpath(p) for p in paths):
        relative = os.path.relpath(path, root)
        if relative.startswith(os.pardir + os.sep) or relative == os.pardir:
            placed[path] = outside(os.path.dirname(path), os.path.basename(path))
        else:
            placed[path] = f"{SOURCES}/{Path(relative).as_posix()}"
    for uri in uris:
        folder, _, name = uri.rpartition("/")
        placed[uri] = outside(folder, name)
    return placed


def _rewrite(
    data: bytes, path: str, member: str, placed: Mapping[str, str], kept: Iterable[str]
) -> bytes:
    """``data`` (the source at ``path``, to be the member ``member``) with each string
    that names a bundled file by another relative path than the copies' made to
    point at the copy, and each that names a file ``kept`` where it is (data not
    copied in) by a relative path made absolute."""
    kept = set(kept)
    from sexpgpu.lang.reader import read

    text = data.decode("utf-8")
    here = os.path.dirname(path)
    edits: list[tuple[int, int, str]] = []
    starts = _line_starts(text)
    for atom in _strings(read(text, path)):
        value = atom.value
        if not value or value.startswith("~") or ("://" in value and value not in placed):
            continue
        if "://" in value:  # an object-store file copied in
            target = value
        else:
            target = os.path.realpath(value if os.path.isabs(value) else os.path.join(here, value))
        if target in kept:
            wanted = target
        elif target in placed:
            wanted = Path(os.path.relpath(placed[target], os.path.dirname(member))).as_posix()
        else:
            continue
        if wanted == value:
            continue
        start = starts[atom.pos.line - 1] + atom.pos.col - 1
        edits.append((start, _string_end(text, start), wanted))
    for start, end, wanted in sorted(edits, reverse=True):
        literal = '"' + wanted.replace("\\", "\\\\").replace('"', '\\"') + '"'
        text = text[:start] + literal + text[end:]
    return text.encode("utf-8")


def _strings(nodes: Iterable[Any]) -> Iterable[Any]:
    from sexpgpu.lang.reader import Atom, SList, SVec

    for node in nodes:
        if isinstance(node, (SList, SVec)):
            yield from _strings(node.items)
        elif isinstance(node, Atom) and isinstance(node.value, str):
            yield node


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for i, char in enumerate(text):
        if char == "\n":
            starts.append(i + 1)
    return starts


def _string_end(text: str, start: int) -> int:
    """The index just past the string literal that opens at ``start``."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    raise SexpError(f"an unterminated string at offset {start}")  # the reader read it

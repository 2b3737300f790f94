"""The on-disk format of a bundle (``NAME.sxb``): one zip file holding ``manifest.json``
first, then the member files it lists, each with its size and sha256.

Reading trusts nothing in the file: member names are checked before anything is
written, the manifest is read bounded and checked against :data:`MANIFEST_SCHEMA`,
unpacked bytes are hashed and counted against a bound as they stream, and every way
a hostile zip makes :mod:`zipfile`, :mod:`zlib` or :mod:`json` fail is one
:class:`BundleError` with a code of docs/errors.md. Standard library and jsonschema only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from sexpgpu.checkpoint.schema import MAX_DEPTH, nesting_depth
from sexpgpu.errors import SexpError

FORMAT = 1
"""The manifest format this sexpgpu writes and the only one it reads."""

MANIFEST = "manifest.json"
"""The member holding the manifest, written first."""

DEFAULT_BOUND = 64 * 2**30
"""The bytes a bundle may unpack to, unless the caller says otherwise."""

MAX_MANIFEST = 16 * 2**20
"""The largest ``manifest.json`` read: sexpgpu writes a few kB, so more is a forgery."""


E_DAMAGED = "E-BUNDLE-001"
"""Not a zip, truncated, or a member missing, unlisted, or not its listed size or sha256."""

E_UNSAFE = "E-BUNDLE-002"
"""A member whose path could land outside the folder unpacked into, or not a regular file."""

E_TOO_LARGE = "E-BUNDLE-003"
"""Members that unpack past the bound, or a ``manifest.json`` over 16 MiB."""

E_MANIFEST = "E-BUNDLE-004"
"""A manifest that is not JSON, holds a value of the wrong type, or is of an unknown format."""

E_UNWRITABLE = "E-BUNDLE-010"
"""A bundle that cannot be written where it was named (a folder not there, read-only)."""

_CHUNK = 1 << 20
_DRIVE = re.compile(r"^[A-Za-z]:")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# Every way zipfile, zlib and the file beneath fail on bytes that are no sound zip: a
# bad header surfaces as OSError, EOFError, struct.error or zlib.error, a name flagged
# UTF-8 that is not as UnicodeDecodeError (a ValueError), encryption as RuntimeError.
_BROKEN = (
    zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, struct.error, zlib.error,
    ValueError, KeyError, IndexError, OverflowError, NotImplementedError, RuntimeError,
)  # fmt: skip


class BundleError(SexpError):
    """A bundle that cannot be written, read or unpacked as asked (exit code 1)."""


_HEX = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_SIZE = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
# Paths, URIs and versions: any text a file system or a registry holds, bounded; what
# holds a control character is escaped wherever it is shown, never refused for it.
_TEXT = {"type": "string", "maxLength": 4096}
_MEMBER = {"type": "string", "minLength": 1, "maxLength": 1024}
# (a bound on length or a pattern holds for a string alone: null passes them)
_OPTIONAL_MEMBER = {**_MEMBER, "type": ["string", "null"]}
# \Z, not $: jsonschema matches with Python's re, whose $ also matches before a final
# newline, the very character a forged line needs
_NAME_PATTERN = r"^[^\s=\x00-\x1f\x7f]+\Z"
_WORD_PATTERN = r"^[^\x00-\x1f\x7f]*\Z"
_PATH_PATTERN = r"^/[^\x00]*\Z"
# A knob, choice or plugin name: no space, control character or '=' (a --set splits on it).
_NAME = {"type": "string", "pattern": _NAME_PATTERN, "maxLength": 256}
# A choice's value is handed to the lowering and its libraries: printable, bounded.
_WORD = {"type": "string", "pattern": _WORD_PATTERN, "maxLength": 1024}
_WORDS = {"type": "object", "propertyNames": _NAME, "additionalProperties": _WORD}
# A local data file as the bundling machine's real path named it: absolute, so that it
# names one file wherever the bundle runs (and no NUL, which no path holds).
_LOCAL_PATH = {"type": "string", "pattern": _PATH_PATTERN, "maxLength": 4096}
_PATTERNS = {
    _HEX["pattern"]: "is not a sha256 in lowercase hex",
    _NAME_PATTERN: "is not a name (it holds a space, a control character or '=')",
    _WORD_PATTERN: "holds a control character",
    _PATH_PATTERN: "is not an absolute path",
}
_KNOB = {
    "type": "object",
    "required": ["name", "value", "source"],
    "properties": {"name": _NAME, "value": {}, "source": _TEXT},
}


def _record(**properties: Any) -> dict[str, Any]:
    """An object that must hold every key of ``properties`` (and may hold others)."""
    return {"type": "object", "required": list(properties), "properties": properties}


def _records(**properties: Any) -> dict[str, Any]:
    return {"type": "array", "items": _record(**properties)}


_COMPILED = _record(
    folder=_MEMBER,
    files=_SIZE,
    size=_SIZE,
    seconds={"type": "number", "minimum": 0, "maximum": 1e9},
)
"""A lowering's compile caches: the members under ``folder/``, their count and bytes."""
MANIFEST_SCHEMA: dict[str, Any] = _record(
    format={"type": "integer"},
    members={"type": "object", "additionalProperties": _record(size=_SIZE, sha256=_HEX)},
    created={"type": "string", "maxLength": 64},
    main=_MEMBER,
    sources=_records(name=_TEXT, member=_MEMBER, sha256=_HEX, original=_TEXT),
    loads=_records(uri=_TEXT, member=_MEMBER, size=_SIZE, sha256=_HEX),
    data_files=_records(uri=_LOCAL_PATH, size=_SIZE, sha256=_HEX, member=_OPTIONAL_MEMBER),
    selection=_record(
        variant={**_NAME, "type": ["string", "null"]},
        sets={"type": "object", "propertyNames": _NAME, "additionalProperties": _TEXT},
        steps={**_SIZE, "type": ["integer", "null"], "minimum": 1},
        knobs={"type": "array", "items": _KNOB},
    ),
    choices=_WORDS,
    versions=_record(sexpgpu=_WORD, libraries=_WORDS, plugins=_WORDS),
    machine=_WORDS,
    compiled={"anyOf": [{"type": "null"}, _COMPILED]},
)
"""What ``manifest.json`` must hold (docs/bundle.md); keys it does not name are kept."""


@functools.cache
def _validator() -> Any:
    """The manifest's validator, made when a manifest is first read: jsonschema is
    imported then, not by every `sexpgpu run` that asks whether a file is a bundle."""
    from jsonschema import Draft202012Validator, validators

    # JSON Schema takes 1.0 for an integer and Python takes True: neither is a size or
    # a format number sexpgpu writes.
    integer = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool)
    )
    return validators.extend(Draft202012Validator, type_checker=integer)(MANIFEST_SCHEMA)


def _error(code: str, where: str, what: str) -> BundleError:
    kind = {E_DAMAGED: "is damaged", E_UNSAFE: "is unsafe", E_TOO_LARGE: "is too large"}
    return BundleError(f"{where} {kind.get(code, 'has a bad manifest')}: {what}", code=code)


def shown(name: str) -> str:
    """A member name fit for a one-line message: the untrusted file's, so escaped when
    it holds control characters and cut when long."""
    text = name if name.isprintable() else ascii(name)
    return text if len(text) <= 200 else text[:200] + "..."


def _short(digest: str) -> str:
    return digest[:12] + "..."


def unsafe_name(name: str) -> str | None:
    """Why ``name`` cannot be a member's path inside the folder a bundle unpacks into
    (``"is absolute"``...), or ``None`` for a plain relative POSIX path."""
    parts = name.split("/")
    checks = (
        (name.startswith("/"), "is absolute"),
        ("\\" in name, "has a backslash"),
        (bool(_DRIVE.match(name)), "names a drive"),
        (bool(_CONTROL.search(name)), "has a control character"),
        (".." in parts, "climbs out of its folder with '..'"),
        ("" in parts or "." in parts, "has an empty part"),
        # what most filesystems hold: longer fails while writing, as no code says
        (len(name) > 1024 or any(len(p.encode()) > 255 for p in parts), "is too long"),
    )
    return next((why for bad, why in checks if bad), None)


def _check_names(names: list[str], where: str) -> None:
    """Refuse (``E_UNSAFE``) a name :func:`unsafe_name` refuses, one that is another's
    folder, or one that differs from another only in case (one file on macOS, Windows)."""
    seen: dict[str, str] = {}
    folders: set[str] = set()
    for name in names:
        why = unsafe_name(name)
        folded = name.casefold()
        if why is None and seen.get(folded, name) != name:
            why = f"differs from {shown(seen[folded])} only in case"
        if why is not None:
            raise _error(E_UNSAFE, where, f"member {shown(name)} {why}")
        seen[folded] = name
        parts = folded.split("/")
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    for folded, name in seen.items():
        if folded in folders:
            raise _error(E_UNSAFE, where, f"member {shown(name)} is both a file and a folder")


def _said(error: Any) -> str:
    """One short line for a schema violation, never echoing the (untrusted) value."""
    place = "/".join(shown(str(p)) for p in error.absolute_path) or "the manifest"
    wanted, kind = error.validator_value, str(error.validator)
    if kind == "required":
        return f"{place} has no {error.message.split(' is a required')[0]}"
    if kind == "type":
        return f"{place} is not {' or '.join(wanted) if isinstance(wanted, list) else wanted}"
    if "propertyNames" in error.schema_path:
        place = f"a name in {place}"  # propertyNames: the name itself is not shown
    said = {
        "pattern": _PATTERNS.get(str(wanted), "is not of the form sexpgpu writes"),
        "anyOf": "is not null or a record",
        "minimum": f"is below {wanted}",
        "maximum": f"is above {wanted}",
        "minLength": "is empty",
        "maxLength": f"is longer than {wanted} characters",
    }
    return f"{place} {said.get(kind, f'breaks the rule {kind}: {wanted}')}"


def _checked(value: Any, where: str) -> dict[str, Any]:
    """``value`` (parsed JSON) when it is a manifest of :data:`FORMAT` and every member
    it names is listed, with the same size and sha256; else ``E_MANIFEST``."""
    if nesting_depth(value) > MAX_DEPTH:
        raise _error(E_MANIFEST, where, f"its JSON nests deeper than {MAX_DEPTH} levels")
    if not isinstance(value, dict):
        raise _error(E_MANIFEST, where, "it is not a JSON object")
    number = value.get("format")
    # a later format may change any key, so its number is read before its shape
    if isinstance(number, int) and not isinstance(number, bool) and number != FORMAT:
        raise _error(E_MANIFEST, where, f"format {number}, where this sexpgpu reads {FORMAT}")
    from jsonschema.exceptions import best_match

    problem = best_match(_validator().iter_errors(value))
    if problem is not None:
        raise _error(E_MANIFEST, where, _said(problem))
    members, compiled = value["members"], value["compiled"]
    if MANIFEST in members:
        raise _error(E_MANIFEST, where, f"members lists {MANIFEST} itself")
    refs = [("main", {"member": value["main"]})]
    refs += [
        (f"{key}/{i}", e)
        for key in ("sources", "loads", "data_files")
        for i, e in enumerate(value[key])
    ]
    if compiled:
        # the compiler reads and writes its caches there: never outside the unpacked folder
        why = unsafe_name(compiled["folder"])
        if why is not None:
            raise _error(E_UNSAFE, where, f"compiled/folder {shown(compiled['folder'])} {why}")
        inside = [m for name, m in members.items() if name.startswith(compiled["folder"] + "/")]
        held = (len(inside), sum(m["size"] for m in inside))
        if held != (compiled["files"], compiled["size"]):
            said = f"compiled says {compiled['files']} files of {compiled['size']} bytes"
            raise _error(E_MANIFEST, where, f"{said}, its folder holds {held[0]} of {held[1]}")
    for place, entry in refs:
        member = entry["member"]
        if member is None:
            continue  # data recorded, not copied
        if member not in members:
            said = f"{place} names the member {shown(member)}, which members does not list"
            raise _error(E_MANIFEST, where, said)
        # a copy holds the same bytes as the file it stands for (DESIGN.md, Bundles)
        for key in ("size", "sha256"):
            if key in entry and entry[key] != members[member][key]:
                said = f"{place} says {key} {entry[key]}, its member {shown(member)} has"
                raise _error(E_MANIFEST, where, f"{said} {members[member][key]}")
    return value


def _parse(data: bytes, where: str) -> dict[str, Any]:
    """The manifest in ``data``, checked (:func:`_checked`)."""

    def refuse(constant: str) -> Any:
        raise ValueError(constant)  # NaN and Infinity are not JSON, so no writer's

    try:  # ValueError: UnicodeDecodeError, JSONDecodeError, an int of 5000 digits
        value = json.loads(data.decode("utf-8"), parse_constant=refuse)
    except (RecursionError, ValueError):
        raise _error(E_MANIFEST, where, f"{MANIFEST} is not JSON (or nests too deep)") from None
    return _checked(value, where)


def _listing(archive: zipfile.ZipFile, where: str) -> dict[str, zipfile.ZipInfo]:
    """The archive's members by name, each checked safe to unpack as a plain file."""
    # the raw names: zipfile cuts a name at its first NUL and shows what is left
    _check_names([info.orig_filename for info in archive.infolist()], where)
    infos: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        # a Unix mode in the high bits (zipfile's writestr gives permissions alone, no
        # file type), the MS-DOS folder bit in the low
        name, kind = shown(info.filename), stat.S_IFMT(info.external_attr >> 16)
        if kind == stat.S_IFLNK:
            raise _error(E_UNSAFE, where, f"member {name} is a symlink")
        if kind not in (0, stat.S_IFREG) or info.external_attr & 0x10:
            raise _error(E_UNSAFE, where, f"member {name} is not a regular file")
        if info.filename in infos:
            raise _error(E_DAMAGED, where, f"member {name} is in the archive twice")
        if info.flag_bits & 0x1:
            raise _error(E_DAMAGED, where, f"member {name} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise _error(E_DAMAGED, where, f"member {name} is compressed by an unknown method")
        infos[info.filename] = info
    if MANIFEST not in infos:
        raise _error(E_DAMAGED, where, f"it has no {MANIFEST}")
    return infos


def _manifest_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> bytes:
    """The bytes of ``manifest.json``, read no further than :data:`MAX_MANIFEST`."""
    if info.file_size > MAX_MANIFEST:
        raise _error(E_TOO_LARGE, where, f"{MANIFEST} is {info.file_size} bytes, over 16 MiB")
    try:
        with archive.open(info) as stream:
            data = stream.read(MAX_MANIFEST + 1)
    except _BROKEN:
        raise _error(E_DAMAGED, where, f"member {MANIFEST} cannot be read") from None
    if len(data) > MAX_MANIFEST:  # zipfile stops at the declared size: this guards that
        raise _error(E_TOO_LARGE, where, f"{MANIFEST} is over 16 MiB")
    return data


@contextmanager
def _opened(path: str | Path) -> Iterator[tuple[zipfile.ZipFile, dict[str, Any], dict[str, Any]]]:
    """The bundle at ``path`` open, with its checked manifest and its members' infos."""
    where = str(path)
    try:
        # never blocks on a FIFO; a device or a FIFO is refused before it is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise _error(E_DAMAGED, where, f"it cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _error(E_DAMAGED, where, "it is not a regular file")
    handle = os.fdopen(fd, "rb")
    with handle:
        try:
            archive = zipfile.ZipFile(handle)
        except _BROKEN:
            raise _error(E_DAMAGED, where, "it is not a zip archive (truncated?)") from None
        with archive:
            infos = _listing(archive, where)
            manifest = _parse(_manifest_bytes(archive, infos[MANIFEST], where), where)
            members = manifest["members"]
            extra = sorted(set(infos) - {MANIFEST} - set(members))
            if extra:
                raise _error(E_DAMAGED, where, f"member {shown(extra[0])} is not in the manifest")
            missing = sorted(set(members) - set(infos))
            if missing:
                raise _error(E_DAMAGED, where, f"member {shown(missing[0])} is missing")
            for name, entry in sorted(members.items()):
                if infos[name].file_size != entry["size"]:
                    said = f"has {infos[name].file_size} bytes where the manifest says"
                    raise _error(E_DAMAGED, where, f"member {shown(name)} {said} {entry['size']}")
            yield archive, manifest, infos


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The checked manifest of the bundle at ``path``: its members the zip's, each safe
    and of the declared size. Reads the manifest alone (bounded) and hashes nothing."""
    with _opened(path) as (_, manifest, _):
        return manifest


def extract(path: str | Path, into: str | Path, *, bound: int = DEFAULT_BOUND) -> dict[str, Any]:
    """Unpack the bundle at ``path`` into the empty folder ``into``; returns its manifest.

    Every member streams through a sha256 and a count of bytes against ``bound``; on
    any refusal what was written in ``into`` is removed. Nothing is written outside it."""
    where, target = str(path), Path(into)
    if not target.is_dir() or any(target.iterdir()):
        raise BundleError(f"cannot unpack {where} into {into}: it is not an empty folder")
    with _opened(path) as (archive, manifest, infos):
        members = manifest["members"]
        declared = sum(entry["size"] for entry in members.values())
        if declared > bound:
            raise _error(E_TOO_LARGE, where, f"its members hold {declared} bytes, over {bound}")
        made: list[Path] = []
        try:
            left = bound
            for name, entry in sorted(members.items()):
                top = target / name.split("/")[0]
                if top not in made:
                    made.append(top)  # before it exists, so a half-made folder goes too
                left -= _unpack(archive, infos[name], entry, target, left, where)
        except BaseException:
            for top in made:  # into was empty: all that is in it now is ours
                with suppress(OSError):
                    (shutil.rmtree if top.is_dir() and not top.is_symlink() else os.unlink)(top)
            raise
    return manifest


def _chunks(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, where: str
) -> Iterator[bytes]:
    """A member's bytes, never asking for more than one past ``size``; a failure of the
    zip is ``E_DAMAGED`` (so one of the disk beneath the caller's loop is not)."""
    try:
        with archive.open(info) as stream:
            got = 0
            while chunk := stream.read(min(_CHUNK, size - got + 1)):
                got += len(chunk)
                yield chunk
    except _BROKEN:
        raise _error(E_DAMAGED, where, f"member {shown(info.filename)} cannot be read") from None


def _unpack(
    archive: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    entry: Mapping[str, Any],
    target: Path,
    left: int,
    where: str,
) -> int:
    """Write one member under ``target``, checked as it streams against its entry and
    the ``left`` bytes the bound allows; returns the bytes written."""
    name = shown(info.filename)
    dest = target.joinpath(*info.filename.split("/"))
    if not dest.resolve().is_relative_to(target.resolve()):  # guards the names' check
        raise _error(E_UNSAFE, where, f"member {name} lands outside {target}")
    digest, got = hashlib.sha256(), 0
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(dest, flags, 0o644), "wb") as out:
            for chunk in _chunks(archive, info, entry["size"], where):
                got += len(chunk)
                if got > left:
                    raise _error(E_TOO_LARGE, where, f"member {name} unpacks past the bound")
                if got > entry["size"]:
                    said = f"holds more than the {entry['size']} bytes the manifest says"
                    raise _error(E_DAMAGED, where, f"member {name} {said}")
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:  # the zip's failures are BundleErrors by now: this is the disk
        raise BundleError(f"cannot unpack {where} into {target}: {name}: {exc.strerror}") from None
    if got != entry["size"]:
        said = f"has {got} bytes where the manifest says {entry['size']}"
        raise _error(E_DAMAGED, where, f"member {name} {said}")
    if digest.hexdigest() != entry["sha256"]:
        said = f"has sha256 {_short(digest.hexdigest())} where the manifest says"
        raise _error(E_DAMAGED, where, f"member {name} {said} {_short(entry['sha256'])}")
    return got


def _read(value: bytes | Path) -> Iterator[bytes]:
    """A member's bytes: ``value`` itself, or the file it names in 1 MiB chunks."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        yield bytes(value)
        return
    with open(value, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            yield chunk


def identify(value: bytes | Path) -> tuple[int, str]:
    """``value``'s size and sha256 (bytes, or the file it names, read in 1 MiB chunks)."""
    digest, size = hashlib.sha256(), 0
    for chunk in _read(value):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def _zip_info(name: str, size: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # same members, same bytes
    info.external_attr = (stat.S_IFREG | 0o644) << 16  # a regular file: all a reader takes
    info.file_size = size  # known before writing, so a member over 2 GiB gets zip64
    # the manifest and `.sx` sources are deflated; weights, data and compile caches are
    # stored, wherever they sit (deflate gains little on them and costs seconds per GB
    # both ways)
    text = name == MANIFEST or name.endswith(".sx")
    info.compress_type = zipfile.ZIP_DEFLATED if text else zipfile.ZIP_STORED
    return info


def unwritable(where: str, exc: OSError) -> BundleError:
    """``E_UNWRITABLE`` for the bundle ``where``, saying what the system said (and the file
    it said it of, when that is a member's source rather than the bundle)."""
    said = exc.strerror or type(exc).__name__
    named = exc.filename if isinstance(exc.filename, str) else None
    target = os.path.abspath(where)
    ours = (target, os.path.dirname(target))  # the bundle, its folder, its temporary file
    if named and not (
        os.path.abspath(named) in ours
        or os.path.basename(named).startswith("." + os.path.basename(target))
    ):
        said = f"{shown(named)}: {said}"
    return BundleError(f"cannot write {shown(where)}: {said}", code=E_UNWRITABLE)


def _write_zip(
    handle: Any,
    text: bytes,
    members: Mapping[str, bytes | Path],
    identity: Mapping[str, tuple[int, str]],
    where: str,
) -> None:
    """The archive into the open file ``handle``: the manifest ``text``, then each member,
    checked against its ``identity`` (size, sha256) as it is copied."""
    with zipfile.ZipFile(handle, "w") as archive:
        archive.writestr(_zip_info(MANIFEST, len(text)), text)
        for name, value in sorted(members.items()):
            digest = hashlib.sha256()
            with archive.open(_zip_info(name, identity[name][0]), "w") as out:
                for chunk in _read(value):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != identity[name][1]:
                raise BundleError(f"{value} changed while {where} was being written")


def write_bundle(
    path: str | Path,
    manifest: Mapping[str, Any],
    members: Mapping[str, bytes | Path],
    *,
    known: Mapping[str, tuple[int, str]] | None = None,
) -> dict[str, Any]:
    """Write the bundle ``path`` atomically: ``manifest``, with ``format`` and each of
    ``members`` (a name to bytes, or to a file read in 1 MiB chunks) with its size and
    sha256 added, then the members. ``known``: a member's size and sha256 already read
    (it is not read twice before writing; the write checks it). Refuses what a reader
    would; returns the manifest."""
    where, target = str(path), Path(path)
    if MANIFEST in members:
        raise _error(E_UNSAFE, where, f"member {MANIFEST} is the manifest's own name")
    _check_names([MANIFEST, *members], where)
    # hashed before writing, since the manifest that lists the hashes comes first
    known = known or {}
    identity = {
        name: known[name] if name in known else identify(value)
        for name, value in sorted(members.items())
    }
    listed = {name: {"size": size, "sha256": sha} for name, (size, sha) in identity.items()}
    try:
        full = {**manifest, "format": FORMAT, "members": listed}
        text = json.dumps(full, indent=1, sort_keys=True, allow_nan=False).encode("utf-8")
    except ValueError:
        raise _error(E_MANIFEST, where, "it holds NaN or infinity, which JSON cannot") from None
    if len(text) > MAX_MANIFEST:
        raise _error(E_TOO_LARGE, where, f"{MANIFEST} would be over 16 MiB")
    written = _checked(json.loads(text), where)
    try:
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise unwritable(where, exc) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            _write_zip(handle, text, members, identity, where)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp's file is the owner's alone; a bundle is a file like any other
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)
        os.replace(temp, target)
    except BaseException as exc:
        with suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError):
            raise unwritable(where, exc) from None
        raise
    with suppress(OSError):  # the rename lasts once its folder is on disk too
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    return written


def _size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def describe(manifest: Mapping[str, Any]) -> list[str]:
    """What ``sexpgpu bundle --show`` prints of a checked manifest, one line each:
    plain text, two-space indents."""
    members, chosen = manifest["members"], manifest["selection"]
    versions, compiled = manifest["versions"], manifest["compiled"]
    lines = [f"main: {manifest['main']}"]

    def section(title: str, rows: Iterable[str]) -> None:
        indented = [f"  {row}" for row in rows]
        lines.extend([f"{title}:", *indented] if indented else [f"{title}: none"])

    def part(key: str) -> int:
        names = {e["member"] for e in manifest[key]} - {None}
        return sum(members[name]["size"] for name in names)

    def sha(entry: Mapping[str, Any]) -> str:
        return f"sha256 {_short(entry['sha256'])}"

    section(
        "sources", (f"{e['name']}  from {e['original']}  {sha(e)}" for e in manifest["sources"])
    )
    section("loads", (f"{e['uri']}  {_size(e['size'])}  {sha(e)}" for e in manifest["loads"]))
    for_data = {None: "not copied"}
    section(
        "data files",
        (
            f"{e['uri']}  {_size(e['size'])}  {for_data.get(e['member'], 'copied')}"
            for e in manifest["data_files"]
        ),
    )
    knobs = [f"{k['name']} = {json.dumps(k['value'])} ({k['source']})" for k in chosen["knobs"]]
    section("selection", [f"variant {chosen['variant'] or '-'}", *knobs])
    section("choices", (f"{k} = {v}" for k, v in sorted(manifest["choices"].items())))
    libraries = [f"{k} {v}" for k, v in sorted(versions["libraries"].items())]
    plugins = [f"plugin {k} {v}" for k, v in sorted(versions["plugins"].items())]
    section("versions", [f"sexpgpu {versions['sexpgpu']}", *libraries, *plugins])
    section("machine", (f"{k} = {v}" for k, v in sorted(manifest["machine"].items())))
    built = (
        f"{_size(compiled['size'])} in {compiled['files']} files under {compiled['folder']}/, "
        f"compiled in {compiled['seconds']:.1f} s"
        if compiled
        else ""
    )
    lines.append(f"compiled: {built or 'none'}")
    sizes = {key: part(key) for key in ("sources", "loads", "data_files")}
    sizes["compiled"] = compiled["size"] if compiled else 0
    sizes["total"] = sum(entry["size"] for entry in members.values())
    section("sizes", (f"{key:<9} {_size(size)}" for key, size in sizes.items()))
    return lines

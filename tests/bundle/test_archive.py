"""The bundle archive (``NAME.sxb``): what ``write_bundle`` writes, ``read_manifest``
and ``extract`` take back the same; every hostile archive is refused with its code,
the folder it was to be unpacked into left empty and nothing written outside it; and
no damage makes the reader raise anything but a ``BundleError``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import stat
import struct
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sexpgpu.errors import SexpError
from sexpgpu_bundle.archive import (
    DEFAULT_BOUND,
    E_DAMAGED,
    E_MANIFEST,
    E_TOO_LARGE,
    E_UNSAFE,
    FORMAT,
    MANIFEST,
    BundleError,
    describe,
    extract,
    read_manifest,
    unsafe_name,
    write_bundle,
)
from tests.properties import budget

SOURCE = b'(include "blocks.sx")\n(defmodel my-run (linear 4 4))\n'
WEIGHTS = b"SAFETENSORS-" + bytes(range(256))
DATA = b"hello world\n"
MEMBERS: dict[str, bytes] = {
    "sources/my-run.sx": SOURCE,
    "loads/teacher.safetensors": WEIGHTS,
    "data/text.txt": DATA,
}
CODES = {E_DAMAGED, E_UNSAFE, E_TOO_LARGE, E_MANIFEST}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest(**changes: Any) -> dict[str, Any]:
    """A manifest for MEMBERS (without ``format`` and ``members``, which the writer adds)."""
    record = {
        "created": "2024-05-01T12:00:00Z",
        "main": "sources/my-run.sx",
        "sources": [
            {
                "name": "my-run.sx",
                "member": "sources/my-run.sx",
                "sha256": sha(SOURCE),
                "original": "/home/me/my-run.sx",
            }
        ],
        "loads": [
            {
                "uri": "/models/teacher.safetensors",
                "member": "loads/teacher.safetensors",
                "size": len(WEIGHTS),
                "sha256": sha(WEIGHTS),
            }
        ],
        "data_files": [
            {
                "uri": "/data/text.txt",
                "size": len(DATA),
                "sha256": sha(DATA),
                "member": "data/text.txt",
            },
            {"uri": "/data/big.txt", "size": 10**9, "sha256": "0" * 64, "member": None},
        ],
        "selection": {
            "variant": "small",
            "sets": {"lr": "0.001"},
            "steps": None,
            "knobs": [
                {"name": "lr", "value": 0.001, "source": "--set"},
                {"name": "widths", "value": [4, 8], "source": "variant small"},
            ],
        },
        "choices": {"cpu.blas": "openblas", "attention": "sdpa"},
        "versions": {
            "sexpgpu": "0.4.0",
            "libraries": {"torch": "2.5.1"},
            "plugins": {"torch": "0.4.0"},
        },
        "machine": {"cpu.capability": "AVX2"},
        "compiled": None,
    }
    record.update(changes)
    return record


def craft(
    path: Path,
    files: dict[str, bytes] = MEMBERS,
    *,
    entries: dict[str, dict[str, Any]] | None = None,
    unlisted: tuple[str, ...] = (),
    change: Callable[[dict[str, Any]], Any] | None = None,
    raw: bytes | None = None,
    attrs: dict[str, int] | None = None,
    method: int = zipfile.ZIP_STORED,
) -> Path:
    """A zip written by hand: ``manifest.json`` (listing ``files`` truly, but for
    ``entries`` and ``unlisted``; ``change`` edits it; ``raw`` replaces it), then ``files``."""
    if raw is None:
        members = {n: {"size": len(d), "sha256": sha(d)} for n, d in files.items()}
        members.update(entries or {})
        for name in unlisted:
            members.pop(name)
        record = {**manifest(), "format": FORMAT, "members": members}
        if change is not None:
            change(record)
        raw = json.dumps(record).encode()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, raw)
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = method
            if attrs and name in attrs:
                info.external_attr = attrs[name]
            archive.writestr(info, data)
    return path


def patch_central(path: Path, name: str, offset: int, fmt: str, value: int) -> None:
    """Overwrite a field of ``name``'s central directory entry (which zipfile trusts)."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + length] == name.encode():
            struct.pack_into(fmt, data, at + offset, value)
            path.write_bytes(bytes(data))
            return
        at = data.find(b"PK\x01\x02", at + 1)
    raise AssertionError(f"no central entry for {name}")


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


def refused(
    bundle: Path, tmp_path: Path, code: str, *, bound: int = DEFAULT_BOUND, by_reader: bool = True
) -> BundleError:
    """Unpacking ``bundle`` is refused with ``code``, leaving ``into`` empty and the rest
    of ``tmp_path`` as it was; ``read_manifest`` refuses it too, unless only hashing or
    the bound can tell (``by_reader=False``), when it reads it."""
    into = tmp_path / "into"
    into.mkdir()
    before = snapshot(tmp_path)
    outside = [Path("/etc/x"), Path("/x"), tmp_path / "x"]
    existed = [p.exists() for p in outside]
    with pytest.raises(BundleError) as caught:
        extract(bundle, into, bound=bound)
    error = caught.value
    assert error.code == code, str(error)
    assert list(into.iterdir()) == []
    assert snapshot(tmp_path) == before
    assert [p.exists() for p in outside] == existed
    text = str(error)
    assert text.startswith(f"{code}: {bundle}") and "\n" not in text, text
    if by_reader:
        with pytest.raises(BundleError) as again:
            read_manifest(bundle)
        assert again.value.code == code, str(again.value)
    else:
        assert read_manifest(bundle)["format"] == FORMAT
    return error


# ---------------------------------------------------------------- writing and reading back


def test_a_bundle_round_trips(tmp_path: Path) -> None:
    bundle = tmp_path / "run.sxb"
    umask = os.umask(0o022)
    try:
        written = write_bundle(bundle, manifest(), MEMBERS)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o644  # as any file, not mkstemp's 0600
    assert written["format"] == FORMAT
    assert written["members"] == {n: {"size": len(d), "sha256": sha(d)} for n, d in MEMBERS.items()}
    assert read_manifest(bundle) == written
    into = tmp_path / "into"
    into.mkdir()
    assert extract(bundle, into) == written
    got = {str(p.relative_to(into)): p.read_bytes() for p in into.rglob("*") if p.is_file()}
    assert got == MEMBERS
    assert sorted(os.listdir(tmp_path)) == ["into", "run.sxb"]  # no temp file left


def test_the_archive_is_laid_out_as_documented(tmp_path: Path) -> None:
    bundle = tmp_path / "run.sxb"
    write_bundle(bundle, manifest(), MEMBERS)
    with zipfile.ZipFile(bundle) as archive:
        infos = archive.infolist()
        assert infos[0].filename == MANIFEST
        kinds = {i.filename: i.compress_type for i in infos}
        assert kinds["loads/teacher.safetensors"] == zipfile.ZIP_STORED
        assert all(i.external_attr >> 16 == 0o100644 for i in infos)
        assert json.loads(archive.read(MANIFEST)) == read_manifest(bundle)
    first = bundle.read_bytes()
    write_bundle(bundle, manifest(), MEMBERS)  # over the old one, atomically
    assert bundle.read_bytes() == first  # the same members give the same bytes


def test_a_path_member_is_hashed_and_copied_in_chunks(tmp_path: Path) -> None:
    big = tmp_path / "teacher.safetensors"
    payload = random.Random(7).randbytes(3 * 2**20 + 12345)
    big.write_bytes(payload)
    load = {"uri": str(big), "member": "loads/teacher.safetensors"}
    record = manifest(loads=[{**load, "size": len(payload), "sha256": sha(payload)}])
    members = {**MEMBERS, "loads/teacher.safetensors": big}
    written = write_bundle(tmp_path / "run.sxb", record, members)
    entry = written["members"]["loads/teacher.safetensors"]
    assert entry == {"size": len(payload), "sha256": sha(payload)}
    into = tmp_path / "into"
    into.mkdir()
    extract(tmp_path / "run.sxb", into)
    assert (into / "loads" / "teacher.safetensors").read_bytes() == payload


@pytest.mark.parametrize("name", ["../x", "/etc/x", "a/../../x", "C:/x", "a\\b", "a//b", "./a"])
def test_the_writer_refuses_an_unsafe_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(BundleError) as caught:
        write_bundle(tmp_path / "run.sxb", manifest(), {**MEMBERS, name: b"x"})
    assert caught.value.code == E_UNSAFE
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("changes", "members", "code"),
    [
        ({"main": "sources/other.sx"}, MEMBERS, E_MANIFEST),
        ({"created": 5}, MEMBERS, E_MANIFEST),
        ({"compiled": {"folder": "c", "files": 1, "size": 1, "seconds": float("nan")}}, {**MEMBERS, "c/x": b"x"}, E_MANIFEST),
        ({"compiled": {"folder": "c", "files": 2, "size": 1, "seconds": 1.0}}, {**MEMBERS, "c/x": b"x"}, E_MANIFEST),
        ({}, {**MEMBERS, MANIFEST: b"{}"}, E_UNSAFE),
        ({}, {**MEMBERS, "Data/text.txt": b"x"}, E_UNSAFE),
    ],
)  # fmt: skip
def test_the_writer_refuses_what_a_reader_would(
    tmp_path: Path, changes: dict[str, Any], members: dict[str, bytes], code: str
) -> None:
    with pytest.raises(BundleError) as caught:
        write_bundle(tmp_path / "run.sxb", manifest(**changes), members)
    assert caught.value.code == code, str(caught.value)
    assert os.listdir(tmp_path) == []


def test_a_bundle_error_is_a_one_line_user_error() -> None:
    error = BundleError("run.sxb is damaged: it is not a zip archive", code=E_DAMAGED)
    assert isinstance(error, SexpError) and error.exit_code == 1
    assert str(error) == "E-BUNDLE-001: run.sxb is damaged: it is not a zip archive"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("sources/my-run.sx", None),
        ("outside/1/teacher.safetensors", None),
        ("../x", "climbs out of its folder with '..'"),
        ("/etc/x", "is absolute"),
        ("C:/x", "names a drive"),
        ("a\\b", "has a backslash"),
        ("a\nb", "has a control character"),
        ("", "has an empty part"),
        ("a/", "has an empty part"),
        ("a/" + "x" * 300, "is too long"),
    ],
)
def test_unsafe_name(name: str, why: str | None) -> None:
    assert unsafe_name(name) == why


def test_describe_shows_every_part(tmp_path: Path) -> None:
    compiled = {"folder": "compiled", "files": 1, "size": 3, "seconds": 41.25}
    record = manifest(compiled=compiled)
    written = write_bundle(tmp_path / "run.sxb", record, {**MEMBERS, "compiled/cache.bin": b"abc"})
    lines = describe(written)
    text = "\n".join(lines)
    assert lines[0] == "main: sources/my-run.sx"
    assert f"  my-run.sx  from /home/me/my-run.sx  sha256 {sha(SOURCE)[:12]}..." in lines
    assert (
        f"  /models/teacher.safetensors  {len(WEIGHTS)} B  sha256 {sha(WEIGHTS)[:12]}..." in lines
    )
    assert "  /data/text.txt  12 B  copied" in lines
    assert "  /data/big.txt  1.0 GB  not copied" in lines
    assert "  variant small" in lines and "  lr = 0.001 (--set)" in lines
    assert "  widths = [4, 8] (variant small)" in lines
    assert lines.index("  attention = sdpa") < lines.index("  cpu.blas = openblas")
    assert "  torch 2.5.1" in lines and "  plugin torch 0.4.0" in lines
    assert "  cpu.capability = AVX2" in lines
    assert "compiled: 3 B in 1 files under compiled/, compiled in 41.2 s" in lines
    total = sum(len(d) for d in MEMBERS.values()) + 3
    assert f"  sources   {len(SOURCE)} B" in lines and f"  total     {total} B" in lines
    assert "  compiled  3 B" in lines
    assert "\x1b" not in text and all(not line.startswith("\t") for line in lines)
    assert "compiled: none" in describe(write_bundle(tmp_path / "b.sxb", manifest(), MEMBERS))


# ---------------------------------------------------------------- every refusal


def test_a_flipped_byte_in_a_member_is_damage(tmp_path: Path) -> None:
    bundle = tmp_path / "run.sxb"
    write_bundle(bundle, manifest(), MEMBERS)
    data = bytearray(bundle.read_bytes())
    at = data.find(WEIGHTS)  # stored, so its bytes are in the file as they are
    assert at > 0
    data[at + 100] ^= 0x01
    bundle.write_bytes(bytes(data))
    refused(bundle, tmp_path, E_DAMAGED, by_reader=False)


def test_a_member_not_its_listed_sha256_is_damage(tmp_path: Path) -> None:
    # a CRC that agrees with the bytes: only the manifest's sha256 tells
    bundle = craft(
        tmp_path / "run.sxb",
        {**MEMBERS, "extra/notes.txt": b"notes"},
        entries={"extra/notes.txt": {"size": 5, "sha256": sha(b"other")}},
    )
    error = refused(bundle, tmp_path, E_DAMAGED, by_reader=False)
    assert f"member extra/notes.txt has sha256 {sha(b'notes')[:12]}..." in str(error)
    assert f"where the manifest says {sha(b'other')[:12]}..." in str(error)


def _central_directory(data: bytes) -> int:
    return data.find(b"PK\x01\x02")


@pytest.mark.parametrize("where", ["start", "header", "middle", "central", "end", "eocd"])
def test_a_truncated_archive_is_damage(tmp_path: Path, where: str) -> None:
    bundle = tmp_path / "run.sxb"
    write_bundle(bundle, manifest(), MEMBERS)
    data = bundle.read_bytes()
    cut = {
        "start": 0,
        "header": 10,
        "middle": len(data) // 2,
        "central": _central_directory(data) + 30,
        "end": len(data) - 1,
        "eocd": len(data) - 22,
    }[where]
    bundle.write_bytes(data[:cut])
    refused(bundle, tmp_path, E_DAMAGED)


@pytest.mark.parametrize("content", [b"", b"hello", b"PK\x03\x04" + bytes(100)])
def test_not_a_zip_is_damage(tmp_path: Path, content: bytes) -> None:
    bundle = tmp_path / "run.sxb"
    bundle.write_bytes(content + random.Random(1).randbytes(len(content) * 20))
    refused(bundle, tmp_path, E_DAMAGED)


def test_a_bundle_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BundleError) as caught:
        read_manifest(tmp_path / "nowhere.sxb")
    assert caught.value.code == E_DAMAGED
    with pytest.raises(BundleError) as caught:
        read_manifest(tmp_path)  # a folder
    assert caught.value.code == E_DAMAGED


@pytest.mark.parametrize(
    "name", ["../x", "/etc/x", "a/../../x", "C:/x", "a\\b", "a//b", "./x", "x/", "../../../../x"]
)
def test_an_unsafe_member_name_is_refused(tmp_path: Path, name: str) -> None:
    bundle = craft(tmp_path / "run.sxb", {**MEMBERS, name: b"escaped"})
    error = refused(bundle, tmp_path, E_UNSAFE)
    assert "member" in str(error)


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        (0o120777, "is a symlink"),
        (0o040755, "is not a regular file"),
        (0o010644, "is not a regular file"),
    ],
)
def test_a_member_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, mode: int, said: str
) -> None:
    files = {**MEMBERS, "extra/link": b"/etc/passwd"}
    bundle = craft(tmp_path / "run.sxb", files, attrs={"extra/link": mode << 16})
    assert said in str(refused(bundle, tmp_path, E_UNSAFE))


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"extra/A.txt": b"1", "extra/a.txt": b"2"}, "only in case"),
        ({"extra": b"1", "extra/x": b"2"}, "both a file and a folder"),
    ],
)
def test_members_that_cannot_lie_side_by_side_are_refused(
    tmp_path: Path, extra: dict[str, bytes], said: str
) -> None:
    bundle = craft(tmp_path / "run.sxb", {**MEMBERS, **extra})
    assert said in str(refused(bundle, tmp_path, E_UNSAFE))


def test_a_member_not_in_the_manifest_is_damage(tmp_path: Path) -> None:
    files = {**MEMBERS, "extra/smuggled": b"x"}
    bundle = craft(tmp_path / "run.sxb", files, unlisted=("extra/smuggled",))
    assert "member extra/smuggled is not in the manifest" in str(
        refused(bundle, tmp_path, E_DAMAGED)
    )


def test_a_listed_member_missing_from_the_zip_is_damage(tmp_path: Path) -> None:
    entries = {"extra/gone": {"size": 1, "sha256": sha(b"x")}}
    bundle = craft(tmp_path / "run.sxb", entries=entries)
    assert "member extra/gone is missing" in str(refused(bundle, tmp_path, E_DAMAGED))


def test_a_member_listed_twice_in_the_zip_is_damage(tmp_path: Path) -> None:
    bundle = craft(tmp_path / "run.sxb")
    with pytest.warns(UserWarning), zipfile.ZipFile(bundle, "a") as archive:
        archive.writestr("data/text.txt", b"x" * len(DATA))  # the same size: only its name tells
    assert "member data/text.txt is in the archive twice" in str(
        refused(bundle, tmp_path, E_DAMAGED)
    )


def test_no_manifest_is_damage(tmp_path: Path) -> None:
    bundle = tmp_path / "run.sxb"
    with zipfile.ZipFile(bundle, "w") as archive:
        archive.writestr("data/text.txt", DATA)
    refused(bundle, tmp_path, E_DAMAGED)


def test_a_declared_size_other_than_the_zips_is_damage(tmp_path: Path) -> None:
    entries = {"sources/my-run.sx": {"size": len(SOURCE) + 5, "sha256": sha(SOURCE)}}
    bundle = craft(tmp_path / "run.sxb", entries=entries)
    said = f"has {len(SOURCE)} bytes where the manifest says {len(SOURCE) + 5}"
    assert said in str(refused(bundle, tmp_path, E_DAMAGED))


@pytest.mark.parametrize(("offset", "value"), [(8, 0x1), (10, 99)], ids=["encrypted", "method"])
def test_a_member_sexpgpu_cannot_have_written_is_damage(
    tmp_path: Path, offset: int, value: int
) -> None:
    bundle = craft(tmp_path / "run.sxb")
    patch_central(bundle, "data/text.txt", offset, "<H", value)
    refused(bundle, tmp_path, E_DAMAGED)


def test_members_over_the_bound_are_too_large(tmp_path: Path) -> None:
    bundle = tmp_path / "run.sxb"
    written = write_bundle(bundle, manifest(), MEMBERS)
    declared = sum(e["size"] for e in written["members"].values())
    error = refused(bundle, tmp_path, E_TOO_LARGE, bound=10, by_reader=False)
    assert f"its members hold {declared} bytes, over 10" in str(error)  # before unpacking any


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_member_holding_more_than_its_declared_size_is_damage(
    tmp_path: Path, method: int
) -> None:
    blob = b"A" * 1000
    files = {**MEMBERS, "extra/blob": blob}
    entries = {"extra/blob": {"size": 10, "sha256": sha(blob[:10])}}
    bundle = craft(tmp_path / "run.sxb", files, entries=entries, method=method)
    patch_central(bundle, "extra/blob", 24, "<I", 10)  # the uncompressed size
    refused(bundle, tmp_path, E_DAMAGED, by_reader=False)


def _lying_open(monkeypatch: pytest.MonkeyPatch, name: str, data: bytes) -> None:
    """Make zipfile hand out ``data`` for ``name``, past its declared size (which
    zipfile itself never does): the reader's own counts must catch it."""
    real = zipfile.ZipFile.open

    def lying(self: zipfile.ZipFile, member: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(member, "filename", member) == name:
            return io.BytesIO(data)
        return real(self, member, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", lying)


def test_bytes_read_past_a_declared_size_are_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "run.sxb"
    write_bundle(bundle, manifest(), MEMBERS)
    _lying_open(monkeypatch, "data/text.txt", DATA * 10_000)
    error = refused(bundle, tmp_path, E_DAMAGED, by_reader=False)
    assert f"holds more than the {len(DATA)} bytes the manifest says" in str(error)


def test_bytes_read_past_the_bound_are_too_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "run.sxb"
    written = write_bundle(bundle, manifest(), MEMBERS)
    declared = sum(e["size"] for e in written["members"].values())
    _lying_open(monkeypatch, "sources/my-run.sx", SOURCE * 10_000)  # the last unpacked
    error = refused(bundle, tmp_path, E_TOO_LARGE, bound=declared, by_reader=False)
    assert "member sources/my-run.sx unpacks past the bound" in str(error)


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"\xff\xfe{}", b"[" * 100_000, b'{"format": NaN}', b"[1, 2]", b"1" * 5000],
    ids=["syntax", "utf8", "deep-recursion", "nan", "array", "huge-int"],
)
def test_a_manifest_that_is_not_json_is_refused(tmp_path: Path, raw: bytes) -> None:
    refused(craft(tmp_path / "run.sxb", raw=raw), tmp_path, E_MANIFEST)


_DROP = object()
_DEEP: Any = 1
for _ in range(40):
    _DEEP = [_DEEP]


def _set(keys: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of a manifest: the value at ``keys`` made ``value`` (``_DROP``: removed)."""

    def change(record: dict[str, Any]) -> None:
        for key in keys[:-1]:
            record = record[key]
        if value is _DROP:
            del record[keys[-1]]
        else:
            record[keys[-1]] = value

    return change


_TEXT = "data/text.txt"


@pytest.mark.parametrize(
    ("keys", "value", "said"),
    [
        (("format",), "1", "format is not integer"),
        (("format",), True, "format is not integer"),
        (("format",), 1.0, "format is not integer"),
        (("format",), 99, "format 99, where this sexpgpu reads 1"),
        (("format",), _DROP, "the manifest has no 'format'"),
        (("created",), _DROP, "the manifest has no 'created'"),
        (("members",), [], "members is not object"),
        (("members", _TEXT, "size"), -1, f"members/{_TEXT}/size is below 0"),
        (("members", _TEXT, "size"), "12", f"members/{_TEXT}/size is not integer"),
        (("members", _TEXT, "sha256"), "A" * 64, "is not a sha256 in lowercase hex"),
        (("members", MANIFEST), {"size": 1, "sha256": "0" * 64}, "members lists manifest.json"),
        (("selection", "knobs"), {"lr": 1}, "selection/knobs is not array"),
        (("selection", "knobs", 0, "value"), _DEEP, "nests deeper than 32"),
        (("selection", "variant"), 3, "selection/variant is not string or null"),
        (("versions", "libraries", "torch"), 2, "versions/libraries/torch is not string"),
        (("choices",), {"a": 1}, "choices/a is not string"),
        (("compiled",), 3, "compiled is not null or a record"),
        (("data_files", 1, "member"), 7, "data_files/1/member is not string or null"),
        (("main",), "sources/other.sx", "main names the member sources/other.sx"),
        (("loads", 0, "sha256"), "1" * 64, "loads/0 says sha256"),
        (("loads", 0, "member"), "loads/other", "loads/0 names the member loads/other"),
    ],
)
def test_a_manifest_of_the_wrong_shape_is_refused(
    tmp_path: Path, keys: tuple[Any, ...], value: Any, said: str
) -> None:
    bundle = craft(tmp_path / "run.sxb", change=_set(keys, value))
    error = refused(bundle, tmp_path, E_MANIFEST)
    assert said in str(error)


def test_a_manifest_over_16_mib_is_too_large(tmp_path: Path) -> None:
    bundle = craft(
        tmp_path / "run.sxb", method=zipfile.ZIP_DEFLATED, change=_set(("pad",), "x" * (16 * 2**20))
    )
    with zipfile.ZipFile(bundle) as archive:
        size = archive.getinfo(MANIFEST).file_size
    assert size > 16 * 2**20
    # told from the declared size, before inflating any of it
    assert f"{MANIFEST} is {size} bytes, over 16 MiB" in str(refused(bundle, tmp_path, E_TOO_LARGE))


def test_extract_wants_an_empty_folder(tmp_path: Path) -> None:
    bundle = tmp_path / "run.sxb"
    write_bundle(bundle, manifest(), MEMBERS)
    into = tmp_path / "into"
    into.mkdir()
    (into / "data").write_bytes(b"mine")
    with pytest.raises(BundleError, match="not an empty folder"):
        extract(bundle, into)
    assert (into / "data").read_bytes() == b"mine"
    with pytest.raises(BundleError, match="not an empty folder"):
        extract(bundle, tmp_path / "missing")


# ---------------------------------------------------------------- no damage escapes


def _valid_bundle() -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.sxb"
        write_bundle(path, manifest(), MEMBERS)
        return path.read_bytes()


VALID = _valid_bundle()


@given(
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(1, 255)), max_size=4),
    cut=st.none() | st.integers(min_value=0),
)
@example(flips=[], cut=_central_directory(VALID) + 20)
@example(flips=[(_central_directory(VALID) + 28, 0x40)], cut=None)  # a name's length
@example(flips=[(VALID.find(b"PK\x05\x06") + 10, 0x7F)], cut=None)  # the entry count
@budget(1000)  # about 3 ms a case here
def test_no_damage_makes_the_reader_raise_anything_but_a_bundle_error(
    flips: list[tuple[int, int]], cut: int | None
) -> None:
    data = bytearray(VALID)
    for at, mask in flips:
        data[at % len(data)] ^= mask
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    with tempfile.TemporaryDirectory() as folder:
        path, into = Path(folder) / "run.sxb", Path(folder) / "into"
        path.write_bytes(bytes(data))
        into.mkdir()
        try:
            read_manifest(path)
        except BundleError as error:
            assert error.code in CODES, str(error)
        try:
            extract(path, into)
        except BundleError as error:
            assert error.code in CODES, str(error)
            assert list(into.iterdir()) == []
        assert sorted(os.listdir(folder)) == ["into", "run.sxb"]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_fifo_or_a_device_is_refused_without_reading(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "run.sxb"
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes it: an open for reading would wait for ever
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(BundleError) as raised:
        read_manifest(path)
    assert raised.value.code == E_DAMAGED and "not a regular file" in str(raised.value)

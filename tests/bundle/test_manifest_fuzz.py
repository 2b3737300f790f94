"""Manifests of every shape, read as a run reads them: a bundle whose manifest has any
field of another type, size or path is either run (unpacked, checked, and every field
a run uses read) or refused with one `E-BUNDLE-` line; never another exception, never
a hang, and nothing written outside the folder it was unpacked into.

In this process: the reader and every check before the program compiles
(:func:`sexpgpu_bundle.opening.unpack_to_run`), with what a run then asks of the
manifest; tests/bundle/test_hostile_bundles.py runs forged bundles end to end."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from sexpgpu.catalog import Catalog
from sexpgpu_bundle.archive import FORMAT, MANIFEST, BundleError, describe
from sexpgpu_bundle.opening import installed_versions, machine_kind, unpack_to_run
from sexpgpu_cli.commands.checkpoint import shown
from tests.properties import budget

CATALOG = Catalog.load()
"""The installed plugins, as `sexpgpu run` finds them."""

SOURCE = b"(defknob steps 2)\n"
WEIGHTS = b"weights" * 10
DATA = b"the recorded data file\n"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


MEMBERS = {
    "sources/run.sx": SOURCE,
    "outside/1/head.safetensors": WEIGHTS,
    "compiled/fxgraph/a": b"kernel",
}


def _manifest(data_path: str) -> dict[str, Any]:
    """A manifest as `sexpgpu bundle` writes one, for :data:`MEMBERS` and a data file
    recorded at ``data_path``, with this machine's versions."""
    plugins = {r.name: r.version for r in CATALOG.records if r.available and not r.disabled}
    return {
        "format": FORMAT,
        "created": "2024-05-01T12:00:00+00:00",
        "members": {n: {"size": len(d), "sha256": _sha(d)} for n, d in MEMBERS.items()},
        "main": "sources/run.sx",
        "sources": [
            {
                "name": "run.sx",
                "member": "sources/run.sx",
                "sha256": _sha(SOURCE),
                "original": "/home/me/run.sx",
            }
        ],  # fmt: skip
        "loads": [
            {
                "uri": "/w/head.safetensors",
                "member": "outside/1/head.safetensors",
                "size": len(WEIGHTS),
                "sha256": _sha(WEIGHTS),
            }
        ],  # fmt: skip
        "data_files": [{"uri": data_path, "size": len(DATA), "sha256": _sha(DATA), "member": None}],
        "selection": {
            "variant": None,
            "sets": {"steps": "2"},
            "steps": None,
            "knobs": [{"name": "steps", "value": 2, "source": "command line"}],
        },
        "choices": {"lowering": "torch", "cpu.threads": "1"},
        "versions": installed_versions(plugins),
        "machine": {},
        "compiled": {"folder": "compiled", "files": 1, "size": 6, "seconds": 0.5},
    }


# Every field a manifest has, and a few inside them: where a draw puts its value.
FIELDS: list[tuple[Any, ...]] = [
    ("format",), ("created",), ("main",), ("members",),
    ("members", "sources/run.sx"), ("members", "sources/run.sx", "size"), ("members", "a\nb"),
    ("members", "sources/run.sx", "sha256"),
    ("sources",), ("sources", 0), ("sources", 0, "name"), ("sources", 0, "member"),
    ("sources", 0, "original"), ("sources", 0, "sha256"),
    ("loads",), ("loads", 0, "uri"), ("loads", 0, "member"), ("loads", 0, "size"),
    ("data_files",), ("data_files", 0), ("data_files", 0, "uri"), ("data_files", 0, "size"),
    ("data_files", 0, "sha256"), ("data_files", 0, "member"),
    ("selection",), ("selection", "variant"), ("selection", "sets"),
    ("selection", "sets", "steps"), ("selection", "sets", "a b"), ("selection", "steps"),
    ("selection", "knobs"), ("selection", "knobs", 0, "value"), ("selection", "knobs", 0, "name"),
    ("choices",), ("choices", "cpu.threads"), ("choices", "lowering"), ("choices", "a\nb"),
    ("versions",), ("versions", "sexpgpu"), ("versions", "libraries"),
    ("versions", "plugins", "torch"), ("machine",), ("machine", "cpu.capability"),
    ("compiled",), ("compiled", "folder"), ("compiled", "files"), ("compiled", "size"),
    ("compiled", "seconds"),
]  # fmt: skip

DROP = object()
PATHS = [
    "/etc/passwd", "/dev/zero", "/dev/null", "../../x", "/", "", ".", "..", "~/.bashrc",
    "file:///etc/passwd", "s3://bucket/key", "sources/run.sx", "compiled", "a\x00b",
    "/tmp/x\nmain: forged", "\x1b[2J", "sources/../../x", "C:\\x", "a" * 5000, "FIFO",
]  # fmt: skip
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(PATHS)
)
VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
) | st.just(DROP)  # fmt: skip


@dataclass(frozen=True)
class Like:
    """A value of the same type as the one it replaces, picked by ``pick``: most of the
    draws above are refused for their type alone, these reach the checks after it."""

    pick: int


def _like(old: Any, pick: int) -> Any:
    if isinstance(old, bool) or old is None:
        return [None, True, False][pick % 3]
    if isinstance(old, int):
        return pick
    if isinstance(old, float):
        return pick / 7
    if isinstance(old, str):
        return PATHS[pick % len(PATHS)]
    if isinstance(old, dict):
        return {PATHS[pick % len(PATHS)][:60]: PATHS[(pick // 3) % len(PATHS)]}
    return []


EDITS = st.tuples(
    st.sampled_from(FIELDS),
    VALUES | st.builds(Like, st.integers(min_value=-(2**64), max_value=2**64)),
)


def _put(manifest: dict[str, Any], keys: tuple[Any, ...], value: Any) -> None:
    """``value`` at ``keys`` in ``manifest``, where the keys above it reach; else nothing."""
    for key in keys[:-1]:
        try:
            manifest = manifest[key]
        except (KeyError, IndexError, TypeError):
            return
    last = keys[-1]
    if isinstance(value, Like):
        try:
            value = _like(manifest[last], value.pick)
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(manifest, dict) and isinstance(last, str):
        if value is DROP:
            manifest.pop(last, None)
        else:
            manifest[last] = value
    elif isinstance(manifest, list) and isinstance(last, int) and last < len(manifest):
        if value is not DROP:
            manifest[last] = value


def _resolve(value: Any, fifo: str) -> Any:
    """``value`` with this case's FIFO in place of its placeholder."""
    if value == "FIFO":
        return fifo
    if isinstance(value, list):
        return [_resolve(v, fifo) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, fifo) for k, v in value.items()}
    return value


def _use(unpacked: Any, name: str) -> None:
    """What a run asks of a manifest it took, and `--show` prints of it."""
    assert isinstance(unpacked.sets, dict) and isinstance(unpacked.choices, dict)
    assert unpacked.variant is None or isinstance(unpacked.variant, str)
    assert unpacked.steps is None or unpacked.steps >= 1
    assert Path(unpacked.main).is_file()
    cache = unpacked.compile_cache()
    assert cache is None or cache.is_relative_to(unpacked.folder.resolve())
    world = unpacked.closed_world(name)
    for what, location in (("data", "/etc/passwd"), ("include", unpacked.main)):
        try:
            world(what, location)
        except BundleError as error:
            assert error.code == "E-BUNDLE-009"
    machine_kind(unpacked.choices)
    for line in describe(unpacked.manifest):
        assert "\n" not in shown(line)


@given(
    edits=st.lists(EDITS, min_size=1, max_size=3),
    fresh=st.booleans(),
)
@example(edits=[(("selection", "sets"), [1])], fresh=False)
@example(edits=[(("members", "a\nb"), {"size": -1, "sha256": "0" * 64})], fresh=False)
@example(
    edits=[(("data_files", 0, "uri"), "/dev/zero"), (("data_files", 0, "size"), 0)], fresh=True
)
@example(edits=[(("data_files", 0, "uri"), "FIFO"), (("data_files", 0, "size"), 0)], fresh=True)
@example(edits=[(("compiled", "folder"), "/tmp/x")], fresh=False)
@example(edits=[(("compiled", "folder"), "../../x")], fresh=False)
@example(edits=[(("sources", 0, "original"), "/tmp/x\nmain: forged")], fresh=False)
@example(edits=[(("choices", "cpu.threads"), "99999999999")], fresh=False)
@budget(500)
def test_no_manifest_makes_a_run_s_checks_fail_but_with_one_bundle_line(
    edits: list[tuple[tuple[Any, ...], Any]], fresh: bool
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        fifo, data = str(root / "fifo"), root / "data.txt"
        os.mkfifo(fifo)  # nobody writes it: a read that waited on it would hang the test
        data.write_bytes(DATA)
        manifest = _manifest(str(data))
        for keys, value in edits:
            kept = value is DROP or isinstance(value, Like)
            _put(manifest, keys, value if kept else copy.deepcopy(_resolve(value, fifo)))
        bundle, into = root / "run.sxb", root / "into"
        with zipfile.ZipFile(bundle, "w") as archive:
            archive.writestr(MANIFEST, json.dumps(manifest))
            for name, content in MEMBERS.items():
                archive.writestr(name, content)
        into.mkdir()
        try:
            unpacked = unpack_to_run(str(bundle), into, CATALOG, fresh=fresh)
        except BundleError as error:
            assert error.code is not None and error.code.startswith("E-BUNDLE-"), str(error)
            assert "\n" not in str(error) and len(str(error)) < 2000, str(error)
        else:
            _use(unpacked, str(bundle))
        assert sorted(os.listdir(root)) == ["data.txt", "fifo", "into", "run.sxb"]
        assert data.read_bytes() == DATA

"""Forged bundles, made by a test from one `sexpgpu bundle` wrote: a manifest edited and
members replaced, every size and sha256 made to agree, so that only the forgery itself
is refused; and a run of one in a process of its own, in a folder of its own, with a
temporary folder of its own, so a test sees everything it leaves behind."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.helpers import run_sexpgpu, sexpgpu_env

SCRATCH = "sexpgpu-bundle-"


def forge(
    bundle: Path,
    into: Path,
    change: Callable[[dict[str, Any]], Any] | None = None,
    members: Mapping[str, bytes] | None = None,
) -> Path:
    """``bundle`` written again as ``into``: each of ``members`` put in (a source's
    ``sha256`` follows it), then the manifest edited by ``change``."""
    with zipfile.ZipFile(bundle) as archive:
        files = {info.filename: archive.read(info) for info in archive.infolist()}
    manifest = json.loads(files.pop("manifest.json"))
    for name, data in (members or {}).items():
        files[name] = data
        digest = hashlib.sha256(data).hexdigest()
        manifest["members"][name] = {"size": len(data), "sha256": digest}
        for source in manifest["sources"]:
            if source["member"] == name:
                source["sha256"] = digest
    if change is not None:
        change(manifest)
    with zipfile.ZipFile(into, "w") as archive:
        archive.writestr("manifest.json", json.dumps(manifest))
        for name, data in files.items():
            archive.writestr(name, data)
    return into


def main_source(bundle: Path) -> tuple[str, str]:
    """The member name and text of ``bundle``'s main `.sx` file."""
    with zipfile.ZipFile(bundle) as archive:
        main = json.loads(archive.read("manifest.json"))["main"]
        return main, archive.read(main).decode()


@dataclass
class Outcome:
    """A finished `sexpgpu` command: its exit status, the lines it said (log records
    left out) and the whole of stderr."""

    returncode: int
    said: list[str]
    stderr: str
    stdout: str


def run_in_a_clean_place(
    tmp_path: Path, *args: object, timeout: float = 120, expect_left: set[str] = frozenset()
) -> Outcome:
    """``sexpgpu ARGS`` in the empty folder ``tmp_path/work`` with ``TMPDIR`` the empty
    ``tmp_path/tmp``; checks that it left nothing in either (but ``expect_left`` in the
    working folder), nor a traceback."""
    work, temporary = tmp_path / "work", tmp_path / "tmp"
    for folder in (work, temporary):
        folder.mkdir(exist_ok=True)
    before = set(os.listdir(work))
    done = run_sexpgpu(
        *map(str, args), cwd=work, env=sexpgpu_env(TMPDIR=str(temporary)), timeout=timeout
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert os.listdir(temporary) == [], os.listdir(temporary)
    left = set(os.listdir(work)) - before - set(expect_left)
    assert not left, f"left in the working folder: {sorted(left)}"
    said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("{")]
    return Outcome(done.returncode, said, done.stderr, done.stdout)


def refused_line(tmp_path: Path, bundle: Path, *args: object, timeout: float = 120) -> str:
    """The one line ``sexpgpu run BUNDLE`` (one step, metrics in the working folder)
    says as it refuses the bundle, once checked that it left nothing behind."""
    outcome = run_in_a_clean_place(
        tmp_path, "run", bundle, "--steps", "1", "--metrics-dir", "m", *args, timeout=timeout
    )
    assert outcome.returncode == 1, outcome.stderr[-3000:]
    assert len(outcome.said) == 1, outcome.said
    return outcome.said[0]

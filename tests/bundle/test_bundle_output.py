"""Where `sexpgpu bundle -o` writes: atomically, and an output it cannot write is one
line, `E-BUNDLE-010`, told before anything is compiled and leaving nothing behind.

The suite runs as root in CI, whom no permission stops: the read-only folder is tried
by a process that has dropped root (``setpriv``) when the test runs as root."""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sexpgpu_bundle.archive import E_UNWRITABLE, BundleError, write_bundle
from tests.e2e.helpers import EXAMPLES, SEXPGPU, sexpgpu_env, sexpgpu_in_process

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder another user may enter (pytest's own are the owner's alone)."""
    with tempfile.TemporaryDirectory(prefix="bundle-output-") as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


def test_a_read_only_folder_is_one_line_before_compiling(shared: Path) -> None:
    (shared / "my-run.sx").write_text((EXAMPLES / "my-run.sx").read_text())
    os.chmod(shared / "my-run.sx", 0o644)
    out, home = shared / "out", shared / "home"
    out.mkdir(mode=0o555)
    home.mkdir(mode=0o777)
    os.chmod(out, 0o555)  # what the umask left aside
    os.chmod(home, 0o777)
    as_nobody = NOBODY if os.geteuid() == 0 else []
    env = sexpgpu_env(HOME=str(home), TMPDIR=str(home))
    done = subprocess.run(
        [*as_nobody, *SEXPGPU, "bundle", "my-run.sx", "-o", str(out / "run.sxb")],
        cwd=shared, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = [line for line in done.stderr.splitlines() if line and not line.startswith("{")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert said == [
        f"sexpgpu bundle: E-BUNDLE-010: cannot write {out / 'run.sxb'}: {out} cannot be written"
    ], done.stderr[-3000:]
    assert os.listdir(out) == [] and "compiling" not in done.stderr
    assert not [p for p in os.listdir(home) if p.startswith("sexpgpu-bundle-")]


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_an_output_that_is_no_file_to_write_is_one_line(tmp_path: Path, where: str) -> None:
    output = tmp_path / "missing" / "run.sxb"
    why = f"{output.parent} is not a folder"
    if where == "a-folder":
        output = tmp_path / "run.sxb"
        output.mkdir()
        why = "it is a folder"
    done = sexpgpu_in_process("bundle", EXAMPLES / "my-run.sx", "-o", output, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == f"sexpgpu bundle: E-BUNDLE-010: cannot write {output}: {why}"


MANIFEST = {
    "created": "2024-05-01T12:00:00Z",
    "main": "sources/run.sx",
    "sources": [],
    "loads": [],
    "data_files": [],
    "selection": {"variant": None, "sets": {}, "steps": None, "knobs": []},
    "choices": {},
    "versions": {"sexpgpu": "0.1.0", "libraries": {}, "plugins": {}},
    "machine": {},
    "compiled": None,
}


def test_a_write_that_fails_is_one_line_and_leaves_what_was_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = {"sources/run.sx": b"(defknob a 1)\n"}
    target = tmp_path / "run.sxb"
    write_bundle(target, MANIFEST, members)
    before = target.read_bytes()

    def read_only(*_: object, **__: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(target))

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(BundleError) as raised:
        write_bundle(target, MANIFEST, {"sources/run.sx": b"(defknob a 2)\n"})
    assert raised.value.code == E_UNWRITABLE
    assert str(raised.value) == f"E-BUNDLE-010: cannot write {target}: Read-only file system"
    assert target.read_bytes() == before and os.listdir(tmp_path) == ["run.sxb"]
    monkeypatch.undo()
    with pytest.raises(BundleError) as raised:
        write_bundle(tmp_path / "none" / "run.sxb", MANIFEST, members)
    assert str(raised.value).endswith("run.sxb: No such file or directory")
    gone = tmp_path / "gone.sx"
    with pytest.raises(BundleError) as raised:  # a member's file that vanished: named
        write_bundle(tmp_path / "b.sxb", MANIFEST, {"sources/run.sx": gone}, known={
            "sources/run.sx": (1, "0" * 64)
        })  # fmt: skip
    assert str(raised.value) == (
        f"E-BUNDLE-010: cannot write {tmp_path / 'b.sxb'}: {gone}: No such file or directory"
    )
    assert sorted(os.listdir(tmp_path)) == ["run.sxb"]

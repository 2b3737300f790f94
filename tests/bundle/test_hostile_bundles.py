"""Bundles someone else made, forged, as a user meets them: `sexpgpu run NAME.sxb` in a
process of its own, with a time limit. Each forgery is one line with its `E-BUNDLE-`
code, and the run leaves nothing in its working folder or the temporary folder, nor
anything where the forgery pointed.

The forgeries are made from a fresh `sexpgpu bundle` of one small project: a `:load`
file copied in, a text data file recorded by path and sha256, not copied.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from sexpgpu_bundle.archive import BundleError
from sexpgpu_bundle.opening import unpack
from tests.bundle.forging import forge, main_source, refused_line, run_in_a_clean_place
from tests.e2e.helpers import run_sexpgpu, sexpgpu_in_process

PROGRAM = """\
(defknob steps 2)
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02) :load (file "head.safetensors" "lm_head.weight"))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (text :path "corpus.txt") :seq 8 :batch 4)
(defrun hostile
  :model (net 256 8) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01) :steps steps :seed 3)
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle of the project, as `sexpgpu bundle` writes it."""
    root = tmp_path_factory.mktemp("hostile")
    project = root / "proj"
    project.mkdir()
    (project / "run.sx").write_text(PROGRAM)
    (project / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 8)
    head = np.random.default_rng(1).normal(size=(8, 256)).astype(np.float32)
    save_file({"lm_head.weight": head}, str(project / "head.safetensors"))
    done = run_sexpgpu("bundle", project / "run.sx", "-o", root / "made.sxb", cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "made.sxb"


def _edit(keys: tuple[Any, ...], value: Any):
    def change(manifest: dict[str, Any]) -> None:
        for key in keys[:-1]:
            manifest = manifest[key]
        manifest[keys[-1]] = value

    return change


def test_the_bundle_the_forgeries_start_from_runs(made: Path, tmp_path: Path) -> None:
    outcome = run_in_a_clean_place(
        tmp_path, "run", made, "--metrics-dir", "m", expect_left={"m"}, timeout=300
    )
    assert outcome.returncode == 0, outcome.stderr[-3000:]


@pytest.mark.parametrize("sets", [[1], None, "steps=9"], ids=["list", "null", "string"])
def test_selection_sets_of_another_type_is_one_line(made: Path, tmp_path: Path, sets: Any) -> None:
    forged = forge(made, tmp_path / "sets.sxb", _edit(("selection", "sets"), sets))
    line = refused_line(tmp_path, forged)
    assert line == (
        f"sexpgpu run: E-BUNDLE-004: {forged} has a bad manifest: selection/sets is not object"
    )


def test_a_thread_count_no_machine_has_is_one_line(made: Path, tmp_path: Path) -> None:
    forged = forge(made, tmp_path / "threads.sxb", _edit(("choices", "cpu.threads"), "99999999999"))
    line = refused_line(tmp_path, forged, timeout=300)
    assert line.startswith(
        "sexpgpu run: E-BUNDLE-004: the bundle's choice cpu.threads 99999999999 cannot be taken"
    ), line


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_recorded_data_file_that_is_no_regular_file_is_refused_without_waiting(
    made: Path, tmp_path: Path, kind: str
) -> None:
    path = "/dev/zero"
    if kind == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)  # no writer: opening it to read would wait for ever

    def record(manifest: dict[str, Any]) -> None:
        entry = {"uri": path, "size": 0, "sha256": "0" * 64, "member": None}
        manifest["data_files"].append(entry)

    forged = forge(made, tmp_path / "data.sxb", record)
    line = refused_line(tmp_path, forged, timeout=60)
    assert line == (
        f"sexpgpu run: E-BUNDLE-007: {forged} reads the data file {path}, which cannot be "
        "read here: it is not a regular file (bundle it with --with-data)"
    )


@pytest.mark.parametrize("where", ["absolute", "climbing"])
def test_compile_caches_outside_the_bundle_are_refused(
    made: Path, tmp_path: Path, where: str
) -> None:
    target = tmp_path / "elsewhere"
    folder = str(target) if where == "absolute" else "../../elsewhere"

    def compiled(manifest: dict[str, Any]) -> None:
        manifest["choices"]["lowering"] = "compiled"
        manifest["compiled"] = {"folder": folder, "files": 0, "size": 0, "seconds": 1.0}

    forged = forge(made, tmp_path / "compiled.sxb", compiled)
    line = refused_line(tmp_path, forged)
    why = "is absolute" if where == "absolute" else "climbs out of its folder with '..'"
    assert line == f"sexpgpu run: E-BUNDLE-002: {forged} is unsafe: compiled/folder {folder} {why}"
    assert not target.exists()


def _outside(tmp_path: Path, name: str, text: str = "") -> str:
    path = tmp_path / "outside" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "reads",
    [
        "include", "load", "with-loaded", "data-absolute", "data-climbing", "data-home",
        "data-file-uri",
    ],
)  # fmt: skip
def test_a_program_naming_a_file_the_bundle_does_not_hold_is_refused_naming_it(
    made: Path, tmp_path: Path, reads: str
) -> None:
    member, text = main_source(made)
    corpus = re.search(r'\(text :path "([^"]+)"\)', text).group(1)  # recorded, not copied
    # a file outside the bundle that would fail otherwise if it were read: a source that
    # does not parse, weights that are no safetensors, data too short for one window
    bad = _outside(tmp_path, "lib.sx", "(((")
    said = {
        "include": ("includes", bad),
        "load": ("loads", _outside(tmp_path, "w.safetensors", "not weights")),
        "with-loaded": ("loads", _outside(tmp_path, "t.safetensors", "not weights")),
        "data-absolute": ("reads the data file", _outside(tmp_path, "short.txt", "ab")),
        "data-climbing": ("reads the data file", "../" * 40 + "etc/hostname"),
        "data-home": ("reads the data file", "~/.bashrc"),
        "data-file-uri": ("reads the data file", "file:///etc/passwd"),
    }
    verb, named = said[reads]
    if reads == "include":
        forged_text = f'(include "{bad}")\n{text}'
    elif reads == "load":
        forged_text = text.replace('(param embed [vocab dim] :init (normal 0.02))', (
            f'(param embed [vocab dim] :init (normal 0.02) :load (file "{named}" "e"))'
        ))  # fmt: skip
    elif reads == "with-loaded":
        teacher = f':with-loaded (teacher (net 256 8) :file "{named}" :names "{{path}}")'
        forged_text = text.replace("(defrun hostile\n", f"(defrun hostile\n  {teacher}\n")
    else:
        forged_text = text.replace(f'"{corpus}"', f'"{named}"')
    assert forged_text != text
    forged = forge(made, tmp_path / "program.sxb", members={member: forged_text.encode()})
    line = refused_line(tmp_path, forged)
    # a `.sx` error: its place in the bundle's source, then the code and the path
    assert re.match(r"^/.*/unpacked/sources/run\.sx:\d+:\d+: E-BUNDLE-009: ", line), line
    # a relative path is named as the compiler resolved it: from the source's folder
    shown = "/etc/hostname" if reads == "data-climbing" else named
    assert f"{forged} {verb} {shown}, which the bundle neither holds nor recorded" in line, line


def test_a_recorded_data_path_the_program_does_not_read_stays_refused_when_data_files_empty(
    made: Path, tmp_path: Path
) -> None:
    # the program reads the recorded file; the manifest no longer records it
    forged = forge(made, tmp_path / "unrecorded.sxb", _edit(("data_files",), []))
    line = refused_line(tmp_path, forged)
    assert "E-BUNDLE-009" in line and "corpus.txt" in line, line


def test_show_escapes_what_it_prints(made: Path, tmp_path: Path) -> None:
    def forged_paths(manifest: dict[str, Any]) -> None:
        manifest["sources"][0]["original"] = "/home/me/run.sx\nmain: sources/evil.sx"
        manifest["choices"]["lowering"] = "torch\x1b[2J"  # refused: a choice is printable

    refused = forge(made, tmp_path / "choice.sxb", forged_paths)
    done = sexpgpu_in_process("bundle", "--show", refused, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (
        f"sexpgpu bundle: E-BUNDLE-004: {refused} has a bad manifest: "
        "choices/lowering holds a control character"
    )
    shown = forge(made, tmp_path / "show.sxb", _edit(("sources", 0, "original"), "/a\nmain: x"))
    done = sexpgpu_in_process("bundle", "--show", shown, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("main:")] == ["main: sources/run.sx"]
    assert any(line.startswith("  run.sx  from /a\\nmain: x  sha256 ") for line in lines), lines


class _Store:
    """A store holding one object of ``size`` bytes, answering ``short`` bytes fewer
    than asked when ``short``; counts what it was asked to read."""

    def __init__(self, size: int, short: int = 0) -> None:
        self.size, self.short, self.read = size, short, 0

    def identity(self, key: str) -> Any:
        return type("Identity", (), {"size": self.size})()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self.read += length
        return b"x" * (length - self.short)


def test_a_bundle_in_a_store_is_fetched_within_bounds(tmp_path: Path) -> None:
    huge = _Store(2**50)
    with pytest.raises(BundleError) as raised:
        unpack("s3://b/run.sxb", tmp_path / "into", lambda _: huge)
    assert raised.value.code == "E-BUNDLE-003" and huge.read == 0
    assert "s3://b/run.sxb is 1125899906842624 bytes" in str(raised.value)
    lying = _Store(10, short=1)
    with pytest.raises(BundleError) as raised:
        unpack("s3://b/run.sxb", tmp_path / "again", lambda _: lying)
    assert str(raised.value) == "E-BUNDLE-006: cannot read the bundle s3://b/run.sxb: it changed"

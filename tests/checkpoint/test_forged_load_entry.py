"""A checkpoint whose `:load` entry lost its file's `size` or `version` (a forgery: the
writer never writes one) is refused by `sexpgpu checkpoint` and by `sexpgpu run
--resume` alike, each in a subprocess as a user runs it: one line with E-CKPT-003,
no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.helpers import refused_in_process
from tests.loads.helpers import run_sexpgpu, said, write_project

STEP = "ckpt/step-00000002"
E = f"{STEP}/experiment.json"
REFUSED = f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: "


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A project with a frozen teacher and a trainable head read with :load, run 2 steps."""
    work = tmp_path_factory.mktemp("forged-load")
    write_project(work)
    done = run_sexpgpu("run", "loads.sx", "--checkpoint-dir", "ckpt", "--steps", "2", cwd=work)
    assert done.returncode == 0, done.stderr
    return work


def _drop(*names: str) -> Callable[[dict], None]:
    def change(load: dict) -> None:
        for name in names:
            del load[name]

    return change


def _null(*names: str) -> Callable[[dict], None]:
    def change(load: dict) -> None:
        load.update(dict.fromkeys(names))

    return change


FORGERIES = {
    "no size, no version": _drop("size", "version"),
    "no size": _drop("size"),
    "no version": _drop("version"),
    "a null size and version": _null("size", "version"),
}


# each forgery of the frozen teacher's entry (read again from its file on resume), and
# one of the trainable head's (its values are in the checkpoint too)
CASES = [("teacher.embed", forgery) for forgery in sorted(FORGERIES)] + [
    ("model.head", "no size, no version")
]


@pytest.mark.parametrize(("path", "forgery"), CASES)
def test_a_load_entry_without_its_files_identity_is_e_ckpt_003(trained, tmp_path, forgery, path):
    work = tmp_path / "work"
    shutil.copytree(trained, work)
    record = json.loads((work / E).read_text())
    (entry,) = [p for p in record["params"] if p["path"] == path]
    FORGERIES[forgery](entry["load"])
    (work / E).write_text(json.dumps(record))
    before = sorted(str(p.relative_to(work)) for p in (work / "ckpt").rglob("*"))

    described = run_sexpgpu("checkpoint", STEP, cwd=work)
    assert described.returncode == 1, described.stdout
    assert described.stdout == ""
    (line,) = said(described.stderr)
    assert line.startswith(f"sexpgpu checkpoint: {REFUSED}"), line
    assert "Traceback" not in described.stderr

    for resume in (STEP, "latest"):
        run = ["run", "loads.sx", "--checkpoint-dir", "ckpt", "--steps", "4"]
        resumed = refused_in_process(*run, "--resume", resume, cwd=work)
        assert resumed.returncode == 1, resumed.stderr
        (line,) = said(resumed.stderr)
        assert line.startswith(f"sexpgpu run: {REFUSED}"), line
        assert "Traceback" not in resumed.stderr + resumed.stdout
    # refused, not started afresh: no checkpoint written after the forged one
    assert sorted(str(p.relative_to(work)) for p in (work / "ckpt").rglob("*")) == before

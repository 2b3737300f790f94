"""``tests.inprocess.refused``: a `sexpgpu run` the test expects refused before its
program is lowered, run in the test's process. It must say what the real command says,
and a run that is not refused must fail the test rather than train in its process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, refused_in_process, run_sexpgpu
from tests.inprocess import ReachedLowering


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    shutil.copy(EXAMPLES / "my-run.sx", folder / "my-run.sx")
    return folder


@pytest.mark.parametrize(
    "args",
    [
        ("--resume", "ck/step-00000009"),  # no such checkpoint
        ("--set", "nope=3"),  # a usage error: exit status 2
        ("--steps", "0"),
    ],
)
def test_a_refused_run_says_and_leaves_in_process_what_the_command_does(
    workdir: Path, tmp_path: Path, args
) -> None:
    command = ("run", "my-run.sx", "--checkpoint-dir", "ck", "--metrics-dir", "m", *args)
    fresh = run_sexpgpu(*command, cwd=workdir)
    inside = tmp_path / "inside"
    inside.mkdir()
    shutil.copy(workdir / "my-run.sx", inside / "my-run.sx")
    here = refused_in_process(*command, cwd=inside)
    assert fresh.returncode in (1, 2), fresh.stderr
    assert (here.returncode, here.stdout) == (fresh.returncode, fresh.stdout)
    assert _untimed(here.stderr) == _untimed(fresh.stderr)
    assert _listing(inside) == _listing(workdir)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _untimed(stderr: str) -> list[object]:
    """The lines of ``stderr``, a JSON log record's without its timestamp."""
    lines: list[object] = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            record.pop("timestamp", None)
            lines.append(record)
        else:
            lines.append(line)
    return lines


def test_a_run_that_is_not_refused_fails_the_test_before_it_trains(workdir: Path) -> None:
    with pytest.raises(ReachedLowering, match="was not refused: it lowered"):
        refused_in_process("run", "my-run.sx", "--checkpoint-dir", "ck", cwd=workdir)
    assert not (workdir / "ck").exists() or not list((workdir / "ck").iterdir())


def test_only_the_commands_that_train_are_taken(workdir: Path) -> None:
    with pytest.raises(ValueError, match="for sexpgpu run and evaluate"):
        refused_in_process("check", "my-run.sx", cwd=workdir)

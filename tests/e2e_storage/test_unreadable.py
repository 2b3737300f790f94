"""A local checkpoint location that lists, whose newest step folder may not be read:
`--resume latest`, a named step and `sexpgpu checkpoint` say so in one line with the
storage code, never with a traceback, and a resume never falls back on its own.

CI runs as root, which reads any folder: each `sexpgpu` here runs with every
capability dropped (``setpriv``), so a folder's mode binds it as it binds a user.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, SEXPGPU, events, experiments, run_sexpgpu, sexpgpu_env
from tests.e2e_storage.buckets import said

RUN = ["run", "examples/my-run.sx", "--metrics-dir", "m", "--checkpoint-dir", "ck"]
DENIED = "E-STORAGE-002: cannot read ck/step-00000004/experiment.json: Permission denied"


def as_user(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`sexpgpu ARGS` without the capabilities that let root past file permissions."""
    command = [*SEXPGPU, *args]
    if os.geteuid() == 0:
        command = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", *command]
    return subprocess.run(
        command, cwd=cwd, env=sexpgpu_env(), capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def unreadable_newest(tmp_path_factory):
    """A work folder whose ``ck`` holds the checkpoints of steps 2 and 4, step 4's
    folder at mode 0; shared, as nothing here can write into it."""
    workdir = tmp_path_factory.mktemp("unreadable")
    shutil.copytree(EXAMPLES, workdir / "examples")
    done = run_sexpgpu(*RUN, cwd=workdir)
    assert done.returncode == 0, done.stderr
    newest = workdir / "ck" / "step-00000004"
    newest.chmod(0)
    yield workdir
    newest.chmod(0o755)  # so that the temp folder can be removed


def losses(workdir: Path) -> int:
    return sum(
        1
        for run_dir in experiments(workdir / "m")
        for e in events(run_dir)
        if e.get("name") == "loss"
    )


def test_resume_latest_says_it_in_one_line_and_names_the_one_before(unreadable_newest: Path):
    workdir = unreadable_newest
    before = losses(workdir)
    done = as_user(*RUN, "--resume", "latest", "--steps", "6", cwd=workdir)
    assert done.returncode == 1, done.stderr
    (line,) = said(done.stderr)
    assert line == (
        f"sexpgpu run: {DENIED}; --resume latest never falls back to an older checkpoint: "
        "to resume from the one before it, pass --resume ck/step-00000002"
    )
    assert losses(workdir) == before  # no step taken
    assert sorted(os.listdir(workdir / "ck")) == ["step-00000002", "step-00000004"]


def test_resume_from_the_named_step_says_it_in_one_line(unreadable_newest: Path):
    done = as_user(*RUN, "--resume", "ck/step-00000004", "--steps", "6", cwd=unreadable_newest)
    assert done.returncode == 1, done.stderr
    assert said(done.stderr) == [f"sexpgpu run: {DENIED}"]


def test_sexpgpu_checkpoint_says_it_in_one_line(unreadable_newest: Path):
    for location in ("ck/latest", "ck/step-00000004"):
        done = as_user("checkpoint", location, cwd=unreadable_newest)
        assert done.returncode == 1, done.stderr
        assert said(done.stderr) == [f"sexpgpu checkpoint: {DENIED}"], location
    # The location's listing shows the folder, with the same line as its problem.
    done = as_user("checkpoint", "ck", cwd=unreadable_newest)
    assert "Traceback" not in done.stderr, done.stderr
    assert f"! step-00000004: {DENIED}" in done.stdout.splitlines()
    # whether it is complete is not known: never shown as complete
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[2:] if line[:1] == " "}
    assert re.fullmatch(r"  2\s+yes\s+false\s+\S+ kB\s+.+ UTC", rows["2"]), rows
    assert re.fullmatch(r"  4\s+\?\s+\?\s+-\s+-", rows["4"]), rows

"""The console script leaves the objects alive at its end out of the garbage
collector's sight (``gc.freeze`` in :func:`sexpgpu_cli.main.main`): CPython's
finalisation otherwise searches them all for garbage, several times, at every exit.
The exit status and the atexit handlers are the same as without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES
from tests.profiles import suite_env

# an atexit handler of someone else's, registered before the command runs
PROBE = """
import atexit, gc, sys
from pathlib import Path
report = Path(sys.argv[1])
atexit.register(lambda: report.write_text(str(gc.get_freeze_count())))
sys.argv = ["sexpgpu", *sys.argv[2:]]
from sexpgpu_cli.console import main
main()
"""


@pytest.mark.parametrize(
    ("args", "status"),
    [(["check", str(EXAMPLES / "my-run.sx")], 0), (["check", "missing.sx"], 1)],
    ids=["checked", "refused"],
)
def test_the_console_script_exits_with_its_status_after_every_atexit_handler(
    tmp_path: Path, args: list[str], status: int
):
    report = tmp_path / "frozen"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(report), *args],
        cwd=tmp_path, env=suite_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == status, done.stderr
    assert int(report.read_text()) > 0  # the handler ran, with the heap frozen

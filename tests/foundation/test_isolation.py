"""The test suite runs against the project's own plugins, whatever else is installed:
a third-party distribution claiming the `file` scheme, the `jsonl` sink and the
built-in attention kernel, installed for real (a dist-info on the path of the
pytest process), leaves a subset of the project's own tests passing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conflict_plugins import SHADOW, TWIN_KERNEL
from .pluginkit import REPO, make_plugin, run_sexpgpu, user_env

# Each of these uses what the third-party distribution contests: local locations
# (in the test process and in a `sexpgpu run`), the jsonl sink, and a run.
SUBSET = [
    "tests/storage/test_storage_local.py",
    "tests/metrics/test_metrics_jsonl.py",
    "tests/e2e/test_run.py::test_my_run_trains_and_checkpoints",
]


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """A folder holding the third-party distribution ``zzz-takeover`` (two plugins)."""
    return make_plugin(
        tmp_path / "site",
        "zzz-takeover",
        {"t_takeover_shadow": SHADOW, "t_takeover_kernel": TWIN_KERNEL},
        {"takeover-shadow": "t_takeover_shadow", "takeover-kernel": "t_takeover_kernel"},
    )


def test_the_third_party_distribution_takes_effect_outside_the_suite(
    installed: Path, tmp_path: Path
) -> None:
    """Without the suite's isolation the distribution contests what the subset uses
    (so the test below could fail)."""
    result = run_sexpgpu(
        ["plugins"], cwd=tmp_path, pythonpath=[installed], SEXPGPU_DISABLE_DISTRIBUTIONS=""
    )
    assert result.returncode == 0, result.stderr
    conflicts = result.stdout.split("\nconflicts (using the contested thing is refused):\n")[1]
    for what in (
        "the storage scheme 'file'",
        "the metrics sink 'jsonl'",
        "the attention kernel 'math' of the torch lowering",
    ):
        assert f"E-PLUGIN-001: {what} is supplied by more than one plugin" in conflicts


def test_the_suite_runs_only_its_own_plugins(installed: Path, tmp_path: Path) -> None:
    env = user_env([installed], SEXPGPU_DISABLE_DISTRIBUTIONS="", SHADOW_MARK=str(tmp_path / "m"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "inner"),
            *SUBSET,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed[1]) >= 3, summary
    assert not re.search(r"failed|error|skipped", summary), summary
    # and the distribution was there all along, received nothing, and was disabled
    assert not (tmp_path / "m").exists()


def test_the_suite_disables_exactly_the_third_party_distributions(installed: Path) -> None:
    """tests/conftest.py's list, computed in a process that sees the distribution."""
    code = "import json; from tests.conftest import third_party_distributions as f; print(json.dumps(f()))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=user_env([installed, REPO]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    names = json.loads(result.stdout)
    assert "zzz-takeover" in names and "sexpgpu" not in names

"""`sexpgpu --help`, `sexpgpu plugins` and `sexpgpu --version` import no heavy module
(torch, boto3, google-cloud-storage, tensorboard). Wall times are printed, never asserted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .pluginkit import run_python

# top-level names whose import (or any submodule's) is heavy, as DESIGN.md names them
HEAVY = ("torch", "boto3", "botocore", "s3transfer", "tensorboard")
# not heavy by the design, but each costs these commands 0.05-0.15 s: numpy waits for
# a data source to be opened, structlog (and the rich it imports) for a line logged
SLOW = ("numpy", "safetensors", "structlog", "rich")
# `google` and `google.cloud` are namespace packages (find_spec of google.cloud.storage
# imports them, at no cost); anything below them is the heavy client library
NAMESPACES = ("google", "google.cloud")

COMMANDS = [["--help"], ["--version"], ["plugins"], ["plugins", "--json"]]


def imported_by(argv: list[str], cwd: Path) -> tuple[set[str], float]:
    """The modules ``sexpgpu ARGV`` imports: ``python -X importtime``'s report, plus what
    ``sys.modules`` holds at exit (importtime misses modules loaded by some finders)."""
    code = f"""
import json, sys
from sexpgpu_cli.main import main
try:
    main({argv!r})
finally:
    print("MODULES=" + json.dumps(sorted(sys.modules)))
"""
    start = time.perf_counter()
    result = run_python(code, cwd=cwd, args=["-X", "importtime"])
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-2000:]
    timed = {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "imported package" not in line
    }
    assert "sexpgpu_cli.main" in timed, "importtime output not understood"
    at_exit = json.loads(result.stdout.rsplit("MODULES=", 1)[1])
    return timed | set(at_exit), wall


def heavy(modules) -> list[str]:
    """The heavy modules among ``modules``, sorted."""
    return sorted(
        m
        for m in modules
        if m.split(".")[0] in HEAVY or (m.startswith("google.") and m not in NAMESPACES)
    )


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_light_commands_import_nothing_heavy(argv: list[str], tmp_path: Path) -> None:
    modules, wall = imported_by(argv, tmp_path)
    slow = sorted({m.split(".")[0] for m in modules} & set(SLOW))
    print(f"sexpgpu {' '.join(argv)}: {wall * 1000:.0f} ms wall, {len(modules)} modules")
    assert heavy(modules) == []
    assert slow == []
    # every built-in plugin was loaded all the same (so this checks their top modules too)
    if argv[0] == "plugins":
        assert {"sexpgpu_torch", "sexpgpu_s3", "sexpgpu_gcs", "sexpgpu_local"} <= set(modules)


def test_checkpoint_help_imports_nothing_heavy(tmp_path: Path) -> None:
    modules, wall = imported_by(["checkpoint", "--help"], tmp_path)
    print(f"sexpgpu checkpoint --help: {wall * 1000:.0f} ms wall")
    assert heavy(modules) == []


def test_the_heavy_check_can_fail() -> None:
    assert heavy({"torch", "torch.nn", "google.cloud.storage", "botocore.client"}) == [
        "botocore.client",
        "google.cloud.storage",
        "torch",
        "torch.nn",
    ]
    assert heavy({"google", "google.cloud", "click", "sexpgpu.catalog"}) == []

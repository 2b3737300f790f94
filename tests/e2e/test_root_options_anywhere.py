"""`--log-format` and `--log-level` are the root group's, and are taken after the
command too, by every command: built-in, a plugin's, and a plugin's nested group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sexpgpu_cli.options import hoist_root_options
from tests.foundation.pluginkit import make_mem_plugin, run_sexpgpu

from .helpers import EXAMPLES


@pytest.fixture
def site(tmp_path: Path) -> dict:
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    return {
        "cwd": tmp_path,
        "pythonpath": [make_mem_plugin(tmp_path / "site")],
        "MEM_PLUGIN_ROOT": str(tmp_path),
    }


def json_lines(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines()]


def test_run_takes_log_format_after_the_file(site: dict) -> None:
    args = ["run", "examples/tiny-lm.sx", "--steps", "2", "--metrics-dir", "m"]
    result = run_sexpgpu([*args, "--log-format", "json"], **site)
    assert result.returncode == 0, result.stderr
    events = [line["event"] for line in json_lines(result.stderr)]
    assert events[-1] == "run finished" and "compiling" in events
    console = run_sexpgpu([*args, "--log-format=console"], **site)
    assert console.returncode == 0, console.stderr
    assert "run finished" in console.stderr
    with pytest.raises(json.JSONDecodeError):
        json_lines(console.stderr)


def test_log_level_after_a_plugin_s_nested_command(site: dict) -> None:
    put = ["mem", "put", "mem://b", "k", "v"]
    loud = run_sexpgpu([*put, "--log-format", "json"], **site)
    assert [line["event"] for line in json_lines(loud.stderr)] == ["stored"]
    quiet = run_sexpgpu([*put, "--log-level", "warning", "--log-format", "json"], **site)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_the_last_one_wins_and_a_bad_value_is_a_usage_error(site: dict) -> None:
    put = ["mem", "put", "mem://b", "k", "v"]
    result = run_sexpgpu(["--log-format", "console", *put, "--log-format", "json"], **site)
    assert json_lines(result.stderr)[0]["event"] == "stored"
    bad = run_sexpgpu(["check", "examples/tiny-lm.sx", "--log-level", "loud"], **site)
    assert bad.returncode == 2
    assert "Invalid value for '--log-level'" in bad.stderr


@pytest.mark.parametrize(
    ("given", "hoisted"),
    [
        (["run", "x.sx", "--log-format", "json"], ["--log-format", "json", "run", "x.sx"]),
        (["run", "--log-level=debug", "x.sx"], ["--log-level=debug", "run", "x.sx"]),
        (
            ["--log-level", "info", "mem", "put", "--log-level", "error"],
            ["--log-level", "info", "--log-level", "error", "mem", "put"],
        ),
        (
            ["run", "x.sx", "--", "--log-format", "json"],
            ["run", "x.sx", "--", "--log-format", "json"],
        ),
        (["run", "x.sx", "--log-format"], ["--log-format", "run", "x.sx"]),
        (["check", "--steps", "3", "x.sx"], ["check", "--steps", "3", "x.sx"]),
    ],
)
def test_hoisting(given: list[str], hoisted: list[str]) -> None:
    assert hoist_root_options(given) == hoisted

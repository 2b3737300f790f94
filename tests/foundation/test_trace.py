"""SEXPGPU_TRACE_PLUGINS=1 logs hook calls (pluggy's hook-call monitoring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .pluginkit import make_mem_plugin, run_python, run_sexpgpu

RELAY_CALL = """
from sexpgpu.catalog import Catalog
infos = Catalog.load().supplied("sexpgpu_storage_backends")
print(len(infos) > 0)
"""


def json_lines(stderr: str) -> list[dict]:
    """Every log line of a run with ``--log-format json`` (each must be a JSON object)."""
    return [json.loads(line) for line in stderr.splitlines() if line.strip()]


def hook_calls(stderr: str) -> list[dict]:
    """The trace lines announcing a hook call."""
    return [line for line in json_lines(stderr) if line.get("event") == "hook call"]


def answering(call: dict) -> set[str]:
    """The plugins a traced call went to: pluggy's relay logs ``plugins`` (a list),
    a call made plugin by plugin logs ``plugin``."""
    names = set(call.get("plugins", []))
    if "plugin" in call:
        names.add(call["plugin"])
    return names


@pytest.fixture
def site(tmp_path: Path) -> dict:
    return {
        "cwd": tmp_path,
        "pythonpath": [make_mem_plugin(tmp_path / "site")],
        "MEM_PLUGIN_ROOT": str(tmp_path),
        "SEXPGPU_LOG_FORMAT": "json",
    }


def test_trace_logs_calls_through_the_hook_relay(site: dict) -> None:
    traced = run_python(RELAY_CALL, SEXPGPU_TRACE_PLUGINS="1", **site)
    assert traced.returncode == 0, traced.stderr
    # Loading asks each plugin whether it is available (traced too); then the catalog
    # asks each plugin that implements the hook, once.
    calls = [c for c in hook_calls(traced.stderr) if c["hook"] != "sexpgpu_unavailable"]
    assert {c["hook"] for c in calls} == {"sexpgpu_storage_backends"}
    assert {"mem", "local"} <= set().union(*map(answering, calls))
    assert len(calls) == len({name for call in calls for name in answering(call)})
    events = [line["event"] for line in json_lines(traced.stderr)]
    assert events[-2:] == ["hook call", "hook done"]

    for off in ("", "0"):
        quiet = run_python(RELAY_CALL, SEXPGPU_TRACE_PLUGINS=off, **site)
        assert quiet.returncode == 0 and quiet.stderr == ""


def test_trace_logs_the_storage_lookup_of_a_command(site: dict) -> None:
    """What a user runs: a command opening a location asks the storage hook, traced."""
    result = run_sexpgpu(["mem", "describe", "mem://x"], SEXPGPU_TRACE_PLUGINS="1", **site)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "mem://x (mem test plugin, no credentials)\n"
    calls = [c for c in hook_calls(result.stderr) if c["hook"] == "sexpgpu_storage_backends"]
    assert "mem" in set().union(*map(answering, calls))
    commands = [c for c in hook_calls(result.stderr) if c["hook"] == "sexpgpu_cli_commands"]
    assert "mem" in set().union(*map(answering, commands))
    untraced = run_sexpgpu(["mem", "describe", "mem://x"], **site)
    assert untraced.returncode == 0 and hook_calls(untraced.stderr) == []


def test_trace_logs_the_availability_checks(site: dict) -> None:
    result = run_sexpgpu(["plugins"], SEXPGPU_TRACE_PLUGINS="1", **site)
    assert result.returncode == 0, result.stderr
    checks = [c for c in hook_calls(result.stderr) if c["hook"] == "sexpgpu_unavailable"]
    assert {"s3", "gcs", "tensorboard"} <= set().union(*map(answering, checks))

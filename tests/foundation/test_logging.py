"""Structured logs: `--log-format json` gives one JSON object per line; values under
secret-looking keys never reach the log."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog

from sexpgpu import log

from .pluginkit import make_mem_plugin, run_sexpgpu

SECRET = "AKIA-VERY-SECRET-42"  # what the mem plugin's `put` logs as aws_secret_access_key


@pytest.fixture
def site(tmp_path: Path) -> dict:
    return {
        "cwd": tmp_path,
        "pythonpath": [make_mem_plugin(tmp_path / "site")],
        "MEM_PLUGIN_ROOT": str(tmp_path),
    }


@pytest.fixture
def captured():
    """Logs configured as JSON into a buffer; structlog's defaults restored afterwards."""
    buffer = io.StringIO()
    log.configure(fmt="json", stream=buffer)
    yield buffer
    structlog.reset_defaults()
    log._configured = False


def test_json_log_lines_from_the_cli(site: dict) -> None:
    result = run_sexpgpu(["--log-format", "json", "mem", "put", "mem://b", "k", "v"], **site)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert len(lines) == 1
    line = lines[0]
    assert line["event"] == "stored" and line["level"] == "info"
    assert line["uri"] == "mem://b" and line["key"] == "k"
    assert line["timestamp"].endswith("Z")
    assert line["aws_secret_access_key"] == "***"
    assert SECRET not in result.stderr


def test_log_format_from_the_environment_and_level(site: dict) -> None:
    result = run_sexpgpu(["mem", "put", "mem://b", "k", "v"], SEXPGPU_LOG_FORMAT="json", **site)
    assert json.loads(result.stderr)["event"] == "stored"
    quiet = run_sexpgpu(["--log-level", "warning", "mem", "put", "mem://b", "k", "v"], **site)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_console_format_masks_secrets_too(site: dict) -> None:
    result = run_sexpgpu(["--log-format", "console", "mem", "put", "mem://b", "k", "v"], **site)
    assert result.returncode == 0, result.stderr
    assert "stored" in result.stderr and "***" in result.stderr
    assert SECRET not in result.stderr
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.stderr.splitlines()[0])


@pytest.mark.parametrize(
    "key",
    [
        "aws_secret_access_key",
        "AWS_SECRET_ACCESS_KEY",
        "aws_session_token",
        "password",
        "api_key",
        "client_secret",
        "credentials",
    ],
)
def test_secret_keys_are_masked(captured: io.StringIO, key: str) -> None:
    log.get_logger("test").info("connecting", endpoint="http://127.0.0.1:9", **{key: "hunter2"})
    line = json.loads(captured.getvalue())
    assert line[key] == "***"
    assert line["endpoint"] == "http://127.0.0.1:9"
    assert "hunter2" not in captured.getvalue()


def test_counters_named_tokens_are_not_secrets(captured: io.StringIO) -> None:
    log.get_logger("test").info("progress", step=3, tokens=4096, tokens_per_s=1500.0)
    line = json.loads(captured.getvalue())
    assert (line["tokens"], line["tokens_per_s"]) == (4096, 1500.0)


def test_secrets_inside_logged_mappings_are_masked(captured: io.StringIO) -> None:
    log.get_logger("test").info(
        "client", config={"region": "x", "aws_secret_access_key": "hunter2"}
    )
    assert "hunter2" not in captured.getvalue()

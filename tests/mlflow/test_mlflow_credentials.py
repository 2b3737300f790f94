"""A password in ``MLFLOW_TRACKING_URI`` (``http://user:password@host``) is shown nowhere.

`sexpgpu run` and `sexpgpu evaluate` report through all three sinks (jsonl,
tensorboard, mlflow) with the password in the tracking URI: to a real `mlflow
server` on 127.0.0.1 (tests/mlflow/server.py), to a port where nothing listens (so
each failed write is a warning), and to a URI MLflow cannot take (an error). Their
stdout and stderr (log lines, warnings, the error line, the closing summary) and
every file they wrote (``events.jsonl``, ``status.json``, the TensorBoard event
files, the checkpoints) are searched for the password.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import experiments, run_sexpgpu, sexpgpu_env
from tests.mlflow.server import QUIET
from tests.servers import LOOPBACK, free_port

SMALL = Path(__file__).parents[1] / "report" / "small.sx"
PASSWORD = "pw-s3cret-quokka"
AT_PASSWORD = "pw-s3cret@quokka"  # an `@` the URL does not percent-encode
NEEDLES = ("s3cret", "quokka")  # no hex digit pair: never part of an id or a slug
SINKS = ("--metrics-sink", "jsonl", "--metrics-sink", "tensorboard", "--metrics-sink", "mlflow")


def _env(uri: str, log_format: str = "json") -> dict[str, str]:
    return sexpgpu_env(MLFLOW_TRACKING_URI=uri, SEXPGPU_LOG_FORMAT=log_format, **QUIET)


def _assert_shown_nowhere(workdir: Path, *results) -> None:  # type: ignore[no-untyped-def]
    """No part of the password in the commands' stdout and stderr, nor in any file
    under ``workdir``."""
    for result in results:
        for needle in NEEDLES:
            assert needle not in result.stdout, result.stdout
            assert needle not in result.stderr, result.stderr
    for path in workdir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            leaked = [n for n in NEEDLES if n.encode() in data]
            assert not leaked, f"{path.relative_to(workdir)} holds {leaked}"


def _wrote_every_sink(workdir: Path) -> None:
    # the search above covered what each sink writes, not an empty folder
    (folder,) = experiments(workdir / "m")
    assert (folder / "events.jsonl").stat().st_size > 0
    assert (folder / "status.json").is_file()
    assert list((folder / "tensorboard").glob("events.out.tfevents.*"))


def _logged(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_a_password_in_the_tracking_uri_is_not_shown_by_a_run_the_server_takes(
    mlflow_server, tmp_path
):
    uri = f"http://sx-user:{PASSWORD}@{LOOPBACK}:{mlflow_server.port}"
    # an experiment of this test's own on the shared server (tests/mlflow/server.py)
    program = tmp_path / "credentials.sx"
    program.write_text(SMALL.read_text().replace("(defrun small", "(defrun credentials", 1))
    run = run_sexpgpu(
        "run", program, "--steps", "20", "--checkpoint-dir", "ck", "--metrics-dir", "m", *SINKS,
        cwd=tmp_path, env=_env(uri),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    evaluate = run_sexpgpu(
        "evaluate", "ck/step-00000010", "--metrics-dir", "m", *SINKS, cwd=tmp_path, env=_env(uri)
    )
    assert evaluate.returncode == 0, evaluate.stderr
    # both found the server through that URI, and say which server, without the password
    for result in (run, evaluate):
        (line,) = [e for e in _logged(result.stderr) if e["event"] == "mlflow run"]
        assert line["tracking_uri"] == f"http://***@{LOOPBACK}:{mlflow_server.port}"
    (mlflow_run,) = mlflow_server.runs("credentials")
    assert len(mlflow_server.history(mlflow_run["info"]["run_id"], "loss")) == 20
    _wrote_every_sink(tmp_path)
    _assert_shown_nowhere(tmp_path, run, evaluate)
    stored = json.dumps(mlflow_run)  # its params, tags and note
    assert not [n for n in NEEDLES if n in stored], stored


@pytest.mark.parametrize(("password", "log_format"), [(PASSWORD, "json"), (AT_PASSWORD, "console")])
def test_a_password_in_the_tracking_uri_is_not_shown_when_the_server_is_unreachable(
    tmp_path, password, log_format
):
    uri = f"http://sx-user:{password}@{LOOPBACK}:{free_port()}"  # nothing listens there
    wait = ("--metrics-wait", "1")  # the end gives up on the sink at once
    run = run_sexpgpu(
        "run", SMALL, "--steps", "10", "--checkpoint-dir", "ck", "--metrics-dir", "m", *SINKS,
        *wait, cwd=tmp_path, env=_env(uri, log_format),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # every failed write is a warning naming the server, the closing summary counts
    assert "metrics sink write failed; retrying" in run.stderr, run.stderr
    assert f"API request to http://***@{LOOPBACK}:" in run.stderr, run.stderr
    assert "metrics events not delivered" in run.stderr, run.stderr
    assert "undelivered_by_sink" in run.stderr, run.stderr
    # evaluate: the same warnings, and its error when the points never get through
    evaluate = run_sexpgpu(
        "evaluate", "ck/step-00000010", "--metrics-dir", "m", *SINKS, "--settle", "1", *wait,
        cwd=tmp_path, env=_env(uri, log_format),
    )  # fmt: skip
    assert evaluate.returncode == 1, evaluate.stderr
    assert "E-EVAL-004" in evaluate.stderr.splitlines()[-1], evaluate.stderr
    assert f"API request to http://***@{LOOPBACK}:" in evaluate.stderr, evaluate.stderr
    _wrote_every_sink(tmp_path)
    _assert_shown_nowhere(tmp_path, run, evaluate)


@pytest.mark.parametrize(
    "uri",
    [f"foo://sx-user:{PASSWORD}@{LOOPBACK}:5000", f"sx-user:{PASSWORD}@{LOOPBACK}:5000"],
    ids=["unknown-scheme", "no-scheme"],
)
def test_a_tracking_uri_mlflow_cannot_take_is_one_line_without_the_password(tmp_path, uri):
    run = run_sexpgpu(
        "run", SMALL, "--steps", "10", "--checkpoint-dir", "ck", "--metrics-dir", "m", *SINKS,
        cwd=tmp_path, env=_env(uri),
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    shown = uri.replace(f"sx-user:{PASSWORD}", "***")
    assert run.stderr.splitlines()[-1].startswith(
        f"sexpgpu run: the metrics sink 'mlflow' cannot be opened: MLFLOW_TRACKING_URI={shown}: "
    ), run.stderr
    _assert_shown_nowhere(tmp_path, run)

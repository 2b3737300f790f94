"""A real `mlflow server` on 127.0.0.1 for the MLflow tests, read back through its REST API.

The server keeps its runs in a temporary sqlite file and runs in its own process
group, stopped (and started again, on the same port) by its PID. The test process
never imports mlflow (its client would leave threads behind): `sexpgpu`
subprocesses write, ``urllib`` reads.

``mlflow_server`` is package-scoped (``tests/mlflow/conftest.py``): the MLflow tests
share one server, started once (some 8 s of CPU), and run on one worker one after
another. Each test reports into experiments of its own names (the ``.sx`` run's
name is the experiment), so no test reads another's runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import LOOPBACK, _wait_for_port, free_port

QUIET = {
    # nothing leaves the machine, and the server runs no background job workers
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}
"""The environment of the server and of every `sexpgpu` that reports to it."""


@dataclass
class MlflowServer:
    """`mlflow server` in its own process group, stopped and started again on one port."""

    folder: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        """Start the server and return once it takes connections."""
        argv = [
            str(Path(sys.executable).parent / "mlflow"), "server",
            "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
            "--artifacts-destination", str(self.folder / "artifacts"),
            "--host", LOOPBACK, "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        with open(self.folder / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **QUIET}, start_new_session=True,
            )  # fmt: skip
        _wait_for_port(self.port, self.process, "mlflow server", limit=120)

    def stop(self) -> None:
        """SIGTERM to its process group (the server and its uvicorn worker), SIGKILL after 10 s."""
        if self.process is None:
            return
        for signum, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # a worker left behind
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None

    def api(self, path: str, body: dict | None = None, **query: str) -> dict:
        """A call to the REST API (``runs/search``, ``metrics/get-history``...)."""
        url = f"{self.url}/api/2.0/mlflow/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def experiment_names(self) -> list[str]:
        """Every experiment's name, the default one included."""
        found = self.api("experiments/search", {"max_results": 1000, "view_type": "ALL"})
        return sorted(e["name"] for e in found.get("experiments", []))

    def runs(self, experiment: str) -> list[dict]:
        """Every run of the experiment named ``experiment``, deleted ones included."""
        found = self.api("experiments/get-by-name", experiment_name=experiment)
        ident = found["experiment"]["experiment_id"]
        return self.api("runs/search", {"experiment_ids": [ident], "run_view_type": "ALL"}).get(
            "runs", []
        )

    def history(self, run_id: str, key: str) -> list[dict]:
        """Every value logged for metric ``key`` of the run."""
        got = self.api("metrics/get-history", run_id=run_id, metric_key=key, max_results="100000")
        return got.get("metrics", [])


def tags(run: dict) -> dict[str, str]:
    """A run's tags (from :meth:`MlflowServer.runs`) as a dict."""
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


@pytest.fixture(scope="package")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A running MLflow server for the MLflow tests, stopped after the last."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()

"""The MLflow sink against a real `mlflow server` on 127.0.0.1 (tests/mlflow/server.py),
read back through MLflow's REST API: a run, the server going down under it and
coming back, the run stopped by SIGTERM and resumed into the same MLflow run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, events, experiments, run_sexpgpu, sexpgpu_env, start_sexpgpu
from tests.mlflow.server import QUIET
from tests.mlflow.server import tags as _tags

SMALL = Path(__file__).parents[1] / "report" / "small.sx"


def _wait(what: str, check, proc: subprocess.Popen | None = None, limit: float = 120):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"sexpgpu ended first: {proc.communicate()}")
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {limit} s")


def _loss_steps(folder: Path) -> list[int]:
    return [e["step"] for e in events(folder) if e.get("name") == "loss"]


@pytest.mark.slow  # an mlflow server started twice: about 30 s
def test_down_mid_run_then_interrupted_and_resumed_into_one_mlflow_run(mlflow_server, tmp_path):
    env = sexpgpu_env(MLFLOW_TRACKING_URI=mlflow_server.url, **QUIET)
    args = ["--metrics-dir", "m", "--checkpoint-dir", "ck", "--metrics-sink", "jsonl",
            "--metrics-sink", "mlflow"]  # fmt: skip
    run = start_sexpgpu("run", SMALL, "--steps", "100000", "--set", "every=100000", *args,
                        cwd=tmp_path, env=env)  # fmt: skip
    try:

        def first_points() -> dict | None:
            runs = mlflow_server.runs("small")  # the .sx run's name is the experiment
            if runs and mlflow_server.history(runs[0]["info"]["run_id"], "loss"):
                return runs[0]
            return None

        mlflow_run = _wait("the run's first points in MLflow", first_points, run)
        run_id = mlflow_run["info"]["run_id"]
        (folder,) = experiments(tmp_path / "m")
        assert _tags(mlflow_run)["sexpgpu.slug"] == folder.name
        assert mlflow_run["info"]["status"] == "RUNNING"
        mlflow_server.stop()
        down_at = max(_loss_steps(folder))
        # the run goes on while nobody takes its points...
        _wait("steps while the server is down", lambda: max(_loss_steps(folder)) > down_at + 200,
              run)  # fmt: skip
        run.send_signal(signal.SIGTERM)  # ... and is stopped while it is still down
        mlflow_server.start()
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        if mlflow_server.process is None:  # the next test shares the server
            mlflow_server.start()
    assert run.returncode == 143, err
    assert "undelivered" not in err and "not delivered" not in err, err
    assert "View run" not in out + err  # mlflow's own print is kept off the output
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    said = {(e["event"], e.get("sink")) for e in logged}
    # the sink did find the server gone, and got through once it was back
    assert ("metrics sink write failed; retrying", "1:mlflow") in said
    assert ("metrics sink recovered", "1:mlflow") in said
    # every point of the JSONL file reached MLflow, once
    stopped_at = max(_loss_steps(folder))
    loss = mlflow_server.history(run_id, "loss")
    assert sorted(m["step"] for m in loss) == list(range(1, stopped_at + 1))
    (interrupted,) = mlflow_server.runs("small")
    assert interrupted["info"]["status"] == "KILLED"
    line = f"interrupted by SIGTERM at step {stopped_at}"
    assert any(text.startswith(line) for text in _tags(interrupted).values())

    resumed = run_sexpgpu("run", SMALL, "--steps", stopped_at + 20, *args, "--resume", "latest",
                          cwd=tmp_path, env=env)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    (finished,) = mlflow_server.runs("small")  # the same MLflow run, never a second one
    assert finished["info"]["run_id"] == run_id
    assert finished["info"]["status"] == "FINISHED"
    loss = mlflow_server.history(run_id, "loss")
    assert sorted(m["step"] for m in loss) == list(range(1, stopped_at + 21))
    evals = mlflow_server.history(run_id, "probe/accuracy")
    assert {m["step"] for m in evals} >= {10, 20}
    params = {p["key"]: p["value"] for p in finished["data"]["params"]}
    # a param keeps its first value; the resume's annotation says what moved
    assert params["knob.lr"] == "0.05" and params["knob.steps"] == "100000"
    assert params["choice.lowering"] == "torch"
    tags = _tags(finished)
    notes = tags["mlflow.note.content"].split("  \n")
    assert notes[0] == f"step {stopped_at}: interrupted by SIGTERM at step {stopped_at}"
    assert f"step {stopped_at}: resumed from ck/step-{stopped_at:08d}" in notes
    assert notes[-1] == f"step {stopped_at + 20}: done"
    resume_tags = [v for k, v in tags.items() if k.startswith(f"annotation.{stopped_at:08d}.")]
    assert any(v.startswith("resumed from ") and "steps" in v for v in resume_tags), resume_tags

    # a run that fails: its MLflow run says so, in an experiment of its own name
    failed = run_sexpgpu("run", EXAMPLES / "my-run.sx", "--set", "guard=true", "--set", "lr=1e39",
                         "--metrics-dir", "m", "--metrics-sink", "mlflow", cwd=tmp_path, env=env)  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    (broken,) = mlflow_server.runs("my-run")
    assert broken["info"]["status"] == "FAILED"
    assert any(t.startswith("failed: step 1: ") for t in _tags(broken).values())


WITHOUT_MLFLOW = """
import sys
sys.modules["mlflow"] = None
from sexpgpu.catalog import Catalog
from sexpgpu.errors import SexpError
from sexpgpu.metrics import open_sinks
try:
    open_sinks(["mlflow"], sys.argv[1], "exp", Catalog.load())
except SexpError as exc:
    print(exc)
"""


def test_without_mlflow_the_sink_names_the_install_hint(tmp_path):
    child = subprocess.run(
        [sys.executable, "-c", WITHOUT_MLFLOW, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.stdout.strip() == (
        "the metrics sink 'mlflow' needs the plugin 'mlflow', which is unavailable: "
        "mlflow is not installed: pip install 'sexpgpu[mlflow]'"
    ), child.stderr

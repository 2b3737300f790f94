"""`sexpgpu evaluate --metrics-sink mlflow` reports into the training run's own MLflow run,
against a real `mlflow server` on 127.0.0.1 (tests/mlflow/server.py).

The run is tests/report/small.sx saved as ``trainer.sx`` with its run renamed, so
the file's stem (the slug's) is not the run's name (the MLflow experiment's): its
probe pass runs at steps 10 and 20, its checkpoints are every 5 steps, so a point
at step 5 or 15 can only come from `evaluate`.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.helpers import events, experiments, run_sexpgpu, sexpgpu_env
from tests.mlflow.server import QUIET, MlflowServer, tags

SMALL = Path(__file__).parents[1] / "report" / "small.sx"
METRICS = ("probe/loss", "probe/accuracy")


def _train(workdir: Path, server: MlflowServer, run_name: str) -> dict:
    """Train ``trainer.sx`` (its run named ``run_name``) for 20 steps, checkpointing every
    5, reporting to JSONL and MLflow; returns its one MLflow run."""
    source = SMALL.read_text()
    assert "(defrun small\n" in source
    (workdir / "trainer.sx").write_text(source.replace("(defrun small\n", f"(defrun {run_name}\n"))
    result = run_sexpgpu(
        "run", "trainer.sx", "--steps", "20", "--set", "every=5", "--checkpoint-dir", "ck",
        "--metrics-dir", "m", "--metrics-sink", "jsonl", "--metrics-sink", "mlflow",
        cwd=workdir, env=_env(server),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (trained,) = server.runs(run_name)
    assert trained["info"]["status"] == "FINISHED"
    (folder,) = experiments(workdir / "m")
    assert tags(trained)["sexpgpu.slug"] == folder.name
    return trained


def _env(server: MlflowServer) -> dict[str, str]:
    return sexpgpu_env(MLFLOW_TRACKING_URI=server.url, **QUIET)


def _evaluate(workdir: Path, server: MlflowServer, step: int, *sinks: str, metrics_dir: str = "m"):
    args = [arg for sink in sinks for arg in ("--metrics-sink", sink)]
    result = run_sexpgpu(
        "evaluate", f"ck/step-{step:08d}", "--metrics-dir", metrics_dir, *args,
        cwd=workdir, env=_env(server),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"ck/step-{step:08d} probe: loss " in result.stdout
    return result


def _points(server: MlflowServer, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Each probe metric's (step, value) in the MLflow run, in step order."""
    found = {}
    for key in METRICS:
        found[key] = sorted((m["step"], float(m["value"])) for m in server.history(run_id, key))
    return found


def _evaluated(workdir: Path) -> dict[str, dict[int, float]]:
    """Each probe metric's value per step from the points `evaluate` wrote to JSONL."""
    (folder,) = experiments(workdir / "m")
    found: dict[str, dict[int, float]] = {key: {} for key in METRICS}
    for event in events(folder):
        if event.get("source") == "evaluate" and event.get("name") in found:
            found[event["name"]][event["step"]] = float(event["value"])
    return found


def test_evaluate_reports_into_the_run_s_mlflow_run_once(mlflow_server, tmp_path):
    trained = _train(tmp_path, mlflow_server, "evaluated")
    run_id = trained["info"]["run_id"]
    assert {k: [s for s, _ in v] for k, v in _points(mlflow_server, run_id).items()} == {
        key: [10, 20] for key in METRICS
    }
    experiments_before = mlflow_server.experiment_names()

    _evaluate(tmp_path, mlflow_server, 15, "jsonl", "mlflow")
    # the same MLflow run, nothing new beside it, the run's own points untouched
    (after,) = mlflow_server.runs("evaluated")
    assert after["info"]["run_id"] == run_id and after["info"]["status"] == "FINISHED"
    assert mlflow_server.experiment_names() == experiments_before
    evaluated = _evaluated(tmp_path)
    points = _points(mlflow_server, run_id)
    for key in METRICS:
        # the evaluation's values, at the checkpoint's step
        assert [s for s, _ in points[key]] == [10, 15, 20], key
        assert dict(points[key])[15] == evaluated[key][15], key

    # evaluated again (and the last checkpoint, whose pass the run made itself): the
    # same numbers at the same steps, which MLflow already holds, so no point twice
    _evaluate(tmp_path, mlflow_server, 15, "jsonl", "mlflow")
    _evaluate(tmp_path, mlflow_server, 20, "jsonl", "mlflow")
    (again,) = mlflow_server.runs("evaluated")
    assert again["info"]["run_id"] == run_id
    assert mlflow_server.experiment_names() == experiments_before
    assert _points(mlflow_server, run_id) == points
    # while the JSONL stream keeps every message, each with its own id
    (folder,) = experiments(tmp_path / "m")
    repeated = [e for e in events(folder) if e.get("evaluation") == "probe@15"]
    assert len(repeated) == 2 * len(METRICS)
    assert len({e["id"] for e in repeated}) == len(repeated)


def test_evaluate_without_the_run_s_status_file_finds_its_mlflow_run(mlflow_server, tmp_path):
    # evaluate on another machine, or into another --metrics-dir: no status.json says
    # the run's name, and the slug's stem is the file's (trainer), not the run's
    trained = _train(tmp_path, mlflow_server, "elsewhere")
    run_id = trained["info"]["run_id"]
    experiments_before = mlflow_server.experiment_names()

    result = _evaluate(tmp_path, mlflow_server, 5, "mlflow", metrics_dir="other")
    assert '"found": true' in result.stderr, result.stderr
    assert mlflow_server.experiment_names() == experiments_before  # no experiment "trainer"
    (after,) = mlflow_server.runs("elsewhere")
    assert after["info"]["run_id"] == run_id and after["info"]["status"] == "FINISHED"
    points = _points(mlflow_server, run_id)
    assert {k: [s for s, _ in v] for k, v in points.items()} == {
        key: [5, 10, 20] for key in METRICS
    }

    _evaluate(tmp_path, mlflow_server, 5, "mlflow", metrics_dir="other")
    assert [r["info"]["run_id"] for r in mlflow_server.runs("elsewhere")] == [run_id]
    assert mlflow_server.experiment_names() == experiments_before
    assert _points(mlflow_server, run_id) == points

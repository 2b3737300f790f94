"""The MLflow tests' server: ``mlflow_server``, one per test module (tests/mlflow/server.py)."""

from tests.mlflow.server import mlflow_server  # noqa: F401

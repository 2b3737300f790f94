"""The MLflow tests' server: ``mlflow_server``, one for the package's tests (tests/mlflow/server.py)."""

from tests.mlflow.server import mlflow_server  # noqa: F401

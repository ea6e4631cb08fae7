"""The MLflow client of the track stage and the history reads, for the server of MLFLOW_TRACKING_URI (the local stack
exports it to every worker). Its users call `mlflow_client` through this module at call time, so a test swaps it here.
"""

from __future__ import annotations


def mlflow_client():
    """A new MlflowClient. MLflow is imported here, not with this module (see `preload`)."""
    from mlflow import MlflowClient

    return MlflowClient()


def preload() -> None:
    """Import the MLflow client now. It is imported where it is used, not with this module: 2-3 s of imports that
    an evaluation flow would otherwise pay before its shards start; the flow calls this while they run instead."""
    import mlflow.entities  # noqa: F401
    import mlflow.tracking  # noqa: F401


__all__ = ["mlflow_client", "preload"]

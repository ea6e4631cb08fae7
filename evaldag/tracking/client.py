"""The MLflow client of the track stage and the history reads, for the server of MLFLOW_TRACKING_URI (the local stack
exports it to every worker). Its users call `mlflow_client` through this module at call time, so a test swaps it here.
"""

from __future__ import annotations


def mlflow_client():
    """A new MlflowClient. MLflow is imported here, not with this module (see `preload`)."""
    from mlflow import MlflowClient

    return MlflowClient()


# Runs per search request: MLflow's servers take at most 50,000 (and page by offset, so fewer, larger pages leave
# less room for a run deleted mid-read to shift one past a page boundary).
PAGE = 50_000


def all_runs(client, experiment_ids: list[str], **search) -> list:
    """Every run `client.search_runs(experiment_ids, **search)` finds, page after page: one search returns at most
    a page, and a long-lived deployment (a sweeper over years of checkpoints) has more finished runs than that."""
    runs, token, seen = [], None, set()
    while True:
        page = client.search_runs(experiment_ids, max_results=PAGE, page_token=token, **search)
        runs.extend(page)
        token = getattr(page, "token", None)
        if not token or not page or token in seen:   # the last page (a store that repeats a token: stop too)
            return runs
        seen.add(token)


def preload() -> None:
    """Import what the track stage uses now: the MLflow client and matplotlib (the job's plots). Both are imported
    where they are used, not with this module: 1-3 s of imports that an evaluation flow would otherwise pay before
    its shards start, or after they end; the flow calls this while they run instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import mlflow.entities  # noqa: F401
    import mlflow.tracking  # noqa: F401

    import evaldag.decisions.forecast  # noqa: F401


__all__ = ["PAGE", "all_runs", "mlflow_client", "preload"]

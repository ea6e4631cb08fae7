"""The track stage: one MLflow run per (checkpoint, benchmark), found again by its eval_key.

Logging the same evaluation twice returns the existing finished run instead of creating a second one. The tracking
server comes from MLFLOW_TRACKING_URI (the local stack exports it to every worker).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from mlflow.entities import Metric, Param

from evaldag.plan import EvalPlan

EXPERIMENT_PREFIX = "evaldag"


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    experiment_id: str
    created: bool           # False when an earlier finished run with the same eval_key was found
    url: str | None         # link into the MLflow UI when the tracking URI is an http server


def experiment_name(benchmark: str) -> str:
    """One experiment per benchmark family, e.g. evaldag-math500."""
    return f"{EXPERIMENT_PREFIX}-{benchmark}"


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def find_run(client, experiment_id: str, eval_key: str):
    """The newest run of the experiment tagged with `eval_key`, or None."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.eval_key = '{eval_key}'",
                              order_by=["attributes.start_time DESC"], max_results=5)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    return (finished or runs or [None])[0]


def track(plan: EvalPlan, metrics: dict, flow_run_id: str | None = None) -> TrackedRun:
    """Log params, tags, metrics at step and the per-sample parquet; get-or-create by eval_key."""
    client = _client()
    name = experiment_name(plan.benchmark.name)
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(name, tags={"evaldag.benchmark": name})
    existing = find_run(client, exp_id, plan.eval_key)
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if existing is not None and existing.info.status == "FINISHED":
        return TrackedRun(existing.info.run_id, exp_id, False, _url(uri, exp_id, existing.info.run_id))
    model = plan.resolved_model
    step = plan.request.step
    tags = {
        "eval_key": plan.eval_key,
        "benchmark": plan.benchmark.name,
        "model": model.name,
        "checkpoint": model.path,
        "step": f"{step:012d}",        # zero-padded: MLflow compares tags as strings
        "dataset_hash": plan.dataset_hash,
        "prefect.flow_run_id": flow_run_id or "",
        "kind": "ckpt_eval",
    }
    if existing is not None:           # an earlier attempt died while logging: finish that run instead
        run_id = existing.info.run_id
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
    else:
        run_id = client.create_run(exp_id, run_name=f"{model.name}@{step}", tags=tags).info.run_id
    params = {
        "model": model.name, "checkpoint": model.path, "model_fingerprint": model.fingerprint[:16],
        "engine": model.engine, "dtype": model.dtype, "batch_size": model.batch_size,
        "num_shards": plan.num_shards, "n_problems": plan.n_problems, "limit": plan.request.limit,
        "dataset_source": plan.dataset_source, "gold_format": plan.benchmark.gold_format,
        "pipeline_version": plan.pipeline_version, "grader_version": plan.grader_version,
        **{f"sampling.{k}": v for k, v in plan.sampling.model_dump().items()},
    }
    # MLflow refuses to overwrite a param, so a resumed run logs only the params it does not have yet.
    logged = set(existing.data.params) if existing is not None else set()
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, step) for k, v in {**metrics, "step": step}.items()],
        params=[Param(k, str(v)) for k, v in params.items() if k not in logged],
    )
    client.log_artifact(run_id, str(plan.path("samples.parquet")), artifact_path="samples")
    client.log_artifact(run_id, str(plan.path("plan.json")), artifact_path="config")
    client.log_artifact(run_id, str(plan.path("metrics.json")), artifact_path="config")
    client.set_terminated(run_id, "FINISHED")
    return TrackedRun(run_id, exp_id, True, _url(uri, exp_id, run_id))


def _url(uri: str, exp_id: str, run_id: str) -> str | None:
    if uri.startswith("http"):
        return f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
    return None


def load_samples(run_id: str):
    """Download and read a run's per-sample parquet (for tools and tests)."""
    import mlflow
    import polars as pl

    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples/samples.parquet")
    return pl.read_parquet(local)


__all__ = ["track", "TrackedRun", "experiment_name", "find_run", "load_samples"]

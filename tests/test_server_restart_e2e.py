"""Servers restarted mid-evaluation: the Prefect server is killed (kill -9) and started again while a shard
generates, then the MLflow server, while the same shard generates its next batch. The evaluation must complete,
with the shard run it started (no relaunch), every sample exactly once, and one MLflow run."""

from __future__ import annotations

import json
import time

import psutil
import pytest
from mlflow import MlflowClient

from cluster_helpers import NewGenerations, children, kill_all, wait_final
from evaldag.runtime.stack import MLFLOW_SERVER, PREFECT_SERVER
from evaldag.tracking.names import experiment_name
from evaldag.tracking.samples import load_samples

pytestmark = [pytest.mark.stack, pytest.mark.model]


def _restart(stack, component: str) -> float:
    """kill -9 one server, start it again the way a user would (`evaldag up`); returns the seconds it was away."""
    [row] = [r for r in stack.status() if r.component == component]
    proc = psutil.Process(row.pid)
    kill_all([proc, *proc.children(recursive=True)])
    t0 = time.time()
    time.sleep(3)                                               # an outage, not just a blip
    report = stack.up(deploy=False)
    assert report.started == [component], report
    return time.time() - t0


def test_prefect_then_mlflow_restart_while_a_shard_generates(live_stack):
    from prefect.deployments import run_deployment

    from evaldag.request.checkpoint import resolve_model

    folder = resolve_model("smollm2-135m-instruct").path        # a plain folder: batch size 32 -> 4 prompts x n=8
    generations = NewGenerations(live_stack)
    fr = run_deployment("eval/math500", timeout=0, parameters={
        "checkpoint": folder, "limit": 12, "num_shards": 1, "step": 55, "train_run": "restarts",
        "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 32, "seed": 6}})
    chunk = generations.chunk
    first = generations.wait(0)
    [shard] = children(fr.id)
    # each server dies while the shard is still generating: its next batch is not written yet, the run not final
    assert chunk(1) is None and not shard.state.is_final(), shard.state
    prefect_away = _restart(live_stack, PREFECT_SERVER)
    [shard] = children(fr.id)
    assert not shard.state.is_final(), shard.state            # the shard lived through it
    generations.wait(1)
    assert chunk(2) is None and not children(fr.id)[0].state.is_final()
    mlflow_away = _restart(live_stack, MLFLOW_SERVER)

    state = wait_final(fr.id, timeout=600)
    assert state.is_completed(), state.message
    shards = children(fr.id)
    assert [s.state.type.value for s in shards] == ["COMPLETED"], [s.state for s in shards]   # never relaunched
    print("restart outages:", json.dumps({"prefect_s": round(prefect_away, 1), "mlflow_s": round(mlflow_away, 1)}))
    stats = json.loads(next(first.parent.parent.glob("stats-generations-*.json")).read_text())
    assert stats["resumed_batches"] == 0                       # one uninterrupted generation

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'restarts'")
    samples = load_samples(run.info.run_id)
    assert samples.height == 96 and run.data.metrics["n_samples"] == 96
    assert samples.select("sample_id", "sample_index").n_unique() == 96

"""Faults against the real stack: the MLflow server is down while an evaluation tracks its results."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
from prefect.deployments import run_deployment

from evaldag.stack import MLFLOW_SERVER
from evaldag.tracking import experiment_name

pytestmark = [pytest.mark.stack, pytest.mark.model]


def _track_attempts(flow_run_id) -> list:
    async def go():
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="track")))
            return runs
    return asyncio.run(go())


def _state(flow_run_id):
    async def go():
        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).state
    return asyncio.run(go())


def _wait(predicate, timeout=600.0, every=1.0):
    end = time.time() + timeout
    while time.time() < end:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def test_mlflow_down_during_tracking_then_back_and_sync(live_stack):
    [mlflow_server] = [s for s in live_stack.status() if s.component == MLFLOW_SERVER]
    psutil.Process(mlflow_server.pid).terminate()
    _wait(lambda: not any(s.healthy for s in live_stack.status() if s.component == MLFLOW_SERVER), 60)

    fr = run_deployment("eval/math500", timeout=0, parameters={
        "limit": 2, "num_shards": 1, "step": 77, "train_run": "mlflow-outage", "sampling": {"max_new_tokens": 16}})
    # the results are computed; tracking fails while the server is away and is retried with backoff
    _wait(lambda: any(t.run_count >= 1 and t.state and t.state.name in ("AwaitingRetry", "Retrying", "Scheduled")
                      for t in _track_attempts(fr.id)), timeout=600)
    live_stack.up(deploy=False)                                   # the MLflow server comes back
    state = _wait(lambda: (s := _state(fr.id)) and s.is_final() and s, timeout=600)
    assert state.is_completed(), state.message
    assert max(t.run_count for t in _track_attempts(fr.id)) >= 2  # it really failed first and was retried

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'mlflow-outage'")
    assert run.data.metrics["n_samples"] == 2

    # a run lost from MLflow altogether comes back from the result store with `evaldag sync`
    client.delete_run(run.info.run_id)
    evaldag = str(Path(sys.executable).with_name("evaldag"))
    proc = subprocess.run([evaldag, "sync"], capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [again] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'mlflow-outage'")
    assert again.info.run_id != run.info.run_id and again.data.metrics["n_samples"] == 2


def _children(parent_id) -> list:
    from prefect.client.schemas.filters import FlowRunFilterParentFlowRunId

    async def go():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    return asyncio.run(go())


def test_shard_killed_mid_generation_resumes_with_exact_rows(live_stack):
    """kill -9 of a shard's flow-run process after its first batch: the shard is relaunched, regenerates only the
    missing batches, and the evaluation ends with exactly one row per (problem, sample)."""
    from evaldag.models import resolve_model
    from evaldag.tracking import load_samples

    folder = resolve_model("smollm2-135m-instruct").path        # a plain folder: batch size 32 -> 4 prompts x n=8
    results = Path(live_stack.home) / "results" / "math500"
    before = set(results.glob("gen-*"))
    fr = run_deployment("eval/math500", timeout=0, parameters={
        "checkpoint": folder, "limit": 12, "num_shards": 1, "step": 88, "train_run": "kill-9",
        "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 48, "seed": 3}})
    chunk = _wait(lambda: next((c for g in set(results.glob("gen-*")) - before
                                for c in g.glob("*.chunks/batch-00000-*.parquet")), None), timeout=600, every=0.2)
    [shard] = _children(fr.id)
    victims = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") == str(shard.id):
                victims.append(p)
        except psutil.Error:
            continue
    assert victims, "the shard's flow-run process was not found"
    for p in victims:
        p.kill()                                                   # SIGKILL: no cleanup, like a lost node
    state = _wait(lambda: (s := _state(fr.id)) and s.is_final() and s, timeout=900)
    assert state.is_completed(), state.message
    shards = _children(fr.id)
    states = sorted(s.state.type.value for s in shards)
    assert len(shards) == 2 and states[0] == "COMPLETED" and states[1] in ("CRASHED", "FAILED"), states

    stage_dir = chunk.parent.parent
    stats = json.loads(next(stage_dir.glob("stats-generations-*.json")).read_text())
    assert stats["resumed_batches"] >= 1                           # the first batch was not generated again
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'kill-9'")
    samples = load_samples(run.info.run_id)
    assert samples.height == 96 and run.data.metrics["n_samples"] == 96
    assert samples.select("sample_id", "sample_index").n_unique() == 96
    assert samples.group_by("sample_id").len()["len"].to_list() == [8] * 12

"""A lost node against the real stack: the gpu worker and its shard's flow-run process die together (kill -9), so
nothing is left to report the crash. The head's heartbeat automation must set the run Crashed, the parent must
relaunch the shard on a live worker (here a fresh one, as `evaldag up` starts it), and the relaunched shard must
resume from the batches already written. The timings of each step are printed (run with -s to see them)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from evaldag.cluster import CRASH_AUTOMATION
from evaldag.tracking import experiment_name
from cluster_helpers import children, flow_run, flow_run_processes, kill_all, state_history, wait, wait_final

pytestmark = [pytest.mark.stack, pytest.mark.model]

GPU_WORKER = "gpu-worker-0"


def _ts(value) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value)


def test_lost_worker_and_shard_are_crashed_relaunched_and_resumed(live_stack):
    from prefect.deployments import run_deployment

    from evaldag.models import resolve_model

    folder = resolve_model("smollm2-135m-instruct").path        # a plain folder: batch size 32 -> 4 prompts x n=8
    results = Path(live_stack.home) / "results" / "math500"
    before = set(results.glob("gen-*"))
    fr = run_deployment("eval/math500", timeout=0, parameters={
        "checkpoint": folder, "limit": 8, "num_shards": 1, "step": 66, "train_run": "lost-node",
        "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 32, "seed": 4}})
    chunk = wait(lambda: next((c for g in set(results.glob("gen-*")) - before
                               for c in g.glob("*.chunks/batch-00000-*.parquet")), None), timeout=600, every=0.2)
    [shard] = children(fr.id)

    # the node is lost: its worker and the shard's process die at once, without a word to the server
    [worker] = [r for r in live_stack.status() if r.component == GPU_WORKER]
    victims = [psutil.Process(worker.pid), *flow_run_processes(shard.id)]
    assert len(victims) >= 2, "the shard's flow-run process was not found"
    kill_all(victims)
    t_loss = time.time()

    report = live_stack.up(deploy=False)                      # what a user does: a fresh worker on a live node
    assert report.started == [GPU_WORKER]

    crashed = wait(lambda: (s := flow_run(shard.id).state) and s.is_final() and s, timeout=300, every=2)
    assert crashed.type.value == "CRASHED", crashed
    assert CRASH_AUTOMATION in (crashed.message or ""), crashed.message     # our automation, not the worker
    state = wait_final(fr.id, timeout=600)
    assert state.is_completed(), state.message

    runs = sorted(children(fr.id), key=lambda r: _ts(r.created))
    assert [r.state.type.value for r in runs] == ["CRASHED", "COMPLETED"], [r.state for r in runs]
    t_crashed = _ts(crashed.timestamp)
    t_relaunch = _ts(runs[1].created)
    t_running = min(_ts(s.timestamp) for s in state_history(runs[1].id) if s.type.value == "RUNNING")
    t_done = _ts(flow_run(fr.id).state.timestamp)
    figures = {"loss_to_crashed_s": round(t_crashed - t_loss, 1), "loss_to_relaunch_s": round(t_relaunch - t_loss, 1),
               "loss_to_relaunch_running_s": round(t_running - t_loss, 1),
               "loss_to_completed_s": round(t_done - t_loss, 1)}
    print("lost-node timings:", json.dumps(figures))
    assert figures["loss_to_crashed_s"] < 150, figures       # heartbeat every 30 s, crashed after 90 s of silence

    stats = json.loads(next(chunk.parent.parent.glob("stats-generations-*.json")).read_text())
    assert stats["resumed_batches"] >= 1                      # the batch written before the loss was kept
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'lost-node'")
    from evaldag.tracking import load_samples

    samples = load_samples(run.info.run_id)
    assert samples.height == 64 and run.data.metrics["n_samples"] == 64          # none lost
    assert samples.select("sample_id", "sample_index").n_unique() == 64           # none doubled

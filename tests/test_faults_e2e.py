"""Faults against the real stack: the MLflow server down or hung while an evaluation tracks its results, a shard
killed mid-generation, injected transient errors, two identical evaluations at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
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

from cluster_helpers import (NewGenerations, alive, children, engine_processes, flow_run, flow_run_processes,
                             kill_all, wait)
from conftest import TEST_MLFLOW_TIMEOUT_S
from evaldag.runtime.stack import MLFLOW_SERVER
from evaldag.runtime.stack.components import MLFLOW_RETRIES
from evaldag.tracking.names import experiment_name

pytestmark = [pytest.mark.stack, pytest.mark.model]


def _track_attempts(flow_run_id) -> list:
    async def go():
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="track")))
            return runs
    return asyncio.run(go())




def test_mlflow_down_during_tracking_then_back_and_sync(live_stack):
    [mlflow_server] = [s for s in live_stack.status() if s.component == MLFLOW_SERVER]
    psutil.Process(mlflow_server.pid).terminate()
    wait(lambda: not any(s.healthy for s in live_stack.status() if s.component == MLFLOW_SERVER), 60)

    fr = run_deployment("eval/math500", timeout=0, parameters={
        "limit": 2, "num_shards": 1, "step": 77, "train_run": "mlflow-outage", "sampling": {"max_new_tokens": 16}})
    # the results are computed; tracking fails while the server is away and is retried with backoff
    wait(lambda: any(t.run_count >= 1 and t.state and t.state.name in ("AwaitingRetry", "Retrying", "Scheduled")
                      for t in _track_attempts(fr.id)), timeout=600)
    live_stack.up(deploy=False)                                   # the MLflow server comes back
    state = wait(lambda: (s := flow_run(fr.id).state) and s.is_final() and s, timeout=600)
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


# A hung MLflow server must cost a track attempt at most about (1 + retries) request timeouts: the stack gives MLflow's
# client a request timeout (30 s in production, TEST_MLFLOW_TIMEOUT_S here) and 2 retries. MLflow's own defaults
# (120 s, 7 retries) would hold the parent flow run for about 16 minutes per attempt.
HUNG_ATTEMPT_MAX_S = (1 + MLFLOW_RETRIES) * TEST_MLFLOW_TIMEOUT_S + 60


def _track_states(task_run_id) -> list:
    async def go():
        async with get_client() as client:
            return await client.read_task_run_states(task_run_id)
    return asyncio.run(go())


def test_mlflow_hung_during_tracking_gives_up_promptly_then_retries(live_stack):
    """SIGSTOP, not SIGTERM: the server's socket still accepts connections and nothing answers, the way a wedged
    server or a dead network path looks. The track attempt must give up on a timeout within HUNG_ATTEMPT_MAX_S,
    and the retry after the server resumes must log the evaluation once."""
    [mlflow_server] = [s for s in live_stack.status() if s.component == MLFLOW_SERVER]
    group = os.getpgid(mlflow_server.pid)        # the server leads its own group (its uvicorn worker is in it)
    os.killpg(group, signal.SIGSTOP)
    try:
        fr = run_deployment("eval/math500", timeout=0, parameters={
            "limit": 2, "num_shards": 1, "step": 78, "train_run": "mlflow-hung", "sampling": {"max_new_tokens": 16}})
        [track] = wait(lambda: [t for t in _track_attempts(fr.id) if t.state and t.state.name == "Running"],
                        timeout=600)
        started = time.monotonic()
        wait(lambda: any(t.run_count >= 1 and t.state and t.state.name in ("AwaitingRetry", "Retrying", "Scheduled")
                          for t in _track_attempts(fr.id)), timeout=HUNG_ATTEMPT_MAX_S + 30)
        print(f"a hung MLflow server cost the track attempt about {time.monotonic() - started:.0f} s")
    finally:
        os.killpg(group, signal.SIGCONT)
    states = _track_states(track.id)
    running = next(s for s in states if s.name == "Running")
    failed = next(s for s in states if s.name in ("AwaitingRetry", "Retrying") and s.timestamp > running.timestamp)
    attempt_s = (failed.timestamp - running.timestamp).total_seconds()
    # at least one request timeout: the client waited on a silent server (a refused connection fails in a second)
    assert TEST_MLFLOW_TIMEOUT_S <= attempt_s < HUNG_ATTEMPT_MAX_S, attempt_s
    state = wait(lambda: (s := flow_run(fr.id).state) and s.is_final() and s, timeout=600)
    assert state.is_completed(), state.message
    assert max(t.run_count for t in _track_attempts(fr.id)) >= 2
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'mlflow-hung'")
    assert run.info.status == "FINISHED" and run.data.metrics["n_samples"] == 2



def test_shard_killed_mid_generation_resumes_with_exact_rows(live_stack):
    """kill -9 of a shard's flow-run process after its first batch: the shard is relaunched, regenerates only the
    missing batches, and the evaluation ends with exactly one row per (problem, sample).

    Two GPU slots, as on a node with a second GPU free: the relaunch starts at once. On a one-GPU node it waits for
    the killed run's slot lease to expire (evaldag.request.gpus.GPU_LEASE_S, 60 s, Prefect's minimum: nothing else can
    release it, since Prefect's API does not list a limit's holders), 0-60 s by chance, which made this test's time
    vary from 65 to 136 s without proving anything more."""
    from evaldag.request.checkpoint import resolve_model
    from evaldag.tracking.samples import load_samples

    # a plain folder: batch size 32 -> 4 prompts x n=8. GSM8K: its first 8 prompts are 74-158 tokens, where
    # MATH-500's run to 449, and the transformers engine pads a batch to its longest prompt, n times over
    folder = resolve_model("smollm2-135m-instruct").path
    generations = NewGenerations(live_stack, "gsm8k")
    with _two_gpu_slots(live_stack):
        fr = run_deployment("eval/gsm8k", timeout=0, parameters={
            "checkpoint": folder, "limit": 8, "num_shards": 1, "step": 88, "train_run": "kill-9",
            "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 32, "seed": 3}})
        chunk = generations.wait(0)
        [shard] = children(fr.id)
        victims = flow_run_processes(shard.id)
        generating = engine_processes(victims)
        assert generating, f"the shard's generating process was not found among {victims}"
        assert not flow_run(shard.id).state.is_final()                         # killed mid-generation, not after
        kill_all(victims)                                              # SIGKILL: no cleanup, like a lost node
        assert not any(alive(p) for p in generating), "the generating process outlived the kill"
        assert not any(alive(p) for p in flow_run_processes(shard.id))  # nothing of the shard is left to write rows
        state = wait(lambda: (s := flow_run(fr.id).state) and s.is_final() and s, timeout=900)
    assert state.is_completed(), state.message
    shards = children(fr.id)
    states = sorted(s.state.type.value for s in shards)
    assert len(shards) == 2 and states[0] == "COMPLETED" and states[1] in ("CRASHED", "FAILED"), states

    stage_dir = chunk.parent.parent
    stats = json.loads(next(stage_dir.glob("stats-generations-*.json")).read_text())
    assert stats["resumed_batches"] >= 1                           # the first batch was not generated again
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'kill-9'")
    samples = load_samples(run.info.run_id)
    assert samples.height == 64 and run.data.metrics["n_samples"] == 64
    assert samples.select("sample_id", "sample_index").n_unique() == 64
    assert samples.group_by("sample_id").len()["len"].to_list() == [8] * 8


def test_live_runs_crashed_by_the_lost_run_automation_recover(live_stack):
    """What a clock step or a pause of the head does: the lost-run automation crashes an evaluation and its shard
    while both still run. The evaluation sets itself Running again and completes; the shard's process stops (its
    parent relaunches it, which resumes from the batches already written); every sample is there exactly once."""
    from prefect.states import Crashed

    from evaldag.runtime.cluster import MIN_HEARTBEAT_S, crash_automation
    from evaldag.request.checkpoint import resolve_model
    from evaldag.tracking.samples import load_samples

    # a plain folder: batch size 32 -> 4 prompts x n=8. GSM8K: its first 8 prompts are 74-158 tokens, where
    # MATH-500's run to 449, and the transformers engine pads a batch to its longest prompt, n times over
    folder = resolve_model("smollm2-135m-instruct").path
    generations = NewGenerations(live_stack, "gsm8k")
    fr = run_deployment("eval/gsm8k", timeout=0, parameters={
        "checkpoint": folder, "limit": 8, "num_shards": 1, "step": 89, "train_run": "false-crash",
        "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 32, "seed": 4}})
    generations.wait(0)
    [shard] = children(fr.id)
    old = flow_run_processes(shard.id)
    assert old, "the shard's flow-run process was not found"
    [action] = crash_automation(MIN_HEARTBEAT_S).actions       # the automation's own state, message and all
    with get_client(sync_client=True) as client:
        for run_id in (fr.id, shard.id):
            client.set_flow_run_state(run_id, Crashed(message=action.message), force=True)
    gone, alive = psutil.wait_procs(old, timeout=60)
    assert not alive, f"the crashed shard's processes still run: {alive}"
    revived = wait(lambda: (s := flow_run(fr.id).state) and s.is_running() and s, timeout=60)
    assert "still alive" in revived.message
    state = wait(lambda: (s := flow_run(fr.id).state) and s.is_final() and s, timeout=900)
    assert state.is_completed(), state.message
    shards = sorted(children(fr.id), key=lambda r: r.created)
    assert [r.state.type.value for r in shards] == ["CRASHED", "COMPLETED"], shards

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'false-crash'")
    samples = load_samples(run.info.run_id)
    assert samples.height == 64 and samples.select("sample_id", "sample_index").n_unique() == 64


def test_a_run_lost_before_its_first_heartbeat_reaches_the_server_is_crashed(live_stack):
    """A flow run whose process and worker die before its first heartbeat event is delivered (the event still in the
    client's buffer under load, then SIGKILL) sent the server nothing but its Running state. The lost-run automation
    must count that as the start of the silence too, or the run stays Running forever and its parent never
    relaunches it (seen in test_foreground_worker on a loaded box)."""
    from prefect import flow
    from prefect.states import Running

    from evaldag.runtime.cluster import WATCHED_TAG

    @flow(name="evaldag-lost-before-heartbeat")
    def lost() -> None:
        """Never runs: only its flow run is made."""

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(lost, tags=[WATCHED_TAG, "shard"])
        client.set_flow_run_state(run.id, Running(), force=True)
    state = wait(lambda: (s := flow_run(run.id).state) and s.is_final() and s,
                 timeout=3 * live_stack.settings.missed_heartbeats * live_stack.settings.heartbeat_s)
    assert state.is_crashed(), state


# figures of the machine and the attempt, not of the answers: they differ between any two runs
_SYSTEM = {"generation_tokens", "generation_s", "grading_s", "scoring_s", "model_load_s", "shard_peak_rss_mb",
           "shard_peak_gpu_mb", "shard_generation_s_max", "generation_tokens_per_s", "generation_tokens_per_s_per_gib",
           "grading_samples_per_s",
           "latency_p50_s", "latency_p95_s", "latency_p99_s", "cache_hit_rate", "reduce_s", "engine_loads"}


def test_injected_transient_faults_are_retried_with_identical_results(live_stack):
    """A transient error in generation (mid-shard), grading and tracking: each is retried, and the evaluation ends
    with the same samples and the same metrics as a clean run of the same request, logged to one MLflow run."""
    import polars as pl

    from evaldag.storage import store
    from evaldag.request.checkpoint import resolve_model

    folder = resolve_model("smollm2-135m-instruct").path        # a plain folder: batch 32 -> 4 prompts x n=8
    params = {"checkpoint": folder, "limit": 8, "num_shards": 1, "step": 99, "train_run": "fault-drill",
              "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 24, "seed": 5}}
    faults = Path(os.environ["EVALDAG_FAULTS_FILE"])
    faults.write_text(json.dumps({"generate": 1, "grade": 1, "track": 1}))
    try:
        fr = run_deployment("eval/gsm8k", timeout=900, poll_interval=1, parameters=params)
    finally:
        budget = json.loads(faults.read_text())
        faults.unlink()
    assert fr.state.is_completed(), fr.state.message
    assert sorted(budget["_fired"]) == ["generate", "grade", "track"], budget   # every fault really happened

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'fault-drill'")
    assert run.info.status == "FINISHED"
    result_dir = store.root() / "gsm8k" / run.data.tags["eval_key"][:24]
    plan = json.loads((result_dir / "plan.json").read_text())
    faulty_metrics = json.loads((result_dir / "metrics.json").read_text())
    faulty_samples = pl.read_parquet((result_dir / "samples.parquet").read_bytes())
    stats = [json.loads(p.read_text()) for p in store.as_path(plan["stage_dir"]).glob("stats-generations-*.json")]
    assert sum(s["resumed_batches"] for s in stats) == 1            # the retried shard kept its first batch

    # the same request again from scratch, without faults
    store.remove_tree(store.as_path(plan["stage_dir"]))
    store.remove_tree(result_dir)
    clean = run_deployment("eval/gsm8k", timeout=900, poll_interval=1, parameters=params)
    assert clean.state.is_completed(), clean.state.message
    # the flow's own result is persisted in the result store, so any Prefect client can read it back
    assert clean.state.result()["metrics"]["n_samples"] == 64
    assert any((store.root() / "prefect-results").iterdir())
    clean_metrics = json.loads((result_dir / "metrics.json").read_text())
    clean_samples = pl.read_parquet((result_dir / "samples.parquet").read_bytes())

    keys = ["sample_id", "sample_index"]
    assert faulty_samples.height == clean_samples.height == 8 * 8
    assert faulty_samples.select(keys).n_unique() == 64                # none lost, none doubled
    cols = keys + ["completion", "status", "reward", "answer_group"]
    assert faulty_samples.sort(keys).select(cols).equals(clean_samples.sort(keys).select(cols))
    task = {k: v for k, v in clean_metrics.items() if k not in _SYSTEM}
    # through JSON: a NaN (e.g. an undefined interval) equals itself there
    differ = {k: (faulty_metrics.get(k), v) for k, v in task.items()
              if json.dumps(faulty_metrics.get(k)) != json.dumps(v)}
    assert not differ, differ                                       # metric: (after faults, clean)
    assert len(client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'fault-drill'")) == 1


def _logs(flow_run_ids) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def go():
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(flow_run_ids))))
            return [log.message for log in logs]
    return asyncio.run(go())


def _generate_runs(flow_run_ids) -> list:
    """The `generate` task runs of these (shard) flow runs."""
    async def go():
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(flow_run_ids))),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="generate")))
    return asyncio.run(go())


@contextlib.contextmanager
def _two_gpu_slots(stack):
    """The shared stack with two gpu workers and two GPU slots for the block (what `evaldag up --gpus 2` gives),
    then back to one."""
    from evaldag.runtime.stack import Stack

    Stack(stack.settings.model_copy(update={"num_gpus": 2})).up(deploy=False)
    try:
        yield
    finally:
        stack.up(deploy=False)


WAITING = "is being written by another process (an identical evaluation): waiting for it"


def test_identical_evaluations_started_together_compute_once(live_stack):
    """Two identical requests at the same moment, as two parent flow runs, with two gpu workers: both shard runs
    are inside the generate stage at once, the cross-process file lock lets one compute while the other waits,
    then the other reuses the file: the generation is computed once, both complete, and MLflow holds one run.

    The test holds the generation's lock itself until both shard processes are waiting on it, so they really meet
    there (on timing alone the second shard could start after the first had finished, and prove nothing)."""
    from evaldag.storage import store
    from evaldag.request.plan import EvalRequest, resolve

    params = {"limit": 4, "num_shards": 1, "step": 31, "train_run": "twins", "sampling": {"max_new_tokens": 16}}
    plan = resolve(EvalRequest.parse(benchmark="gsm8k", **params))    # the plan both parents will resolve
    assert not plan.generations_path(0).exists()
    with _two_gpu_slots(live_stack):
        with store.lock(plan.generations_path(0)):
            runs = [run_deployment("eval/gsm8k", timeout=0, parameters=params) for _ in range(2)]

            def both_waiting():
                shards = [c for fr in runs for c in children(fr.id)]
                done = [c.state.name for c in shards if c.state and c.state.is_final()]
                assert not done, f"shard runs ended ({done}) while the test held the generation's lock"
                waiting = [m for m in _logs([c.id for c in shards]) if WAITING in m]
                return shards if len(shards) == 2 and len(waiting) == 2 else None

            try:
                shards = wait(both_waiting, timeout=600, every=2)
            except AssertionError as e:
                found = [c for fr in runs for c in children(fr.id)]
                raise AssertionError(f"the two shard runs never waited on the lock together ({e}): "
                                     f"{[(str(c.id), c.state.name) for c in found]}, "
                                     f"{_logs([c.id for c in found])}") from None
            assert {t.flow_run_id for t in _generate_runs([c.id for c in shards])
                    if t.state and t.state.is_running()} == {c.id for c in shards}     # two processes at once
        states = [wait(lambda fr=fr: (s := flow_run(fr.id).state) and s.is_final() and s, timeout=900) for fr in runs]
    assert all(s.is_completed() for s in states), [s.message for s in states]

    def outcomes():
        # a shard process ships its logs in the background: wait until both outcomes have arrived
        messages = _logs([c.id for c in shards])
        found = [m for m in messages if "batch 1 of 1 done" in m or "generations already in" in m]
        return messages if len(found) >= 2 else None

    messages = wait(outcomes, timeout=60, every=2)
    computed = [m for m in messages if "batch 1 of 1 done" in m]
    reused = [m for m in messages if "generations already in" in m]
    assert len(computed) == 1 and len(reused) == 1, messages   # one computed; the other waited for it, then reused
    assert all(c.state.is_completed() for fr in runs for c in children(fr.id))

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'twins'")
    assert run.data.metrics["n_samples"] == 4

"""Relaunching failed evaluations (issue 22, item 5): at most one live retry per evaluation, and a run a person
cancelled is not started again unless asked.

The decision is a pure function (evaldag.runtime.relaunch), tested on bare states; start_evaluation and the sweeper are
tested against Prefect's in-process test server (prefect_test_harness): the `eval/math500` deployment exists there
without a work pool, so the runs it gets stay Scheduled (live) until a test sets their state.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from uuid import uuid4

import pytest
from conftest import complete_checkpoint
from prefect import flow
from prefect.states import Cancelled, Cancelling, Completed, Crashed, Failed, Paused, Pending, Running, Scheduled

from evaldag.runtime import relaunch
from evaldag.events.identity import evaluation_id

KEY = "evaldag-eval:run:10:math500:abcd:ef01"
_T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _run(state, key: str = KEY, minute: int = 0):
    return SimpleNamespace(id=uuid4(), idempotency_key=key, state=state, created=_T0 + timedelta(minutes=minute))


# ---- the pure decision -------------------------------------------------------------------------------------------

def test_attempts_are_the_first_run_and_its_retries_oldest_first():
    first, old_retry, new_retry = _run(Failed(), minute=0), _run(Failed(), f"{KEY}:retry:1700000000", 5), \
        _run(Failed(), f"{KEY}:retry:{uuid4()}", 9)
    other = _run(Failed(), KEY + "0")           # another evaluation whose key merely starts with this one
    other_retry = _run(Failed(), "x" + KEY + ":retry:1")
    assert relaunch.attempts_of([new_retry, other, first, other_retry, old_retry], KEY) == [first, old_retry,
                                                                                            new_retry]


@pytest.mark.parametrize("live", [Scheduled(), Pending(), Running(), Paused(), Cancelling(),
                                  Scheduled(name="AwaitingRetry"), Scheduled(name="Late"), None])
def test_a_live_attempt_blocks_a_new_retry(live):
    attempts = [_run(Failed(), minute=0), _run(live, f"{KEY}:retry:1", 5), _run(Crashed(), f"{KEY}:retry:2", 9)]
    decision = relaunch.decide(attempts, include_cancelled=True)
    assert decision.action == "live" and decision.run is attempts[1] and not decision.start


def test_a_failed_or_crashed_latest_attempt_is_retried_under_a_key_derived_from_it():
    for end in (Failed(), Crashed()):
        attempts = [_run(Completed(), minute=0), _run(end, f"{KEY}:retry:1", 5)]
        decision = relaunch.decide(attempts, include_cancelled=False)
        assert decision.start and decision.run is attempts[1]
        # two sweeps that decide at once get the same key, so Prefect hands both the same run
        assert relaunch.retry_key(KEY, decision.run) == f"{KEY}:retry:{attempts[1].id}"


def test_a_completed_latest_attempt_is_not_retried():
    decision = relaunch.decide([_run(Failed(), minute=0), _run(Completed(), f"{KEY}:retry:1", 5)], False)
    assert decision.action == "completed" and not decision.start


@pytest.mark.parametrize("cancel", [Cancelled(), Cancelled(message="Flow run was cancelled."),
                                    Cancelled(message="cancelled from `evaldag run` (Ctrl-C)"),
                                    Cancelled(message="The parent flow run was cancelled.")])
def test_a_persons_cancel_is_kept_unless_asked(cancel):
    attempts = [_run(Failed(), minute=0), _run(cancel, f"{KEY}:retry:1", 5)]
    assert relaunch.is_deliberate_cancel(cancel)
    kept = relaunch.decide(attempts, include_cancelled=False)
    assert kept.action == "cancelled" and not kept.start
    assert relaunch.decide(attempts, include_cancelled=True).start


def test_prefects_own_cancels_and_crashes_are_not_a_persons():
    assert not relaunch.is_deliberate_cancel(Cancelled(message="Deployment concurrency limit reached."))
    assert not relaunch.is_deliberate_cancel(Crashed(message="Flow run was cancelled."))
    assert not relaunch.is_deliberate_cancel(Failed())
    assert relaunch.decide([_run(Cancelled(message="Deployment concurrency limit reached."))], False).start


def test_an_earlier_cancel_does_not_block_a_later_failure():
    """Only the latest attempt counts: a person cancelled once, then asked for it again, and that run failed."""
    attempts = [_run(Cancelled(), minute=0), _run(Failed(), f"{KEY}:retry:1", 5)]
    assert relaunch.decide(attempts, include_cancelled=False).start


# ---- start_evaluation and the sweeper against a real (in-process) Prefect API ---------------------------------------

@pytest.fixture(scope="module")
def prefect_api():
    """An ephemeral Prefect server with an `eval/math500` deployment and no work pool: its runs stay Scheduled."""
    from prefect import get_client
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with get_client(sync_client=True) as client:
            flow_id = client.create_flow_from_name("eval")
            deployment_id = client.create_deployment(flow_id=flow_id, name="math500")
            shard_flow_id = client.create_flow_from_name("eval-shard")    # eval-shard/gpu: shards stay Scheduled too
            shard_deployment_id = client.create_deployment(flow_id=shard_flow_id, name="gpu")
        yield SimpleNamespace(deployment_id=deployment_id, shard_deployment_id=shard_deployment_id)


def _client():
    from prefect import get_client

    return get_client(sync_client=True)


def _evaluation_runs(api, train_run: str) -> list:
    """Every flow run of eval/math500 for `train_run`, oldest first."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with _client() as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[api.deployment_id])))
    return sorted((r for r in runs if r.parameters.get("train_run") == train_run), key=lambda r: r.created)


def _set(run_id, state) -> None:
    with _client() as client:
        client.set_flow_run_state(run_id, state, force=True)


def _old_style_retry(api, key: str, train_run: str, step: int, checkpoint: str):
    """A live retry as the sweeper before this fix made it: keyed `<key>:retry:<unix time>`."""
    with _client() as client:
        return client.create_flow_run_from_deployment(
            api.deployment_id, idempotency_key=f"{key}:retry:1700000000", name=f"math500-{train_run}-step{step}-retry",
            parameters={"checkpoint": checkpoint, "step": step, "train_run": train_run})


@flow
def _start(checkpoint: str, train_run: str, include_cancelled: bool = False) -> dict:
    from tasks.start_evaluation import start_evaluation

    asked = {"include_cancelled": True} if include_cancelled else {}
    return start_evaluation("math500", checkpoint, 10, train_run, None, relaunch_failed=True, **asked)


def test_start_evaluation_starts_nothing_while_a_retry_is_live(prefect_api, tmp_path):
    train_run, ckpt = "live-retry", str(complete_checkpoint(tmp_path / "checkpoint-10"))
    first = _start(ckpt, train_run)
    _set(first["flow_run_id"], Failed())
    live = _old_style_retry(prefect_api, evaluation_id(10, ["math500"], ckpt), train_run, 10, ckpt)
    for _ in range(2):   # the next sweep, and a duplicate event
        again = _start(ckpt, train_run)
        assert again["flow_run_id"] == str(live.id)
    assert len(_evaluation_runs(prefect_api, train_run)) == 2


def test_start_evaluation_retries_a_failure_once(prefect_api, tmp_path):
    train_run, ckpt = "one-retry", str(complete_checkpoint(tmp_path / "checkpoint-10"))
    first = _start(ckpt, train_run)
    _set(first["flow_run_id"], Crashed())
    retry = _start(ckpt, train_run)
    assert retry["flow_run_id"] != first["flow_run_id"] and retry["state"] == "Scheduled"
    assert _start(ckpt, train_run)["flow_run_id"] == retry["flow_run_id"]
    assert len(_evaluation_runs(prefect_api, train_run)) == 2
    _set(retry["flow_run_id"], Failed())   # the retry failed too: one more, and again only one
    third = _start(ckpt, train_run)
    assert third["flow_run_id"] not in (first["flow_run_id"], retry["flow_run_id"])
    assert _start(ckpt, train_run)["flow_run_id"] == third["flow_run_id"]
    assert len(_evaluation_runs(prefect_api, train_run)) == 3


def test_start_evaluation_leaves_a_cancelled_run_alone_unless_asked(prefect_api, tmp_path):
    train_run, ckpt = "cancelled", str(complete_checkpoint(tmp_path / "checkpoint-10"))
    first = _start(ckpt, train_run)
    _set(first["flow_run_id"], Cancelled(message="Flow run was cancelled."))
    kept = _start(ckpt, train_run)
    assert kept["flow_run_id"] == first["flow_run_id"] and kept["state"] == "Cancelled"
    assert len(_evaluation_runs(prefect_api, train_run)) == 1
    asked = _start(ckpt, train_run, include_cancelled=True)
    assert asked["flow_run_id"] != first["flow_run_id"]
    assert _start(ckpt, train_run, include_cancelled=True)["flow_run_id"] == asked["flow_run_id"]
    assert len(_evaluation_runs(prefect_api, train_run)) == 2


def test_hourly_sweeps_do_not_stack_retries_or_revive_a_cancel(prefect_api, monkeypatch):
    import flows.sweeper_flow as sweeper

    monkeypatch.setattr(sweeper, "evaluated_checkpoints", lambda bench, **_: set())   # MLflow has nothing finished
    root = Path(os.environ["EVALDAG_CHECKPOINT_ROOTS"]) / "sweep-run"
    ckpt = complete_checkpoint(root / "checkpoint-10").resolve()
    sweep = {"roots": [str(root)], "benchmarks": ["math500"]}

    first = sweeper.eval_sweeper(**sweep)["started"][0]
    _set(first["flow_run_id"], Failed())
    retry = sweeper.eval_sweeper(**sweep)["started"][0]
    for _ in range(2):
        assert sweeper.eval_sweeper(**sweep)["started"][0]["flow_run_id"] == retry["flow_run_id"]
    assert len(_evaluation_runs(prefect_api, "sweep-run")) == 2

    _set(retry["flow_run_id"], Cancelled(message="Flow run was cancelled."))
    assert sweeper.eval_sweeper(**sweep)["started"][0]["flow_run_id"] == retry["flow_run_id"]
    assert len(_evaluation_runs(prefect_api, "sweep-run")) == 2
    asked = sweeper.eval_sweeper(**sweep, include_cancelled=True)["started"][0]
    assert asked["flow_run_id"] != retry["flow_run_id"]
    assert len(_evaluation_runs(prefect_api, "sweep-run")) == 3
    assert str(ckpt) == _evaluation_runs(prefect_api, "sweep-run")[-1].parameters["checkpoint"]


def _lost_run_crash():
    from evaldag.runtime.cluster import CRASH_AUTOMATION

    return Crashed(message=f"Flow run marked as crashed by automation {CRASH_AUTOMATION!r}: no heartbeat")


def test_a_lost_run_crash_is_retried_only_once_settled(prefect_api, tmp_path, monkeypatch):
    """The lost-run automation crashed an evaluation that still runs (a partition, a clock step): it revives within
    the grace, so no retry starts beside it. One that stays crashed past the grace is retried, once."""
    import threading

    import tasks.start_evaluation as start_evaluation
    from evaldag.runtime import liveness

    monkeypatch.setattr(liveness, "REVIVE_GRACE_S", 3.0)
    train_run, ckpt = "revived", str(complete_checkpoint(tmp_path / "checkpoint-10"))
    first = _start(ckpt, train_run)
    _set(first["flow_run_id"], _lost_run_crash())

    def revived_a_second_later(read_run, **grace):
        """The parent's watchdog undoes the crash a second after the start task read it (liveness.revive)."""
        threading.Timer(1.0, _set, (first["flow_run_id"], Running(message="still alive; resumed"))).start()
        return liveness.settled(read_run, **grace)

    # where the start task waits (a no-op where it does not wait: the retry starts at once)
    monkeypatch.setattr(start_evaluation, "settled", revived_a_second_later, raising=False)
    again = _start(ckpt, train_run)
    assert again["flow_run_id"] == first["flow_run_id"] and again["relaunch"] == "live"
    assert len(_evaluation_runs(prefect_api, train_run)) == 1

    monkeypatch.setattr(start_evaluation, "settled", liveness.settled)
    _set(first["flow_run_id"], _lost_run_crash())     # really lost this time: nothing revives it
    retry = _start(ckpt, train_run)
    assert retry["flow_run_id"] != first["flow_run_id"] and retry["relaunch"] == "retry"
    assert len(_evaluation_runs(prefect_api, train_run)) == 2


def _shard_runs(api) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with _client() as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[api.shard_deployment_id])))


def _parent_of(train_run: str):
    """The id of the (one) eval flow run of `train_run` called in this process."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with _client() as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["eval"])))
    (run,) = [r for r in runs if r.parameters.get("train_run") == train_run and r.deployment_id is None]
    return run.id


def test_an_evaluation_cancelled_through_the_api_relaunches_no_shard_and_stays_cancelled(prefect_api, configs,
                                                                                         tmp_path):
    """set_flow_run_state(Cancelled, force=True), as an API client or a script cancels: the parent's process goes on
    and the server cancels its shard. That shard is not launched again (it was, twice, each time starting the
    engine), and the evaluation ends Cancelled with the person's message (it ended Failed over it)."""
    import threading
    import time

    from flows.eval_flow import eval_flow

    ckpt = complete_checkpoint(tmp_path / "checkpoint-10")
    before = {r.id for r in _shard_runs(prefect_api)}
    done = threading.Event()
    seen: dict = {}

    def cancel_as_a_script_does() -> None:
        """Cancel the parent once its shard exists, then cancel every shard run as the server does for a
        cancelled parent's children (relaunched ones included, so that the old code ends too)."""
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            for shard in [r for r in _shard_runs(prefect_api) if r.id not in before]:
                seen.setdefault(shard.id, shard)
                if "parent" not in seen:
                    seen["parent"] = _parent_of("api-cancel")
                    _set(seen["parent"], Cancelled(message="cancelled by a script"))
                if not shard.state.is_final():
                    _set(shard.id, Cancelled(message="The parent flow run was cancelled."))
            time.sleep(0.5)

    watcher = threading.Thread(target=cancel_as_a_script_does, daemon=True)
    watcher.start()
    try:
        state = eval_flow(benchmark="aime24", checkpoint=str(ckpt), step=10, limit=2, num_shards=1,
                          train_run="api-cancel", engine="hf", return_state=True)
    finally:
        done.set()
        watcher.join(10)
    shards = [k for k in seen if k != "parent"]
    assert len(shards) == 1, f"the shard was launched {len(shards)} times"
    with _client() as client:
        final = client.read_flow_run(seen["parent"]).state
    assert state.is_cancelled() and final.is_cancelled(), final
    assert final.message == "cancelled by a script"


# ---- a checkpoint the sweeper found first, announced late by its trainer under the job's own name (issue 51 item 7)

@flow
def _sweep(checkpoint: str, folder_job: str, benchmark: str = "math500") -> dict:
    from tasks.start_evaluation import start_evaluation

    return start_evaluation(benchmark, checkpoint, 10, folder_job, None, relaunch_failed=True, adopt_train_run=True)


@flow
def _announce(checkpoint: str, train_run: str, overrides: dict, benchmark: str = "math500") -> dict:
    from tasks.start_evaluation import start_evaluation

    return start_evaluation(benchmark, checkpoint, 10, train_run, overrides, relaunch_failed=True)


def test_a_late_event_adopts_the_evaluation_the_sweeper_started(prefect_api, tmp_path, sqlite_mlflow, configs):
    """The sweeper starts a checkpoint's evaluation under the folder's name; the trainer's event for it arrives
    late under the job's own name and the MLflow run it keeps: no second evaluation starts, the sweeper's becomes
    the job's (its parameters, and its track step logs it under that job). Later sweeps join it, and another job's
    event does not take it over."""
    import json

    import polars as pl
    from mlflow import MlflowClient

    from evaldag.request.plan import EvalRequest, resolve
    from tasks.track import track_task

    ckpt = str(complete_checkpoint(tmp_path / "folder-run" / "checkpoint-10").resolve())
    parent = "0123456789abcdef0123456789abcdef"
    swept = _sweep(ckpt, "folder-run")
    late = _announce(ckpt, "trainer-job", {"mlflow_parent_run_id": parent})
    assert late["flow_run_id"] == swept["flow_run_id"] and late["train_run"] == "trainer-job"
    runs = [r for job in ("folder-run", "trainer-job") for r in _evaluation_runs(prefect_api, job)]
    assert [str(r.id) for r in runs] == [swept["flow_run_id"]]
    assert (runs[0].parameters["train_run"], runs[0].parameters["mlflow_parent_run_id"]) == ("trainer-job", parent)
    for again in (_sweep(ckpt, "folder-run"), _announce(ckpt, "other-job", {})):
        assert (again["flow_run_id"], again["train_run"]) == (swept["flow_run_id"], "trainer-job")

    # its track step: the plan was resolved (as the sweeper asked) before the event adopted the run
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=ckpt, step=10, limit=2, num_shards=1,
                               train_run="folder-run"), tmp_path / "results")
    pl.DataFrame({"sample_id": ["a", "b"], "correct": [True, False]}).write_parquet(plan.path("samples.parquet"))
    metrics = {"accuracy": 0.5, "reward/mean": 0.5, "reward/std": 0.5, "n_samples": 2.0}
    plan.path("metrics.json").write_text(json.dumps(metrics))
    tracked = track_task.fn(str(plan.path("plan.json")), metrics, swept["flow_run_id"])
    tags = MlflowClient().get_run(tracked.run_id).data.tags
    assert tags["train_run"] == "trainer-job" and parent in tags["evaldag.parent_run_refused"]   # no such run here
    assert MlflowClient().get_run(tags["evaldag.parent_run_id"]).data.tags["train_run"] == "trainer-job"


def test_a_late_event_moves_the_sweepers_evaluation_logged_already(prefect_api, tmp_path, sqlite_mlflow, configs):
    """The sweeper's evaluation finished and was logged to MLflow under the folder's job before the trainer's event
    came: the event adopts it, and its MLflow run moves to the trainer's job (tag, parent run id) with the curve
    point in the trainer's parent run. A second late event, and the next sweep, evaluate and move nothing more."""
    import json

    import polars as pl
    from mlflow import MlflowClient

    from evaldag.request.plan import EvalRequest, resolve
    from evaldag.tracking.names import experiment_name
    from evaldag.tracking.parent_runs import parent_run
    from tasks.track import track_task

    with _client() as client:   # eval/aime24: a benchmark whose problems the tests have offline
        client.create_deployment(flow_id=client.create_flow_from_name("eval"), name="aime24")
    ckpt = str(complete_checkpoint(tmp_path / "folder-job" / "checkpoint-10").resolve())
    swept = _sweep(ckpt, "folder-job", "aime24")
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=ckpt, step=10, limit=2, num_shards=1,
                               train_run="folder-job"), tmp_path / "results")
    pl.DataFrame({"sample_id": ["a", "b"], "correct": [True, False]}).write_parquet(plan.path("samples.parquet"))
    metrics = {"accuracy": 0.5, "reward/mean": 0.5, "reward/std": 0.5, "n_samples": 2.0}
    plan.path("metrics.json").write_text(json.dumps(metrics))
    tracked = track_task.fn(str(plan.path("plan.json")), metrics, swept["flow_run_id"])
    _set(swept["flow_run_id"], Completed())
    mlflow = MlflowClient()
    folder_parent = parent_run(mlflow, "folder-job")
    curve = {k: v for k, v in mlflow.get_run(folder_parent).data.metrics.items() if k.startswith("aime24")}
    assert curve and mlflow.get_run(tracked.run_id).data.tags["train_run"] == "folder-job"

    for _ in range(2):   # the late event, then a duplicate of it
        late = _announce(ckpt, "trainer-job", {}, "aime24")
        assert (late["flow_run_id"], late["train_run"]) == (swept["flow_run_id"], "trainer-job")
    again = _sweep(ckpt, "folder-job", "aime24")
    assert again["flow_run_id"] == swept["flow_run_id"]
    trainer_parent = parent_run(mlflow, "trainer-job")
    tags = mlflow.get_run(tracked.run_id).data.tags
    assert (tags["train_run"], tags["evaldag.parent_run_id"]) == ("trainer-job", trainer_parent)
    for key, value in curve.items():   # the point, once, at the step
        points = mlflow.get_metric_history(trainer_parent, key)
        assert [(p.step, p.value) for p in points] == [(10, value)], key
    runs = mlflow.search_runs([mlflow.get_experiment_by_name(experiment_name("aime24")).experiment_id],
                              filter_string="tags.kind = 'ckpt_eval'")
    assert [r.info.run_id for r in runs] == [tracked.run_id]

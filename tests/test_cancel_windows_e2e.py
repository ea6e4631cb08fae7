"""A person's cancel of an evaluation stands in every window (issue 51, item 2), through the real stack.

Each test cancels the parent flow run as an API client or a script does (`set_flow_run_state(Cancelled,
force=True)`: the parent's process goes on, the server cancels its shards only in its 20 s loop) at one moment,
held there by a fault-drill hold (evaldag.pipeline.faults), and asserts that the parent ends Cancelled with the
person's message and never Completed or Failed after it, that no FINISHED MLflow run exists for the evaluation, and
that no shard was launched again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelled

from cluster_helpers import alive, children, flow_run, flow_run_processes, state_history, wait
from evaldag.tracking.names import experiment_name

pytestmark = [pytest.mark.stack, pytest.mark.model]

MESSAGE = "cancelled by a script"
SETTINGS = {"limit": 2, "num_shards": 1}


def _sampling(seed: int) -> dict:
    """A seed of each test's own: the same settings would find another test's shards in the result store."""
    return {"max_new_tokens": 16, "seed": seed}


def _start(train_run: str, step: int, seed: int, **extra):
    return run_deployment("eval/math500", timeout=0, parameters={**SETTINGS, "sampling": _sampling(seed),
                                                                 "train_run": train_run, "step": step, **extra})


def _hold(point: str, tmp_path: Path, attempt: int = 1) -> Path:
    """Park the first process that reaches `point` until the returned path exists (evaldag.pipeline.faults)."""
    release = tmp_path / f"release-{point}-{attempt}"
    Path(os.environ["EVALDAG_FAULTS_FILE"]).write_text(json.dumps({"hold": {point: str(release)}}))
    return release


def _cancel_at(fr, release: Path) -> None:
    """Once the hold is reached: cancel the parent as a script does, let the held process go on, and wait until
    the parent's process has ended (its state is Cancelled from the cancel on, so the state cannot tell)."""
    wait(lambda: release.with_name(release.name + ".reached").exists(), timeout=600, every=0.2)
    procs = wait(lambda: flow_run_processes(fr.id), timeout=60, every=0.2)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(fr.id, Cancelled(message=MESSAGE), force=True)
    release.touch()
    wait(lambda: not any(alive(p) for p in procs), timeout=600)


def _assert_cancel_stood(fr, train_run: str, step: int, shards: int) -> None:
    final = flow_run(fr.id).state
    assert final.is_cancelled() and final.message == MESSAGE, (final.type, final.message)
    history = state_history(fr.id)
    cancel = next(i for i, s in enumerate(history) if s.is_cancelled() and s.message == MESSAGE)
    assert not [s for s in history[cancel:] if s.is_completed() or s.is_failed()], [s.name for s in history]
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    runs = [] if exp is None else client.search_runs([exp.experiment_id],
                                                     filter_string=f"tags.train_run = '{train_run}' and "
                                                                   f"tags.step = '{step:012d}'")
    assert not [r for r in runs if r.info.status == "FINISHED"], [(r.info.run_id, r.info.status) for r in runs]
    assert len(children(fr.id)) == shards, [r.name for r in children(fr.id)]


@pytest.fixture(autouse=True)
def _no_holds_left():
    yield
    Path(os.environ["EVALDAG_FAULTS_FILE"]).unlink(missing_ok=True)


def test_a_cancel_while_the_shard_finishes_inside_the_servers_loop(live_stack, tmp_path):
    """The shard completes before the server's child-cancel loop (every 20 s) gets to it: the parent's launch
    sees a completed shard and nothing to stop. Held in the parent once its shard completed, so that the loop
    cannot cancel the shard first (it did, under load, when the shard was held and let go at the cancel). The
    parent ended Completed and logged to MLflow."""
    release = _hold("shard_done", tmp_path)
    fr = _start("cancel-shard-done", 501, seed=11)
    _cancel_at(fr, release)
    _assert_cancel_stood(fr, "cancel-shard-done", 501, shards=1)


def test_a_cancel_during_track(live_stack, tmp_path):
    """Held in track after the MLflow run is created and its metrics logged: the run must not be finished."""
    release = _hold("track", tmp_path)
    fr = _start("cancel-track", 502, seed=12)
    _cancel_at(fr, release)
    _assert_cancel_stood(fr, "cancel-track", 502, shards=1)


def test_a_cancel_during_reduce_and_of_a_rerun_whose_shards_are_all_reused(live_stack, tmp_path):
    """Cancelled during reduce; then the same evaluation again, which finds every shard in the result store and
    launches nothing (no shard launch to notice the cancel), cancelled during its reduce too."""
    release = _hold("reduce", tmp_path)
    first = _start("cancel-reused", 503, seed=13)
    _cancel_at(first, release)
    _assert_cancel_stood(first, "cancel-reused", 503, shards=1)

    release = _hold("reduce", tmp_path, attempt=2)
    rerun = _start("cancel-reused", 503, seed=13)
    _cancel_at(rerun, release)
    _assert_cancel_stood(rerun, "cancel-reused", 503, shards=0)


def test_a_decided_evaluation_cancelled_while_its_shard_finishes(live_stack, tmp_path):
    """decide="vs_best" against the job's step 1 (greedy, the same answers): the parent decides `equivalent` at the
    first round end from the shard's rows, held once its shard completed; then it is cancelled. The parent ended
    Completed with the decided prefix logged. (A decided round whose shards the server cancelled before they finished
    its prefix raises, which ended the run Failed: tests/test_cancel.py.)"""
    from evaldag.storage import store

    job, settings = "cancel-decide", {"limit": 12}
    incumbent = run_deployment("eval/math500", timeout=900, poll_interval=1, parameters={
        **SETTINGS, **settings, "sampling": _sampling(14), "train_run": job, "step": 1})
    assert incumbent.state.is_completed(), incumbent.state.message
    release = _hold("shard_done", tmp_path)
    # another seed: step 1's generations would otherwise be found in the store and nothing generated (greedy: the
    # same answers); rounds end at 4, 8 and 12 problems, and the round's interval at 8 (about +-0.45, the t
    # quantile over few problems) is within the margin 0.9, at 4 (about +-1.1) not
    fr = _start(job, 2, 15, **settings, decide="vs_best", decide_margin=0.9, decide_rounds=3)
    wait(lambda: release.with_name(release.name + ".reached").exists(), timeout=600, every=0.2)
    decided = wait(lambda: [p for p in store.root().joinpath("math500").glob("*/decide/decision.json")
                            if json.loads(p.read_text()).get("verdict")], timeout=300, every=0.5)
    assert json.loads(decided[0].read_text())["verdict"] == "equivalent"
    _cancel_at(fr, release)
    _assert_cancel_stood(fr, job, 2, shards=1)

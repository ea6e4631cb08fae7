"""Checkpoint-arrival triggers against the real stack: trainer events, duplicates, a server that is down, hostile
payloads, and the sweeper. The evaluations are small slices (2 problems, 16 new tokens) of the real pipeline."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.deployments import run_deployment

from conftest import free_ports
from evaldag.request.checkpoint import resolve_model
from evaldag.tracking.names import JOBS_EXPERIMENT, experiment_name
from evaldag.client import CheckpointNotifier, flush_spool

pytestmark = [pytest.mark.stack, pytest.mark.model]

SMALL = {"limit": 2, "num_shards": 1, "sampling": {"max_new_tokens": 16}}
ROOT = Path(os.environ["EVALDAG_CHECKPOINT_ROOTS"])


def _checkpoint(run: str, step: int) -> Path:
    """A complete checkpoint folder under the allowed root: the default model's files, hard-linked (cheap)."""
    src = Path(resolve_model("smollm2-135m-instruct").path)
    dst = ROOT / run / f"checkpoint-{step}"
    if not dst.exists():
        def link(a, b):
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)
        shutil.copytree(src, dst, copy_function=link)
    return dst


async def _deployment_runs(deployment: str) -> list:
    async with get_client() as client:
        return await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])), limit=200)


def _runs(deployment: str) -> list:
    return asyncio.run(_deployment_runs(deployment))


def _wait_for(predicate, timeout: float = 600, every: float = 2.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def _final_run_for(deployment: str, match) -> object:
    def found():
        runs = [r for r in _runs(deployment) if match(r)]
        return runs[0] if runs and runs[0].state and runs[0].state.is_final() else None
    return _wait_for(found)


def _event_runs(path: Path) -> list:
    return [r for r in _runs("on-checkpoint") if r.parameters.get("event", {}).get("path") == str(path)]


@pytest.fixture(scope="module")
def triggers(live_stack):
    """Small evaluations for the trigger and sweeper deployments (a server-side setting, not an event field)."""
    async def set_overrides():
        async with get_client() as client:
            for name in ("on-checkpoint/on-checkpoint", "eval-sweeper/hourly"):
                dep = await client.read_deployment_by_name(name)
                await client.update_deployment(dep.id, DeploymentUpdate(
                    parameters={**dep.parameters, "eval_overrides": SMALL}))
    asyncio.run(set_overrides())
    return live_stack


@pytest.mark.postgres
def test_event_starts_an_evaluation_logged_under_the_job(triggers):
    ckpt = _checkpoint("evt-run", 100)
    # the trainer also asks for sequential stopping: its event carries it to the evaluation's parameters
    notifier = CheckpointNotifier(train_run="evt-run", api_url=triggers.settings.prefect_api_url,
                                  benchmarks=["math500"], spool_dir=ROOT.parent / "spool-a", decide={"margin": 0.05})
    t0 = time.time()
    notifier.notify(ckpt, step=100)
    first = _wait_for(lambda: _event_runs(ckpt), timeout=120, every=0.5)[0]
    latency = first.created.timestamp() - t0
    print(f"event -> on-checkpoint flow run created: {latency:.2f} s")
    parent = _final_run_for("on-checkpoint", lambda r: r.id == first.id)
    assert parent.state.is_completed(), parent.state.message
    evaluation = _final_run_for("math500", lambda r: r.parameters.get("train_run") == "evt-run"
                                and r.parameters.get("step") == 100)
    assert evaluation.state.is_completed(), evaluation.state.message
    assert (evaluation.parameters["decide"], evaluation.parameters["decide_margin"]) == ("vs_best", 0.05)

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    [child] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'evt-run'")
    assert child.data.tags["step"] == "000000000100" and child.data.metrics["n_samples"] == 2
    assert child.data.tags["decide.status"] == "no_incumbent"       # the job's first evaluation: run in full
    jobs = client.get_experiment_by_name(JOBS_EXPERIMENT)
    [job] = client.search_runs([jobs.experiment_id], filter_string="tags.train_run = 'evt-run'")
    assert child.data.tags["evaldag.parent_run_id"] == job.info.run_id
    # the job's curve for this kind of evaluation (SMALL: the first 2 problems, 16 tokens), at the checkpoint's step
    assert [m.step for m in client.get_metric_history(job.info.run_id, "math500.limit2.tok16/accuracy")] == [100]
    assert "math500/accuracy" not in client.get_run(job.info.run_id).data.metrics   # a slice is not the full curve


def test_duplicate_events_give_one_evaluation(triggers):
    ckpt = _checkpoint("dup-run", 10)
    notifier = CheckpointNotifier(train_run="dup-run", api_url=triggers.settings.prefect_api_url,
                                  benchmarks=["math500"], spool_dir=ROOT.parent / "spool-b")
    notifier.notify(ckpt, step=10)
    notifier.notify(ckpt, step=10)
    _wait_for(lambda: len(_event_runs(ckpt)) == 2 and all(r.state.is_final() for r in _event_runs(ckpt)))
    evaluation = _final_run_for("math500", lambda r: r.parameters.get("train_run") == "dup-run")
    assert evaluation.state.is_completed(), evaluation.state.message
    notifier.notify(ckpt, step=10)      # again, after the evaluation completed
    _wait_for(lambda: len(_event_runs(ckpt)) == 3 and all(r.state.is_final() for r in _event_runs(ckpt)))
    assert all(r.state.is_completed() for r in _event_runs(ckpt))
    evals = [r for r in _runs("math500") if r.parameters.get("train_run") == "dup-run"]
    assert len(evals) == 1, "the same checkpoint x benchmark must be evaluated once"
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    assert len(client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'dup-run'")) == 1


def test_events_for_an_unreachable_server_are_spooled_then_flushed_to_the_live_one(triggers):
    """The notifier points at a port where nothing listens: notify spools within its time budget, and
    `flush_spool` (what `evaldag flush-events` runs) delivers the spooled event to the live server, which evaluates
    it. The real server going down and coming back is test_prefect_server_restart_loses_no_event."""
    ckpt = _checkpoint("spool-run", 200)
    spool = ROOT.parent / "spool-c"
    (dead_port,) = free_ports(1)
    notifier = CheckpointNotifier(train_run="spool-run", api_url=f"http://127.0.0.1:{dead_port}/api",
                                  benchmarks=["math500"], spool_dir=spool, max_block_s=2.0)
    t0 = time.perf_counter()
    event_id = notifier.notify(ckpt, step=200)
    assert time.perf_counter() - t0 < 3.0, "notify must not block the trainer while the server is down"
    assert len(notifier.pending()) == 1
    assert flush_spool(spool, triggers.settings.prefect_api_url) == 1     # the server is back
    assert notifier.pending() == []
    evaluation = _final_run_for("math500", lambda r: r.parameters.get("train_run") == "spool-run")
    assert evaluation.state.is_completed(), evaluation.state.message
    assert event_id


def test_a_full_evaluation_after_a_quick_slice_runs(triggers):
    """An event asking for a quick slice (extra.limit=1), then the same checkpoint without a limit: two evaluations
    (the second is not handed the first's flow run); the same event once more starts nothing."""
    ckpt = _checkpoint("slice-run", 30)
    notifier = CheckpointNotifier(train_run="slice-run", api_url=triggers.settings.prefect_api_url,
                                  benchmarks=["math500"], spool_dir=ROOT.parent / "spool-e")

    def evals():
        return [r for r in _runs("math500") if r.parameters.get("train_run") == "slice-run"]

    def settled(n_events):
        return len(_event_runs(ckpt)) == n_events and all(r.state.is_final() for r in _event_runs(ckpt) + evals())

    notifier.notify(ckpt, step=30, limit=1)
    _wait_for(lambda: settled(1) and evals(), timeout=300)
    notifier.notify(ckpt, step=30)              # the deployment's own setting: SMALL's 2 problems
    _wait_for(lambda: settled(2) and len(evals()) == 2, timeout=300)
    notifier.notify(ckpt, step=30)              # identical to the previous one
    _wait_for(lambda: settled(3), timeout=300)
    assert all(r.state.is_completed() for r in _event_runs(ckpt) + evals())
    assert sorted(r.parameters["limit"] for r in evals()) == [1, 2]
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("math500"))
    runs = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'slice-run'")
    assert sorted(r.data.metrics["n_samples"] for r in runs) == [1, 2]


MALFORMED = {        # what is wrong with the payload -> (how it is made from a good one, what the failure must say)
    "missing-path": (lambda ok: {k: v for k, v in ok.items() if k != "path"}, "path"),
    "outside-roots": (lambda ok: {**ok, "path": "/etc"}, "not under"),
    "traversal": (lambda ok: {**ok, "path": str(ROOT / "bad-run" / ".." / "bad-run" / "checkpoint-1")}, ".."),
    "incomplete": (lambda ok: {**ok, "path": str(ROOT / "bad-run" / "checkpoint-2"), "step": 2}, "no tokenizer"),
    "negative-step": (lambda ok: {**ok, "step": -5}, "step"),
    "step-mismatch": (lambda ok: {**ok, "step": 7}, "says step 1, the event says step 7"),
    "unknown-benchmark": (lambda ok: {**ok, "benchmarks": ["math5000"]}, "unknown benchmarks"),
}


def test_malformed_payloads_fail_their_own_run(triggers):
    """Each hostile or broken payload fails its own on-checkpoint run with a message naming the problem, and starts
    no evaluation. All are sent at once (the cpu worker runs them side by side) and checked one by one."""
    incomplete = ROOT / "bad-run" / "checkpoint-2"
    incomplete.mkdir(parents=True, exist_ok=True)
    (incomplete / "config.json").write_text("{}")
    (incomplete / "model.safetensors").write_bytes(b"\0" * 8)
    ok = {"path": str(_checkpoint("bad-run", 1)), "step": 1, "train_run": "bad-run", "benchmarks": ["math500"]}
    events, markers = [], {}
    for case, (payload_fn, _) in MALFORMED.items():
        payload = payload_fn(ok)
        markers[case] = payload["extra"] = {"marker": f"{case}-{uuid.uuid4().hex[:8]}"}
        events.append({"id": str(uuid.uuid4()), "occurred": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "event": "evaldag.checkpoint.saved", "payload": payload,
                       "resource": {"prefect.resource.id": "evaldag.train-run.bad-run",
                                    "prefect.resource.name": "bad-run"}})
    r = httpx.post(f"{triggers.settings.prefect_api_url}/events", json=events, timeout=10)
    assert r.status_code == 204

    def marker_of(fr) -> dict | None:
        return fr.parameters.get("event", {}).get("extra")

    def all_final():
        runs = {case: [fr for fr in _runs("on-checkpoint") if marker_of(fr) == marker]
                for case, marker in markers.items()}
        return runs if all(len(rs) == 1 and rs[0].state and rs[0].state.is_final() for rs in runs.values()) else None
    runs = _wait_for(all_final, timeout=600)
    for case, (_, message) in MALFORMED.items():
        [run] = runs[case]
        assert run.state.is_failed(), (case, run.state)
        assert message in run.state.message, (case, run.state.message)
    assert not [r for r in _runs("math500") if r.parameters.get("train_run") == "bad-run"]


def test_sweeper_evaluates_checkpoints_nobody_announced(triggers):
    _checkpoint("quiet-run", 300)
    fr = run_deployment("eval-sweeper/hourly", parameters={"roots": [str(ROOT / "quiet-run")]},
                        timeout=300, poll_interval=1)
    assert fr.state.is_completed(), fr.state.message
    evaluation = _final_run_for("math500", lambda r: r.parameters.get("train_run") == "quiet-run")
    assert evaluation.state.is_completed(), evaluation.state.message
    again = run_deployment("eval-sweeper/hourly", parameters={"roots": [str(ROOT / "quiet-run")]},
                        timeout=300, poll_interval=1)
    assert again.state.is_completed()
    time.sleep(3)
    assert len([r for r in _runs("math500") if r.parameters.get("train_run") == "quiet-run"]) == 1


def test_the_sweeper_joins_the_evaluation_a_trainer_filed_under_another_name(triggers):
    """The trainer calls its job grpo-alias while its checkpoints sit under named-run/: a sweep while the event's
    evaluation is under way finds it (by the checkpoint's tag) and starts nothing as named-run."""
    ckpt = _checkpoint("named-run", 500)
    notifier = CheckpointNotifier(train_run="grpo-alias", api_url=triggers.settings.prefect_api_url,
                                  benchmarks=["math500"], spool_dir=ROOT.parent / "spool-named")
    notifier.notify(ckpt, step=500)
    [first] = _wait_for(lambda: [r for r in _runs("math500") if r.parameters.get("train_run") == "grpo-alias"],
                        timeout=120, every=0.5)
    # The sweep runs in this process, with the deployment's settings, so that it looks while the evaluation is under
    # way: a deployment run's start (a worker's poll, a process, imports) can take as long as this small evaluation,
    # which then is found finished instead (CI saw it once). The deployment path is the other sweeper tests'.
    from flows.sweeper_flow import eval_sweeper

    swept = eval_sweeper(roots=[str(ROOT / "named-run")], benchmarks=["math500"], eval_overrides=SMALL)
    assert swept["already_evaluated"] == 0, "the evaluation finished before the sweep: nothing was joined"
    assert [s["flow_run_id"] for s in swept["started"]] == [str(first.id)]
    assert _final_run_for("math500", lambda r: r.id == first.id).state.is_completed()
    assert not [r for r in _runs("math500") if r.parameters.get("train_run") == "named-run"]


def test_sweeper_evaluates_again_with_other_settings(triggers):
    """"Already evaluated" means: with these settings. A sweep with another limit evaluates the checkpoint again; the
    same sweep repeated does not."""
    _checkpoint("resweep-run", 310)
    params = {"roots": [str(ROOT / "resweep-run")]}

    def evals():
        return [r for r in _runs("math500") if r.parameters.get("train_run") == "resweep-run"]

    for overrides, expected in ((SMALL, 1), ({**SMALL, "limit": 1}, 2), ({**SMALL, "limit": 1}, 2)):
        fr = run_deployment("eval-sweeper/hourly", parameters={**params, "eval_overrides": overrides},
                            timeout=300, poll_interval=1)
        assert fr.state.is_completed(), fr.state.message
        _wait_for(lambda: len(evals()) == expected and all(r.state.is_final() for r in evals()), timeout=300)
    time.sleep(3)
    assert sorted(r.parameters["limit"] for r in evals()) == [1, 2]
    assert all(r.state.is_completed() for r in evals())


def test_prefect_server_restart_loses_no_event(triggers):
    """The real server goes down while the trainer notifies; after `evaldag up` restarts it, the spooled event is
    delivered and evaluated. It and the tests after it restart the shared stack's server."""
    import psutil

    from evaldag.runtime.stack import PREFECT_SERVER

    ckpt = _checkpoint("restart-run", 400)
    spool = ROOT.parent / "spool-d"
    notifier = CheckpointNotifier(train_run="restart-run", api_url=triggers.settings.prefect_api_url,
                                  benchmarks=["math500"], spool_dir=spool, max_block_s=2.0)
    [server] = [s for s in triggers.status() if s.component == PREFECT_SERVER]
    psutil.Process(server.pid).terminate()
    _wait_for(lambda: not any(s.healthy for s in triggers.status() if s.component == PREFECT_SERVER), timeout=60)
    notifier.notify(ckpt, step=400)
    assert len(notifier.pending()) == 1
    triggers.up(deploy=False)                      # restarts the dead server, keeps the rest
    assert notifier.flush() == 1 and notifier.pending() == []
    evaluation = _final_run_for("math500", lambda r: r.parameters.get("train_run") == "restart-run")
    assert evaluation.state.is_completed(), evaluation.state.message



def _stop_right_after_accepting(triggers, run: str, step: int, how: str) -> Path:
    """Notify the live server, which answers 204 (delivered: the trainer forgets the event), and stop the server at
    once: `terminate` (a restart: SIGTERM, graceful) or `kill` (a crash: SIGKILL to its process group). Then
    `evaldag up` brings it back. Returns the checkpoint."""
    import psutil

    from evaldag.runtime.stack import PREFECT_SERVER

    ckpt = _checkpoint(run, step)
    notifier = CheckpointNotifier(train_run=run, api_url=triggers.settings.prefect_api_url, benchmarks=["math500"],
                                  spool_dir=ROOT.parent / f"spool-{run}", max_block_s=2.0)
    [server] = [s for s in triggers.status() if s.component == PREFECT_SERVER]
    process = psutil.Process(server.pid)
    notifier.notify(ckpt, step=step)
    if how == "kill":
        os.killpg(process.pid, signal.SIGKILL)
    else:
        process.terminate()
    assert notifier.pending() == []                # delivered: the trainer will not send it again
    process.wait(60)                               # gone, not just unhealthy: `up` must start a new one
    triggers.up(deploy=False)
    return ckpt


@pytest.mark.parametrize("how", ["terminate", "kill"], ids=["graceful-restart", "crash"])
def test_server_stopped_right_after_accepting_an_event_is_recovered_by_the_sweeper(triggers, how):
    """A server stopped within milliseconds of the 204 (a graceful restart, SIGTERM, or a crash, SIGKILL to its
    process group) can lose the event: Prefect keeps accepted events in its in-memory broker until its trigger
    service has handled them, and the trainer does not send a delivered event again (on a slow CI box even the
    graceful restart lost it). The sweeper is the net: after the restart it evaluates the checkpoint, once (if the
    event survived after all, both share the evaluation's idempotency key)."""
    run, step = {"terminate": ("accepted-run", 500), "kill": ("crashed-run", 600)}[how]
    ckpt = _stop_right_after_accepting(triggers, run, step, how)
    time.sleep(5)                                  # what survived the stop has had time to start
    fr = run_deployment("eval-sweeper/hourly", parameters={"roots": [str(ckpt.parent)]}, timeout=300,
                        poll_interval=1)
    assert fr.state.is_completed(), fr.state.message
    evaluation = _final_run_for("math500", lambda r: r.parameters.get("train_run") == run)
    assert evaluation.state.is_completed(), evaluation.state.message
    time.sleep(3)                                  # a late trigger run would show up here
    assert len([r for r in _runs("math500") if r.parameters.get("train_run") == run]) == 1
    # which path started the one evaluation, asserted for each: the sweeper when the event was lost; when the event
    # survived, whichever came first, and the other must have asked for it too (start-evaluation, answered with the
    # same run: one idempotency key). A sweeper that starts nothing fails here, unless the event's evaluation had
    # finished before the sweep began (then the sweeper rightly counts it as evaluated).
    _wait_for(lambda: all(r.state and r.state.is_final() for r in _event_runs(ckpt)), timeout=300)
    events = _event_runs(ckpt)
    assert all(r.state.is_completed() for r in events), [r.state for r in events]
    starter = _started_by(evaluation)
    path = "sweeper" if starter == fr.id else "event" if starter in {r.id for r in events} else None
    print(f"the stopped server ({how}) lost the accepted event: {not events}; evaluation started by the {path}")
    assert path is not None, f"the evaluation was started by flow run {starter}, neither the sweeper nor the event"
    swept = _started_evaluations(fr.id)
    if path == "sweeper":
        assert len(swept) == 1, swept
        assert all(len(_started_evaluations(r.id)) == 1 for r in events)   # a late event asked and joined it
    else:
        # the sweeper counts a checkpoint evaluated once its MLflow run is finished, which the track task does a
        # moment before the evaluation's flow run ends: a sweep that looked in between rightly started nothing, and
        # one that started nothing must have been able to see the finished run
        exp = MlflowClient().get_experiment_by_name(experiment_name("math500"))
        [tracked] = MlflowClient().search_runs([exp.experiment_id], filter_string=f"tags.train_run = '{run}'")
        seen = tracked.info.status == "FINISHED" and tracked.info.end_time / 1000 <= fr.end_time.timestamp()
        assert len(swept) == 1 or (not swept and seen), (swept, tracked.info.status, tracked.info.end_time, fr.end_time)


def _started_evaluations(flow_run_id) -> list:
    """The completed start-evaluation task runs of flow run `flow_run_id` (each started or joined one evaluation)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def go():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [t for t in asyncio.run(go()) if t.name.startswith("start-evaluation") and t.state.is_completed()]


def _started_by(flow_run) -> object:
    """The flow run whose task started `flow_run` (run_deployment inside a task links the run it creates to it)."""
    async def go():
        async with get_client() as client:
            return (await client.read_task_run(flow_run.parent_task_run_id)).flow_run_id
    assert flow_run.parent_task_run_id is not None, f"{flow_run.name} was not started from a flow"
    return asyncio.run(go())

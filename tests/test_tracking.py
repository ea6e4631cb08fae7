"""MLflow tracking against a real MLflow server (SQLite backend, the local stack's setup), without the Prefect stack:
one run per evaluation however many processes track it at once, a writer lease so that a live writer is never
joined, and job histories that compare like with like."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from conftest import complete_checkpoint, free_ports

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free port; MLFLOW_TRACKING_URI points at it for this module."""
    import httpx

    home = tmp_path_factory.mktemp("mlflow")
    (port,) = free_ports(1)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                             f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination", str(home / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=open(home / "log", "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"mlflow server did not start: {(home / 'log').read_text()[-2000:]}")
            time.sleep(0.5)
        old = os.environ.get("MLFLOW_TRACKING_URI")
        os.environ["MLFLOW_TRACKING_URI"] = url
        yield url
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def _finished_plan(tmp_path: Path, step: int, train_run: str, **request) -> str:
    """A resolved plan with its samples.parquet and metrics.json in the result store, as reduce leaves them; returns
    the plan.json path. The metrics are made up: tracking logs what it is given."""
    from evaldag.request.plan import EvalRequest, resolve

    ckpt = complete_checkpoint(tmp_path / "ckpts" / train_run / f"checkpoint-{step}")
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), step=step, limit=2, num_shards=1,
                               train_run=train_run, **request), tmp_path / "results")
    pl.DataFrame({"sample_id": ["a", "b"], "correct": [True, False]}).write_parquet(plan.path("samples.parquet"))
    plan.path("metrics.json").write_text(json.dumps(_metrics(0.5, 0.5)))
    return str(plan.path("plan.json"))


def _metrics(accuracy: float, reward: float, n: int = 2) -> dict:
    return {"accuracy": accuracy, "reward/mean": reward, "reward/std": 0.5, "n_samples": float(n)}


def _track_in_process(plan_path: str, flow_run_id: str, barrier, results, uri: str) -> None:
    """One evaluation's track task in its own process, released together with the others by the barrier."""
    os.environ["MLFLOW_TRACKING_URI"] = uri      # importing conftest here dropped it
    from evaldag.request.plan import load_plan
    from evaldag.tracking.write import track

    plan = load_plan(plan_path)
    barrier.wait()
    run = track(plan, _metrics(0.5, 0.5), flow_run_id=flow_run_id)
    results.put((run.run_id, run.created))


def _runs(eval_key: str) -> list:
    from mlflow import MlflowClient

    from evaldag.tracking.names import experiment_name

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("aime24"))
    return client.search_runs([exp.experiment_id], filter_string=f"tags.eval_key = '{eval_key}'")


def test_concurrent_tracks_of_one_evaluation_make_one_run(mlflow_server, configs, tmp_path):
    """Four processes track the same evaluation at the same moment (twins that finished together): they agree on
    one MLflow run, exactly one of them creates it, and no second run appears. Three evaluations, to give a race
    every chance."""
    from evaldag.request.plan import load_plan

    ctx = multiprocessing.get_context("spawn")
    for step in (10, 20, 30):
        plan_path = _finished_plan(tmp_path, step, "race-run")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_track_in_process, args=(plan_path, f"flow-run-{i}", barrier, results,
                                                             mlflow_server))
                 for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        got = [results.get(timeout=5) for _ in procs]
        assert len({run_id for run_id, _ in got}) == 1, got
        assert sum(created for _, created in got) == 1, got
        runs = _runs(load_plan(plan_path).eval_key)
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # and the training job has one parent run, whatever raced for it
    from mlflow import MlflowClient

    from evaldag.tracking.names import JOBS_EXPERIMENT

    client = MlflowClient()
    jobs = client.get_experiment_by_name(JOBS_EXPERIMENT)
    assert len(client.search_runs([jobs.experiment_id], filter_string="tags.train_run = 'race-run'")) == 1


def test_a_recomputation_with_other_results_is_flagged_on_the_run_it_keeps(mlflow_server, configs, tmp_path):
    """One run per evaluation: a later computation of it (stored outputs lost) does not overwrite the logged
    results; new timings alone change nothing, other results are flagged on the run, naming them and who found
    them."""
    from evaldag.request.plan import load_plan
    from evaldag.tracking.names import DIFFERS_TAG
    from evaldag.tracking.write import track

    plan = load_plan(_finished_plan(tmp_path, 40, "recompute-run"))
    first = {**_metrics(0.5, 0.5), "generation_s": 10.0, "cache_hit_rate": 0.0}
    logged = track(plan, first, flow_run_id="first-flow-run")
    assert logged.created

    again = track(plan, {**first, "generation_s": 7.5, "reduce_s": 0.2}, flow_run_id="second-flow-run")
    [run] = _runs(plan.eval_key)
    assert (again.run_id, again.created) == (logged.run_id, False)
    assert DIFFERS_TAG not in run.data.tags, run.data.tags        # only the timings changed
    assert run.data.metrics["generation_s"] == 10.0 and run.data.tags["prefect.flow_run_id"] == "first-flow-run"

    track(plan, {**first, "accuracy": 0.0}, flow_run_id="third-flow-run")
    [run] = _runs(plan.eval_key)
    assert run.data.tags[DIFFERS_TAG] == "third-flow-run: accuracy", run.data.tags
    assert run.data.metrics["accuracy"] == 0.5                      # the logged results stay as they were


def test_a_live_writer_is_waited_for_and_a_dead_one_is_taken_over(mlflow_server, configs, tmp_path):
    """A RUNNING run whose writer is alive (fresh heartbeat) is not written into by another evaluation: that one
    waits and gives up with a retryable error; once the writer's lease has expired, its run is taken over and
    finished; the writer's own retry (same flow run) resumes at once."""
    from mlflow import MlflowClient

    from evaldag.request.plan import load_plan
    from evaldag.tracking.run_claims import HEARTBEAT_TAG, TrackingBusy, claim_run, take_writer
    from evaldag.tracking.names import experiment_name
    from evaldag.tracking.parent_runs import ensure_experiment
    from evaldag.tracking.write import track

    plan = load_plan(_finished_plan(tmp_path, 40, "lease-run"))
    client = MlflowClient()
    exp_id = ensure_experiment(client, experiment_name("aime24"))
    run_id, created = claim_run(client, exp_id, plan.eval_key, lambda: client.create_run(exp_id).info.run_id)
    assert created
    assert take_writer(client, run_id, "flow-run-A", lease_s=60)                  # A is writing...
    t0 = time.monotonic()
    with pytest.raises(TrackingBusy, match="flow-run-A"):
        track(plan, _metrics(0.5, 0.5), flow_run_id="flow-run-B", lease_s=60, wait_s=3)
    assert 3 <= time.monotonic() - t0 < 30
    assert "accuracy" not in client.get_run(run_id).data.metrics                    # B wrote nothing
    resumed = track(plan, _metrics(0.5, 0.5), flow_run_id="flow-run-A", lease_s=60, wait_s=3)
    assert resumed.run_id == run_id and client.get_run(run_id).info.status == "FINISHED"

    # a dead writer: its heartbeat is older than the lease
    plan2 = load_plan(_finished_plan(tmp_path, 50, "lease-run"))
    run2, _ = claim_run(client, exp_id, plan2.eval_key, lambda: client.create_run(exp_id).info.run_id)
    assert take_writer(client, run2, "flow-run-dead", lease_s=60)
    client.set_tag(run2, HEARTBEAT_TAG, f"0:{time.time() - 3600}")               # generation 0, an hour ago
    taken = track(plan2, _metrics(0.5, 0.5), flow_run_id="flow-run-C", lease_s=60, wait_s=3)
    assert taken.run_id == run2 and client.get_run(run2).info.status == "FINISHED"
    assert len(_runs(plan2.eval_key)) == 1


def test_job_history_compares_like_with_like(mlflow_server, configs, tmp_path):
    """A job evaluated at steps 100 and 300 with the benchmark's settings and at step 200 with a sampled slice:
    the slice is not part of the others' history (nor they of its), each diagnostic says what it compared, and the
    parent run keeps one curve per kind of evaluation."""
    from mlflow import MlflowClient

    from evaldag.request.plan import load_plan
    from evaldag.tracking.names import JOBS_EXPERIMENT
    from evaldag.tracking.write import track

    sampled = {"sampling": {"n": 2, "temperature": 0.6}}
    runs = {}
    for step, request, accuracy in ((100, {}, 0.5), (200, sampled, 1.0), (300, {}, 0.5)):
        plan = load_plan(_finished_plan(tmp_path, step, "mix-run", **request))
        runs[step] = track(plan, _metrics(accuracy, accuracy, n=2 * (1 + bool(request))), flow_run_id=f"fr-{step}")

    def diag(step, name):
        return next(d for d in runs[step].diagnostics if d.name == name)

    alone = diag(200, "reward_fluctuation")
    assert not alone.fired and "1 so far" in alone.explanation          # nothing else was evaluated like it
    assert "n=2" in alone.details["compared"] and "temperature 0.6" in alone.details["compared"]
    pair = diag(300, "reward_fluctuation")
    assert [(j["step_from"], j["step_to"]) for j in pair.details["jumps"]] == [(100, 300)]
    assert "greedy" in pair.details["compared"] and "greedy" in pair.explanation

    client = MlflowClient()
    jobs = client.get_experiment_by_name(JOBS_EXPERIMENT)
    [parent] = client.search_runs([jobs.experiment_id], filter_string="tags.train_run = 'mix-run'")
    curves = {k: sorted(m.step for m in client.get_metric_history(parent.info.run_id, k))
              for k in parent.data.metrics if k.endswith("/accuracy")}
    # (these plans evaluate 2 problems: a slice, named as such)
    assert curves == {"aime24.limit2/accuracy": [100, 300], "aime24.limit2.n2.t0.6/accuracy": [200]}


def test_loading_the_evaluation_flow_does_not_import_mlflow():
    """MLflow's client is 2-3 s of imports: an evaluation flow run loads it while its shards run
    (evaldag.tracking.client.preload), not before it can start them."""
    code = ("import sys, flows.eval_flow, flows.shard_flow, flows.checkpoint_flow; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'mlflow'], 'mlflow imported'; "
            "from evaldag.tracking.client import preload; preload(); assert 'mlflow.entities' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]


class _FlakyGetRun:
    """An MlflowClient whose get_run first fails with the given errors (a 503, a timeout: what an overloaded or
    restarting tracking server answers), then answers again."""

    def __init__(self, client, errors: list[Exception]):
        self._client = client
        self.errors = list(errors)

    def get_run(self, run_id: str):
        if self.errors:
            raise self.errors.pop(0)
        return self._client.get_run(run_id)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def _transient_errors() -> list[Exception]:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    return [MlflowException("API request to endpoint /api/2.0/mlflow/runs/get failed with error code 503 != 200. "
                            "Response body: ''", error_code=TEMPORARILY_UNAVAILABLE),
            MlflowException("API request to /api/2.0/mlflow/runs/get failed with timeout exception Read timed out.")]


def test_a_transient_mlflow_error_makes_no_second_run(mlflow_server, configs, tmp_path, monkeypatch):
    """A 503 or a timeout while reading the claimed run is not "the run was deleted": a second track of a logged
    evaluation finds its one run, and the job keeps one parent run (one curve). Only MLflow's own "does not exist"
    passes a claim on to a new run."""
    from mlflow import MlflowClient

    from evaldag.tracking import run_claims
    from evaldag.request.plan import load_plan
    from evaldag.tracking import client as tracking_client
    from evaldag.tracking.names import JOBS_EXPERIMENT, experiment_name
    from evaldag.tracking.parent_runs import ensure_experiment, parent_run
    from evaldag.tracking.write import track

    monkeypatch.setattr(run_claims, "ALIVE_BACKOFF_S", 0.01, raising=False)
    client = MlflowClient()
    plan = load_plan(_finished_plan(tmp_path, 80, "flaky-run"))
    first = track(plan, _metrics(0.5, 0.5), flow_run_id="flow-run-1")
    parent = parent_run(client, "flaky-run")

    monkeypatch.setattr(tracking_client, "mlflow_client", lambda: _FlakyGetRun(client, _transient_errors()))
    again = track(plan, _metrics(0.5, 0.5), flow_run_id="flow-run-2")
    assert (again.run_id, again.created) == (first.run_id, False)
    assert [r.info.run_id for r in _runs(plan.eval_key)] == [first.run_id]
    assert parent_run(_FlakyGetRun(client, _transient_errors()), "flaky-run") == parent
    jobs = client.get_experiment_by_name(JOBS_EXPERIMENT)
    assert len(client.search_runs([jobs.experiment_id], filter_string="tags.train_run = 'flaky-run'")) == 1

    # a claim naming a run the server does not have (removed for good): the next generation claims a new run
    exp_id = ensure_experiment(client, experiment_name("aime24"))
    client.create_experiment(run_claims.claim_name(exp_id, "ghost-key"), tags={run_claims.RUN_ID_TAG: "0" * 32})
    run_id, created = run_claims.claim_run(client, exp_id, "ghost-key", lambda: client.create_run(exp_id).info.run_id)
    assert created and run_id != "0" * 32


def test_a_writer_uploading_longer_than_the_lease_keeps_its_run(mlflow_server, configs, tmp_path, monkeypatch):
    """The writer's heartbeat goes on while it uploads artifacts: a contender that tries to take the run over in
    the middle of an upload longer than the lease is refused, and the writer finishes its run."""
    import threading

    from mlflow import MlflowClient

    from evaldag.request.plan import load_plan
    from evaldag.tracking.run_claims import current_writer, take_writer
    from evaldag.tracking.write import track

    lease_s = 2.0
    plan = load_plan(_finished_plan(tmp_path, 90, "upload-run"))
    real_upload = MlflowClient.log_artifact
    uploading, tried = threading.Event(), threading.Event()
    contender: dict = {}

    def slow_upload(self, run_id, local_path, artifact_path=None):
        if artifact_path == "samples":          # a large parquet over a slow link: longer than the lease
            contender["run_id"] = run_id
            uploading.set()
            assert tried.wait(60)
        return real_upload(self, run_id, local_path, artifact_path)

    def take_over() -> None:
        try:
            assert uploading.wait(120)
            time.sleep(lease_s * 1.5)           # the beat before the upload is older than the lease by now
            contender["took"] = take_writer(MlflowClient(), contender["run_id"], "contender", lease_s)
        finally:
            tried.set()

    monkeypatch.setattr(MlflowClient, "log_artifact", slow_upload)
    thread = threading.Thread(target=take_over, daemon=True)
    thread.start()
    run = track(plan, _metrics(0.5, 0.5), flow_run_id="slow-writer", lease_s=lease_s)
    thread.join(10)
    assert contender.get("took") is False
    logged = MlflowClient().get_run(run.run_id)
    assert run.created and logged.info.status == "FINISHED"
    assert current_writer(logged) == (0, "slow-writer")


def test_sync_finishing_a_dead_writers_run_keeps_its_flow_run_id(mlflow_server, configs, tmp_path, monkeypatch):
    """`evaldag sync` takes over a run whose writer died half-way and finishes it; the run still names the flow run
    that computed it (sync has none of its own to put there)."""
    from mlflow import MlflowClient

    from evaldag.pipeline import faults
    from evaldag.request.plan import load_plan
    from evaldag.tracking.run_claims import HEARTBEAT_TAG
    from evaldag.tracking.sync import sync
    from evaldag.tracking.write import track

    plan = load_plan(_finished_plan(tmp_path, 100, "sync-run"))

    def die(point: str) -> None:
        if point == "track":
            raise RuntimeError("the track task's process died half-way")

    monkeypatch.setattr(faults, "maybe_fail", die)
    with pytest.raises(RuntimeError, match="half-way"):
        track(plan, _metrics(0.5, 0.5), flow_run_id="flow-run-A")
    monkeypatch.setattr(faults, "maybe_fail", lambda point: None)
    [run] = _runs(plan.eval_key)
    assert run.info.status == "RUNNING" and run.data.tags["prefect.flow_run_id"] == "flow-run-A"
    MlflowClient().set_tag(run.info.run_id, HEARTBEAT_TAG, f"0:{time.time() - 3600}")   # long dead

    [synced] = sync(tmp_path / "results")
    [run] = _runs(plan.eval_key)
    assert synced.run_id == run.info.run_id                     # the dead writer's run, finished: no second one
    assert run.info.status == "FINISHED" and run.data.tags["prefect.flow_run_id"] == "flow-run-A"


# ---- paired verdicts at track time (evaldag.decisions.verdicts.job_verdicts, logged by track)

def _verdict_plan(tmp_path: Path, step: int, train_run: str, solved: int, limit: int = 100, **request):
    """A finished MATH-500 evaluation of `limit` problems (n = 1) whose first `solved` problems (in id order) are
    correct: a higher `solved` solves a superset of a lower one's problems. Returns the plan and its metrics."""
    from evaldag.request.plan import EvalRequest, resolve

    ckpt = complete_checkpoint(tmp_path / "ckpts" / train_run / f"checkpoint-{step}")
    plan = resolve(EvalRequest(benchmark="math500", checkpoint=str(ckpt), step=step, limit=limit, num_shards=1,
                               train_run=train_run, **request), tmp_path / "results")
    ids = sorted(s for shard in plan.shards for s in shard)
    assert len(ids) == limit
    correct = [i < solved for i in range(limit)]
    pl.DataFrame({"sample_id": ids, "sample_index": 0, "correct": correct}).write_parquet(plan.path("samples.parquet"))
    metrics = _metrics(solved / limit, solved / limit)
    plan.path("metrics.json").write_text(json.dumps(metrics))
    return plan, metrics


def _logged(run_id: str):
    from mlflow import MlflowClient

    return MlflowClient().get_run(run_id).data


def _verdict_tags(data) -> dict[str, str]:
    return {k: v for k, v in data.tags.items() if k.startswith("verdict.")}


def test_each_evaluation_is_paired_with_the_jobs_previous_best_and_baseline(mlflow_server, configs, tmp_path,
                                                                          monkeypatch):
    """Steps 1 and 2 of one job on the same 100 problems, step 2 solving 30 more: step 2's run says `better` than
    the previous (and best) checkpoint, with the difference, its interval and p-value as metrics. Step 3 with the
    very same samples is `equivalent` at margin 0.06 (d = 0 on every problem: the t interval is [0, 0]; the
    rare-difference bound of 100 agreeing problems is +-0.038 against one, 0.047 above against the best of two: at
    0.02 both would be `undecided`, paired.rare_within_margin).
    A quick slice (another comparison key) is paired with nothing, nor is anything paired with it; a baseline named in
    the request is compared too."""
    from evaldag.decisions import verdicts
    from evaldag.decisions.series import comparison_key
    from evaldag.tracking.write import track

    monkeypatch.setenv(verdicts.MARGIN_ENV, "0.06")

    job = "verdict-run"
    plan1, m1 = _verdict_plan(tmp_path, 1, job, solved=40)
    first = track(plan1, m1, flow_run_id="fr-1")
    assert _verdict_tags(_logged(first.run_id)) == {}                 # nothing before the first checkpoint

    plan2, m2 = _verdict_plan(tmp_path, 2, job, solved=70)
    second = _logged(track(plan2, m2, flow_run_id="fr-2").run_id)
    assert second.tags["verdict.vs_previous"] == "better" and second.tags["verdict.vs_best"] == "better"
    assert second.tags["verdict.vs_previous.other"] == f"{job}@1" == second.tags["verdict.vs_best.other"]
    assert second.metrics["verdict.vs_previous.diff"] == pytest.approx(0.30)
    assert 0 < second.metrics["verdict.vs_previous.ci_low"] < 0.30 < second.metrics["verdict.vs_previous.ci_high"]
    assert second.metrics["verdict.vs_previous.p_value"] < 1e-6       # 30 problems gained, none lost: 2 / 2^30
    assert second.metrics["verdict.vs_previous.n_problems"] == 100
    assert "verdict.vs_baseline" not in second.tags                  # none asked for

    plan3, m3 = _verdict_plan(tmp_path, 3, job, solved=70)
    third = _logged(track(plan3, m3, flow_run_id="fr-3").run_id)
    assert third.tags["verdict.vs_previous"] == "equivalent" and third.tags["verdict.vs_previous.other"] == f"{job}@2"
    assert third.tags["verdict.vs_best"] == "equivalent" and third.tags["verdict.vs_best.other"] == f"{job}@2"
    assert third.metrics["verdict.vs_previous.diff"] == 0.0 and third.metrics["verdict.vs_previous.p_value"] == 1.0

    # a 50-problem slice at step 4 measures something else: no verdicts for it, and it is nobody's previous/best
    plan4, m4 = _verdict_plan(tmp_path, 4, job, solved=50, limit=50)
    assert comparison_key(plan4) != comparison_key(plan3)
    assert _verdict_tags(_logged(track(plan4, m4, flow_run_id="fr-4").run_id)) == {}
    plan5, m5 = _verdict_plan(tmp_path, 5, job, solved=20, baseline=f"{job}@1")
    fifth = _logged(track(plan5, m5, flow_run_id="fr-5").run_id)
    assert fifth.tags["verdict.vs_previous.other"] == f"{job}@3" and fifth.tags["verdict.vs_previous"] == "worse"
    assert fifth.tags["verdict.vs_best.other"] == f"{job}@2"          # highest accuracy; tie -> earlier step
    assert fifth.tags["verdict.vs_baseline"] == "worse" and fifth.tags["verdict.vs_baseline.other"] == f"{job}@1"
    assert fifth.metrics["verdict.vs_baseline.diff"] == pytest.approx(-0.20)


class _FailingVerdictLookup:
    """An MlflowClient that fails (a 503) where the verdicts look up the job's earlier evaluations (`search` of
    kind ckpt_eval runs) or download their samples (`download`), and works everywhere else."""

    def __init__(self, client, where: str):
        self._client, self.where, self.failed = client, where, 0

    def _fail(self):
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

        self.failed += 1
        raise MlflowException("API request failed with error code 503 != 200", error_code=TEMPORARILY_UNAVAILABLE)

    def search_runs(self, experiment_ids, filter_string="", *args, **kwargs):
        if self.where == "search" and "ckpt_eval" in filter_string:
            self._fail()
        return self._client.search_runs(experiment_ids, filter_string, *args, **kwargs)

    def download_artifacts(self, *args, **kwargs):
        if self.where == "download":
            self._fail()
        return self._client.download_artifacts(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


@pytest.mark.parametrize("where", ["search", "download"])
def test_a_failed_verdict_lookup_leaves_tracking_successful(mlflow_server, configs, tmp_path, monkeypatch, caplog,
                                                            where):
    """MLflow failing while the verdicts search the job's earlier evaluations, or download their samples: the run
    is still logged whole and finished (metrics, tags, artifacts), without verdict tags, and a warning says why."""
    import logging

    from mlflow import MlflowClient

    from evaldag.tracking import client as tracking_client
    from evaldag.tracking.write import track

    job = f"flaky-verdict-{where}"
    plan1, m1 = _verdict_plan(tmp_path, 1, job, solved=40)
    track(plan1, m1, flow_run_id="fr-1")
    failing = _FailingVerdictLookup(MlflowClient(), where)
    monkeypatch.setattr(tracking_client, "mlflow_client", lambda: failing)
    plan2, m2 = _verdict_plan(tmp_path, 2, job, solved=70)
    with caplog.at_level(logging.WARNING, logger="evaldag"):
        run = track(plan2, m2, flow_run_id="fr-2")
    assert failing.failed >= 1                                         # the lookup was tried, and failed
    assert run.created and MlflowClient().get_run(run.run_id).info.status == "FINISHED"
    data = _logged(run.run_id)
    assert data.metrics["accuracy"] == 0.7 and data.tags["train_run"] == job
    assert _verdict_tags(data) == {}
    assert "samples/samples.parquet" in [a.path for a in MlflowClient().list_artifacts(run.run_id, "samples")]
    assert any("no paired verdicts" in r.getMessage() and "503" in r.getMessage() for r in caplog.records)


# ---- the parent run a trainer names (untrusted input): deleted, an evaluation's, claimed by two jobs, a 503 -------

def _track_naming(tmp_path: Path, job: str, step: int, parent: str):
    """Track `job`'s checkpoint at `step` with a request that names `parent` as the job's parent run; returns the
    evaluation's run as MLflow holds it after."""
    from mlflow import MlflowClient

    from evaldag.request.plan import load_plan
    from evaldag.tracking.write import track

    plan = load_plan(_finished_plan(tmp_path, step, job, mlflow_parent_run_id=parent))
    return MlflowClient().get_run(track(plan, _metrics(0.5, 0.5), flow_run_id=f"fr-{job}-{step}").run_id)


@pytest.mark.parametrize("claimed_before", [True, False], ids=["claimed-then-deleted", "deleted-unclaimed"])
def test_a_deleted_parent_run_falls_back_to_the_jobs_own_and_says_so(mlflow_server, configs, tmp_path,
                                                                    claimed_before):
    """A user deletes the trainer's MLflow run while the trainer keeps naming it: MLflow still returns the run
    (lifecycle "deleted") and refuses every write to it, so a track that takes it fails on every retry. The
    evaluation is logged all the same, its curve in the job's own parent run, and its run says why."""
    from mlflow import MlflowClient

    from evaldag.tracking.parent_runs import PARENT_REFUSED_TAG

    client = MlflowClient()
    job = f"deleted-parent-{claimed_before}".lower()
    trainer = client.create_run(client.create_experiment(f"trainer-{job}")).info.run_id
    if claimed_before:
        assert _track_naming(tmp_path, job, 100, trainer).data.tags["evaldag.parent_run_id"] == trainer
    client.delete_run(trainer)
    run = _track_naming(tmp_path, job, 200, trainer)
    assert run.info.status == "FINISHED"
    parent = run.data.tags["evaldag.parent_run_id"]
    assert parent != trainer and client.get_run(parent).data.tags["train_run"] == job
    assert f"{trainer}: the run is deleted" in run.data.tags[PARENT_REFUSED_TAG]
    assert [m.step for m in client.get_metric_history(parent, "aime24.limit2/accuracy")] == [200]


def test_an_evaluation_run_of_the_same_job_is_not_its_parent_run(mlflow_server, configs, tmp_path):
    """An event naming one of the job's own evaluation runs (kind ckpt_eval, tagged with the job) as the parent: the
    curve goes to the job's parent run, not into that evaluation's run."""
    from mlflow import MlflowClient

    from evaldag.tracking.parent_runs import PARENT_REFUSED_TAG

    client = MlflowClient()
    evaluation = _track_naming(tmp_path, "kind-job", 100, None)
    run = _track_naming(tmp_path, "kind-job", 200, evaluation.info.run_id)
    parent = run.data.tags["evaldag.parent_run_id"]
    assert parent != evaluation.info.run_id and client.get_run(parent).data.tags["kind"] == "train_job"
    assert "ckpt_eval run" in run.data.tags[PARENT_REFUSED_TAG]
    assert not [k for k in client.get_run(evaluation.info.run_id).data.metrics if k.startswith("aime24.")]


class _ReadTogether:
    """A real MlflowClient for one of several jobs claiming one run at once: every job reads the run before any of
    them writes (a barrier after each one's first get_run), then, with `after` given, this job waits until `after`
    is set (the job before it finished claiming and reading back) before it writes anything. The interleaving under
    which a claim by writing a tag and reading it back lets two jobs both win."""

    def __init__(self, client, barrier, after=None):
        self._client, self.barrier, self.after, self.reads = client, barrier, after, 0

    def get_run(self, run_id: str):
        run = self._client.get_run(run_id)
        self.reads += 1
        if self.reads == 1:
            self.barrier.wait(timeout=60)
            if self.after is not None:
                assert self.after.wait(timeout=60)
        return run

    def __getattr__(self, name: str):
        return getattr(self._client, name)


@pytest.mark.parametrize("order", ["one-after-the-other", "free"])
def test_two_jobs_claiming_one_trainer_run_at_once_one_wins(mlflow_server, order):
    """Jobs whose events name the same untagged trainer run claim it at the same moment: exactly one gets it, the
    others their own parent runs, and the run says whose it is. `one-after-the-other`: both read the run untagged,
    then one claims (and reads back) completely before the other writes; `free`: four jobs released together."""
    import threading

    from mlflow import MlflowClient

    from evaldag.tracking.parent_runs import CLAIM_PARAM, job_parent_run

    client = MlflowClient()
    trainer = client.create_run(client.create_experiment(f"trainer-claims-{order}")).info.run_id
    jobs = [f"claim-{order}-{i}" for i in range(2 if order == "one-after-the-other" else 4)]
    barrier = threading.Barrier(len(jobs))
    finished = {job: threading.Event() for job in jobs}
    chosen, errors = {}, []

    def claim(i: int, job: str) -> None:
        after = finished[jobs[i - 1]] if order == "one-after-the-other" and i else None
        try:
            chosen[job] = job_parent_run(_ReadTogether(MlflowClient(), barrier, after), job, trainer)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            finished[job].set()

    threads = [threading.Thread(target=claim, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    winners = [job for job, p in chosen.items() if p.run_id == trainer]
    assert len(winners) == 1, {job: p.run_id for job, p in chosen.items()}
    run = client.get_run(trainer)
    assert run.data.params[CLAIM_PARAM] == run.data.tags["train_run"] == winners[0]
    for job in set(jobs) - set(winners):
        assert chosen[job].refused and f"job {winners[0]!r}'s run" in chosen[job].refused
        assert client.get_run(chosen[job].run_id).data.tags["train_run"] == job


class _FailingProxy:
    """A real HTTP server in front of the MLflow server that answers 503 (an overloaded or restarting server behind
    a load balancer) to every read of the runs in `failing`, and passes everything else through."""

    def __init__(self, upstream: str, failing: set[str]):
        import http.server
        import threading
        import urllib.error
        import urllib.request

        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if "/runs/get" in self.path and any(run_id in self.path for run_id in proxy.failing):
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                req = urllib.request.Request(upstream + self.path, data=body or None, method=self.command,
                                             headers={"Content-Type": self.headers.get("Content-Type", "")})
                try:
                    with urllib.request.urlopen(req, timeout=30) as r:
                        status, data, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
                except urllib.error.HTTPError as e:
                    status, data, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = _forward

            def log_message(self, *args) -> None:
                pass

        self.failing = set(failing)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_503_reading_the_named_parent_run_is_retried_not_read_as_no_such_run(mlflow_server, monkeypatch):
    """The tracking server answers 503 when the trainer's run is read: that is not "no such run" (which would move
    the job's curve to a new parent run for good) but a failure the track task retries; once the server answers,
    the trainer's run gets the curve and the job has no second parent run."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from evaldag.tracking.names import JOBS_EXPERIMENT
    from evaldag.tracking.parent_runs import ParentRun, job_parent_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")     # the REST client's own backoff: minutes
    client = MlflowClient()
    trainer = client.create_run(client.create_experiment("trainer-503")).info.run_id
    proxy = _FailingProxy(mlflow_server, {trainer})
    try:
        with pytest.raises(MlflowException, match="503"):
            job_parent_run(MlflowClient(tracking_uri=proxy.url), "job-503", trainer)
    finally:
        proxy.close()
    jobs = client.get_experiment_by_name(JOBS_EXPERIMENT)
    assert jobs is None or not client.search_runs([jobs.experiment_id], "tags.train_run = 'job-503'")
    assert job_parent_run(client, "job-503", trainer) == ParentRun(trainer)

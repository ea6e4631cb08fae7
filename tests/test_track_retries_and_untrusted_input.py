"""Tracking retried and untrusted input, without a server (a local SQLite MLflow store): a retried track logs each
point once, a wrong parent run id from an event neither strands the run nor writes into another's run, `evaldag
sync` goes past an evaluation it cannot log; the sweeper and the event validator on symlinks and folder names."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from conftest import complete_checkpoint

# the fixtures: a copy of the configs a test may change, a SQLite MLflow store


def _plan(tmp_path: Path, step: int, train_run: str):
    from evaldag.request.plan import EvalRequest, resolve
    ckpt = complete_checkpoint(tmp_path / "ckpts" / train_run / f"checkpoint-{step}")
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), step=step, limit=2, num_shards=1,
                               train_run=train_run), tmp_path / "results")
    pl.DataFrame({"sample_id": ["a", "b"], "correct": [True, False]}).write_parquet(plan.path("samples.parquet"))
    plan.path("metrics.json").write_text(json.dumps(_metrics()))
    return plan


def _metrics():
    return {"accuracy": 0.5, "reward/mean": 0.5, "reward/std": 0.5, "n_samples": 2.0}


def test_retried_track_logs_each_metric_once_at_its_step(sqlite_mlflow, configs, tmp_path, monkeypatch):
    """A track task that died after logging metrics, retried by Prefect (same flow run), must not leave two
    points at the step (own run and the job's parent run)."""
    import time
    from mlflow import MlflowClient
    from evaldag.pipeline import faults
    from evaldag.tracking.write import track

    plan = _plan(tmp_path, 100, "retry-run")

    def die(point):
        if point == "track":
            raise RuntimeError("died half-way")

    monkeypatch.setattr(faults, "maybe_fail", die)
    with pytest.raises(RuntimeError):
        track(plan, _metrics(), flow_run_id="fr-A")
    time.sleep(0.01)
    monkeypatch.setattr(faults, "maybe_fail", lambda p: None)
    run = track(plan, _metrics(), flow_run_id="fr-A")
    client = MlflowClient()
    hist = client.get_metric_history(run.run_id, "accuracy")
    assert len(hist) == 1, [(m.step, m.timestamp, m.value) for m in hist]


def test_retry_after_artifact_failure_logs_parent_curve_once(sqlite_mlflow, configs, tmp_path, monkeypatch):
    """Died after the parent run got its headline point (e.g. in the artifact upload): the retry adds a second
    point at the same step to the job's parent curve."""
    from mlflow import MlflowClient
    from evaldag.tracking import write

    plan = _plan(tmp_path, 200, "retry-parent")
    real = write._log_artifacts
    calls = []

    def flaky(w, p):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("artifact store hiccup")
        return real(w, p)

    monkeypatch.setattr(write, "_log_artifacts", flaky)
    with pytest.raises(OSError):
        write.track(plan, _metrics(), flow_run_id="fr-B")
    run = write.track(plan, _metrics(), flow_run_id="fr-B")
    client = MlflowClient()
    parent = client.get_run(run.run_id).data.tags["evaldag.parent_run_id"]
    keys = [k for k in client.get_run(parent).data.metrics if k.endswith("/accuracy")]
    hist = client.get_metric_history(parent, keys[0])
    assert len(hist) == 1, [(m.step, m.timestamp) for m in hist]


def test_unknown_parent_run_id_from_event_does_not_strand_the_run(sqlite_mlflow, configs, tmp_path):
    """mlflow_parent_run_id comes from the (untrusted) event; one that does not exist must not leave the
    evaluation's run RUNNING forever (every retry and every `evaldag sync` fails the same way)."""
    from mlflow import MlflowClient
    from evaldag.request.plan import EvalRequest, resolve
    from evaldag.tracking.write import track

    ckpt = complete_checkpoint(tmp_path / "ckpts" / "job" / "checkpoint-300")
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), step=300, limit=2, num_shards=1,
                               train_run="job", mlflow_parent_run_id="0123456789abcdef0123456789abcdef"),
                   tmp_path / "results")
    pl.DataFrame({"sample_id": ["a", "b"], "correct": [True, False]}).write_parquet(plan.path("samples.parquet"))
    plan.path("metrics.json").write_text(json.dumps(_metrics()))
    for _ in range(2):
        try:
            run = track(plan, _metrics(), flow_run_id="fr-C")
            break
        except Exception as e:  # noqa: BLE001
            err = e
    else:
        pytest.fail(f"track never succeeds: {type(err).__name__}: {str(err)[:200]}")
    assert MlflowClient().get_run(run.run_id).info.status == "FINISHED"


def test_sweeper_reads_step_of_symlinked_alias_not_of_target(tmp_path):
    """<root>/alias/step_5 -> <root>/run/checkpoint-1200: discover reports step 5 for the folder the sweeper then
    resolves to checkpoint-1200 (events refuse exactly this mismatch)."""
    from evaldag.events.checkpoint_event import discover_checkpoints

    root = tmp_path / "ckpts"
    real = complete_checkpoint(root / "run" / "checkpoint-1200")
    (root / "alias").mkdir()
    (root / "alias" / "step_5").symlink_to(real)
    found = {(s, p.resolve()) for s, p in discover_checkpoints(root)}
    assert (5, real.resolve()) not in found, found


def test_sweeper_train_run_of_a_folder_name_is_a_valid_train_run(tmp_path):
    """The CLI sanitises a run folder's name into a train_run (plan._default_train_run); the sweeper passes it raw,
    so every checkpoint under '/ckpts/run 42/' fails EvalRequest validation and is never evaluated."""
    from evaldag.events.identity import train_run_of
    from evaldag.request.rules import check_train_run, train_run_name

    root = tmp_path / "ckpts"
    ckpt = complete_checkpoint(root / "run 42" / "checkpoint-100")
    name = train_run_of(ckpt, root)
    assert check_train_run(name) == name == train_run_name("run 42") != "run 42"   # valid, and the CLI's name


def test_explicit_roots_under_a_symlinked_allowed_root_are_accepted_and_escapes_are_not(tmp_path, monkeypatch):
    """EVALDAG_CHECKPOINT_ROOTS=/ckpts where /ckpts links to /mnt/ckpts: eval_latest's root /ckpts/run-1 resolves
    to /mnt/ckpts/run-1, which must count as under /ckpts; a run folder that links elsewhere must not."""
    from evaldag.errors import ConfigError
    from flows.sweeper_flow import _roots

    real = tmp_path / "mnt" / "ckpts"
    (real / "run-1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (real / "escape").symlink_to(tmp_path / "elsewhere")
    link = tmp_path / "ckpts"
    link.symlink_to(real)
    monkeypatch.setenv("EVALDAG_CHECKPOINT_ROOTS", str(link))
    assert _roots([str(link / "run-1")]) == [(real / "run-1").resolve()]
    with pytest.raises(ConfigError, match="not under EVALDAG_CHECKPOINT_ROOTS"):
        _roots([str(link / "escape")])


def test_event_refuses_checkpoint_files_that_link_outside_the_roots(tmp_path):
    """The folder is contained, its files are not: weights/config/tokenizer may be symlinks to any file the worker
    can read (another team's model, a private file), and evaldag loads and fingerprints them."""
    from evaldag.errors import CheckpointError
    from evaldag.events.checkpoint_event import validate_checkpoint_event

    outside = complete_checkpoint(tmp_path / "private" / "secret-model")
    root = tmp_path / "ckpts"
    ckpt = root / "run" / "checkpoint-7"
    ckpt.mkdir(parents=True)
    for f in outside.iterdir():
        (ckpt / f.name).symlink_to(f)
    with pytest.raises(CheckpointError):
        validate_checkpoint_event({"path": str(ckpt), "step": 7, "train_run": "run"}, [root])


def test_a_parent_run_of_another_job_or_an_evaluation_is_not_written(sqlite_mlflow, configs, tmp_path):
    from mlflow import MlflowClient
    from evaldag.tracking.write import track

    other = _plan(tmp_path, 100, "other-job")
    other_run = track(other, _metrics(), flow_run_id="fr-D")
    other_parent = MlflowClient().get_run(other_run.run_id).data.tags["evaldag.parent_run_id"]
    for named in (other_run.run_id, other_parent):
        plan = _plan(tmp_path / named, 200, "my-job")
        plan = plan.model_copy(update={"request": plan.request.model_copy(update={"mlflow_parent_run_id": named})})
        run = track(plan, _metrics(), flow_run_id=f"fr-{named}")
        used = MlflowClient().get_run(run.run_id).data.tags["evaldag.parent_run_id"]
        assert used not in (other_run.run_id, other_parent)
        assert MlflowClient().get_run(used).data.tags["train_run"] == "my-job"


def test_a_trainer_made_parent_run_is_written_by_its_own_job_only(sqlite_mlflow, configs, tmp_path):
    """A parent run the trainer made (no `train_run` tag, like a Trainer's own MLflow run) is claimed by the first job
    whose event names it; another job's event that names it then logs into that job's own parent run. Before, any
    untagged run was taken, so job B's curve landed in job A's run (issue 38 item 3)."""
    from mlflow import MlflowClient
    from evaldag.tracking.write import track

    client = MlflowClient()
    exp = client.create_experiment("trainer-a")
    trainer_run = client.create_run(exp, run_name="trainer-a").info.run_id

    def track_naming(parent: str, job: str, step: int) -> str:
        plan = _plan(tmp_path / job, step, job)
        plan = plan.model_copy(update={"request": plan.request.model_copy(update={"mlflow_parent_run_id": parent})})
        run = track(plan, _metrics(), flow_run_id=f"fr-{job}-{step}")
        return client.get_run(run.run_id).data.tags["evaldag.parent_run_id"]

    assert track_naming(trainer_run, "job-a", 100) == trainer_run          # the trainer's own run gets the curve
    assert client.get_run(trainer_run).data.tags["train_run"] == "job-a"    # ... and is job-a's from now on
    used = track_naming(trainer_run, "job-b", 200)
    assert used != trainer_run and client.get_run(used).data.tags["train_run"] == "job-b"
    assert track_naming(trainer_run, "job-a", 300) == trainer_run          # job-a's later checkpoints still do
    [key] = [k for k in client.get_run(trainer_run).data.metrics if k.endswith("/accuracy")]
    assert [m.step for m in client.get_metric_history(trainer_run, key)] == [100, 300]
    # a trainer that tags its run with its job from the start binds it before any evaluation
    tagged = client.create_run(exp, run_name="trainer-c", tags={"train_run": "job-c"}).info.run_id
    assert track_naming(tagged, "job-b", 400) != tagged
    assert track_naming(tagged, "job-c", 400) == tagged


def test_sync_logs_the_others_when_one_evaluation_cannot_be_logged(sqlite_mlflow, configs, tmp_path):
    from evaldag.tracking.sync import sync

    good = _plan(tmp_path, 100, "sync-job")
    bad = _plan(tmp_path, 200, "sync-job")
    bad.path("plan.json").write_text("{not json")
    failed = []
    created = sync(tmp_path / "results", failed)
    assert [r.created for r in created] == [True]
    assert [f for f, _ in failed] == [str(bad.path("plan.json"))] and "ValidationError" in failed[0][1]
    assert created[0].run_id and good.path("plan.json").is_file()


def test_a_linked_alias_of_a_discovered_checkpoint_is_one_checkpoint(tmp_path):
    from evaldag.events.checkpoint_event import discover_checkpoints

    root = tmp_path / "ckpts"
    real = complete_checkpoint(root / "run" / "checkpoint-1200")
    (root / "latest").mkdir()
    (root / "latest" / "checkpoint-1200").symlink_to(real)
    assert discover_checkpoints(root) == [(1200, root / "run" / "checkpoint-1200")]


def test_the_sweepers_lookup_reads_every_page_of_finished_runs(sqlite_mlflow, monkeypatch):
    """One MLflow search returns one page (at most 50,000 runs); a deployment with more finished evaluations than
    that must still see them all, or the sweeper keeps starting evaluations that are done."""
    from mlflow import MlflowClient

    from evaldag.tracking import client as tracking_client
    from evaldag.tracking.history import evaluated_checkpoints
    from evaldag.tracking.names import SETTINGS_TAG, experiment_name

    class CappedServer(MlflowClient):
        """A server whose page holds at most 2 runs (MLflow's own cap is 50,000), whatever is asked."""

        def search_runs(self, *args, max_results=1000, **kwargs):
            return super().search_runs(*args, max_results=min(max_results, 2), **kwargs)

    monkeypatch.setattr(tracking_client, "mlflow_client", CappedServer)
    client = MlflowClient()
    exp = client.create_experiment(experiment_name("gsm8k"))
    for step in range(5):
        run = client.create_run(exp, tags={"checkpoint": f"/ckpts/job/checkpoint-{step}", "step": str(step),
                                           SETTINGS_TAG: "k"})
        client.set_terminated(run.info.run_id)
    assert evaluated_checkpoints("gsm8k") == {(f"/ckpts/job/checkpoint-{s}", s, "k") for s in range(5)}

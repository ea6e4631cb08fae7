"""The training job's parent run in MLflow, which holds the job's curves (each benchmark's headline figures by step):
found, claimed or created once per job, or the run the trainer names when that run may take them, and the
experiments evaluations log to (get-or-create)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from evaldag.tracking.names import EXPERIMENT_KIND_TAG, JOBS_EXPERIMENT, TRAINING_KIND
from evaldag.tracking.run_claims import claim_run

log = logging.getLogger("evaldag")

# The param that claims a run the trainer made for one job (write-once on the server: `_claim`)
CLAIM_PARAM = "evaldag.train_run"
# On an evaluation's run: why the parent run its request named did not get the curve (`ParentRun.refused`)
PARENT_REFUSED_TAG = "evaldag.parent_run_refused"


def ensure_experiment(client, name: str) -> str:
    """The experiment's id (get-or-create), marked as a model-training experiment whether new or already there."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
        except Exception:  # created meanwhile by a concurrent evaluation
            exp = client.get_experiment_by_name(name)
    if exp.tags.get(EXPERIMENT_KIND_TAG) != TRAINING_KIND:   # made by an older evaldag or the UI
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return exp.experiment_id


def parent_run(client, train_run: str, requested: str | None = None) -> str:
    """The training job's parent run id (`job_parent_run`)."""
    return job_parent_run(client, train_run, requested).run_id


@dataclass(frozen=True)
class ParentRun:
    """The run that gets a job's curve, and why the run the request named is not it (None when it is, or when the
    request named none): track() tags the evaluation's run with that reason, so a person sees the fallback."""

    run_id: str
    refused: str | None = None


def job_parent_run(client, train_run: str, requested: str | None = None) -> ParentRun:
    """The training job's parent run (get-or-create; a run id the trainer created itself wins when it may take this
    job's curve, `_refusal`), else the job's own, with a warning.

    Claimed atomically (evaldag.tracking.run_claims): evaluations of one job finishing at once on different hosts agree on
    one parent. A parent logged before claims existed (the oldest one) is claimed as it is."""
    refused = _refusal(client, requested, train_run) if requested else None
    if requested and refused is None:
        return ParentRun(requested)
    if refused:
        log.warning("%s; the job's own parent run gets the curve", refused)
    exp_id = ensure_experiment(client, JOBS_EXPERIMENT)

    def legacy() -> str | None:
        runs = client.search_runs([exp_id], filter_string=f"tags.train_run = '{train_run}' and tags.kind = "
                                  "'train_job'", order_by=["attributes.start_time ASC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def candidate() -> str:   # not findable as the job's parent (kind) until it has won the claim
        return client.create_run(exp_id, run_name=train_run,
                                 tags={"train_run": train_run, "kind": "train_job_candidate"}).info.run_id

    run_id, _ = claim_run(client, exp_id, f"train_run:{train_run}", candidate, legacy)
    client.set_tag(run_id, "kind", "train_job")
    return ParentRun(run_id, refused)


def _refusal(client, run_id: str, train_run: str) -> str | None:
    """Why the parent run an event or a request names (untrusted input) may not get this job's curve, or None when
    it may: it exists, is not deleted, is not one of evaldag's other runs (an evaluation's, a candidate that may yet
    be deleted), and belongs to this job.

    A run belongs to the job that claimed it (`_claim`), or, unclaimed, to the job its `train_run` tag names:
    evaldag tags the parent runs it makes, and a trainer may tag its own. A run with neither (one the trainer made,
    e.g. its Trainer's own MLflow run) is claimed for this job on first use, so that no other job's event writes
    into it after. A refused run is not an error: a wrong or deleted id must neither strand the evaluation (every
    retry failing the same way) nor write into somebody else's run."""
    run = _run_or_none(client, run_id)
    if run is not None and run.info.lifecycle_stage != "deleted":
        kind = run.data.tags.get("kind")
        if kind not in (None, "train_job"):
            return f"mlflow_parent_run_id {run_id} is evaldag's {kind} run, not a job's parent run"
        owner = _owner(run) or _claim(client, run_id, train_run)
        if owner is not None:
            return None if owner == train_run else f"mlflow_parent_run_id {run_id} is job {owner!r}'s run, not " \
                                                   f"job {train_run!r}'s"
    # MLflow keeps a deleted run readable (and refuses every write to it) until it is garbage-collected
    return f"mlflow_parent_run_id {run_id}: {'no such run' if run is None else 'the run is deleted'}"


def _owner(run) -> str | None:
    """The job a run belongs to: the one that claimed it, else the one its `train_run` tag names, else none."""
    return run.data.params.get(CLAIM_PARAM) or run.data.tags.get("train_run")


def _claim(client, run_id: str, train_run: str) -> str | None:
    """Claim an unowned run for `train_run`; returns the job that holds it now (this one or one that claimed it
    first), None when the run was deleted meanwhile.

    A param is write-once on the tracking server (logging it again with another value fails, with the same value
    succeeds), so of jobs claiming one run at once exactly one succeeds, whatever the hosts: a tag written and read
    back would not do, as one job may read its own tag back before the other overwrites it. The run is read back
    either way: a refused claim means another owner or a deleted run, and only the run says which."""
    from mlflow.exceptions import MlflowException

    refused = None
    try:
        client.log_param(run_id, CLAIM_PARAM, train_run)
    except MlflowException as e:
        if str(getattr(e, "error_code", "")) != "INVALID_PARAMETER_VALUE":
            raise
        refused = e
    run = client.get_run(run_id)
    owner = run.data.params.get(CLAIM_PARAM)
    if run.info.lifecycle_stage == "deleted":
        return None
    if owner is None:   # refused for a reason other than another owner or a deletion: say it as MLflow did
        raise RuntimeError(f"claiming MLflow run {run_id} for job {train_run!r} failed: {refused}")
    if owner == train_run:
        client.set_tag(run_id, "train_run", train_run)   # so that searches by job and the UI show it as the job's
    return owner


def _run_or_none(client, run_id: str):
    """Run `run_id`, None when there is no such run; any other failure (the server down, a 503) raises, for the
    track task to retry: only "no such run" is the request's fault, and read as such it would move the job's curve
    to another run for good."""
    try:
        return client.get_run(run_id)
    except Exception as e:
        if getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
            raise
        return None

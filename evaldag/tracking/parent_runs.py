"""The training job's parent run in MLflow, which holds the job's curves (each benchmark's headline figures by step):
found, claimed or created once per job, or the run the trainer names when that run may take them, and the
experiments evaluations log to (get-or-create)."""

from __future__ import annotations

import logging

from evaldag.tracking.names import EXPERIMENT_KIND_TAG, JOBS_EXPERIMENT, TRAINING_KIND
from evaldag.tracking.run_claims import claim_run

log = logging.getLogger("evaldag")


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
    """The training job's parent run (get-or-create; a run id the trainer created itself wins when it belongs to
    this job or to none yet, `_usable_parent`).

    Claimed atomically (evaldag.tracking.run_claims): evaluations of one job finishing at once on different hosts agree on
    one parent. A parent logged before claims existed (the oldest one) is claimed as it is."""
    if requested and _usable_parent(client, requested, train_run):
        return requested
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
    return run_id


def _usable_parent(client, run_id: str, train_run: str) -> bool:
    """Whether the parent run an event or a request names (untrusted input) may get this job's curve: it exists, is
    not an evaluation's run, and belongs to this job. A run belongs to the job its `train_run` tag names: evaldag
    tags the parent runs it makes, and a run without the tag (one the trainer made, e.g. its Trainer's own MLflow
    run) is claimed for this job by tagging it on first use, so that no other job's event can write into it after.
    Otherwise the job's own parent run is used, with a warning: a wrong id must neither strand the evaluation (every
    retry failing the same way) nor write into somebody else's run."""
    tags = _run_tags_or_none(client, run_id)
    if tags is None:
        return False
    # evaldag's own runs say what they are; of those only a job's parent run is one (an evaluation's run, or a
    # candidate that may yet be deleted, is not)
    kind = tags.get("kind")
    if kind in (None, "train_job") and tags.get("train_run") is None:
        client.set_tag(run_id, "train_run", train_run)
        # two jobs naming one untagged run at once: the tag read back after both wrote says whose it is
        tags = client.get_run(run_id).data.tags
    if kind not in (None, "train_job") or tags.get("train_run") != train_run:
        log.warning("mlflow_parent_run_id %s is %s, not this job's (%s) parent run; the job's own parent run gets "
                    "the curve", run_id, f"evaldag's {kind} run" if kind not in (None, "train_job")
                    else f"job {tags.get('train_run')!r}'s run", train_run)
        return False
    return True


def _run_tags_or_none(client, run_id: str) -> dict[str, str] | None:
    """The tags of run `run_id`, None (with a warning) when there is no such run; any other failure (the server
    down) raises, for the track task to retry: only "no such run" is the request's fault."""
    try:
        return client.get_run(run_id).data.tags
    except Exception as e:
        if getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
            raise
        log.warning("mlflow_parent_run_id %s: no such run (%s); the job's own parent run gets the curve", run_id,
                    str(e)[:200])
        return None

"""An evaluation that changes jobs: the sweeper evaluated a checkpoint under a job name guessed from its folder, and
the trainer's event for it, arriving late, adopts it for the job it names (tasks/start_evaluation.py). The plan
passed to the track step is made the new job's here (`as_job`); an evaluation already logged to MLflow by then is
moved (`move_to_job`): its run is tagged with the new job and the new job's parent run gets its curve point.

The point stays on the folder job's parent run: MLflow deletes no single metric point, only a whole run, and the
folder job's parent run may hold the curve of checkpoints no trainer announced. Its runs no longer name the
evaluation as the folder job's, so that job's history, verdicts and forecasts leave it out from then on.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import polars as pl

from evaldag.decisions.series import comparison_key
from evaldag.request.plan import EvalPlan, load_plan
from evaldag.tracking import client as tracking_client
from evaldag.tracking.history import history_row, job_history
from evaldag.tracking.names import experiment_name
from evaldag.tracking.parent_runs import PARENT_REFUSED_TAG
from evaldag.tracking.write import log_to_parent_run

log = logging.getLogger("evaldag")

# What says whose evaluation it is and where that job's curve goes: the evaluation flow's parameters of that name
JOB_FIELDS = ("train_run", "mlflow_parent_run_id", "final_step", "baseline")


def as_job(plan: EvalPlan, job: dict[str, Any]) -> EvalPlan:
    """`plan` as job `job` (JOB_FIELDS: train_run, and that job's parent run, final step and baseline) evaluates it;
    the plan itself when `job` names its own job. The eval_key is kept: it names the stored result, not the job."""
    if job.get("train_run") in (None, plan.train_run):
        return plan
    fields = {k: job.get(k) for k in JOB_FIELDS}
    return plan.model_copy(update={"train_run": fields["train_run"],
                                   "request": plan.request.model_copy(update=fields)})


def move_to_job(flow_run_id: str, benchmarks: list[str], job: dict[str, Any]) -> list[str]:
    """Move the finished MLflow runs the evaluation flow run `flow_run_id` logged for `benchmarks` to job `job`
    (JOB_FIELDS): each run is tagged with the job and its parent run, and that parent run gets the run's headline
    figures at its step (the curve point track() logs, evaldag.tracking.write). Returns the ids of the runs moved;
    a run already the job's is left alone, so a second late event moves nothing. The `train_run` tag is set last:
    a call that fails half way is repeated whole by the next one."""
    client = tracking_client.mlflow_client()
    moved = []
    for benchmark in benchmarks:
        exp = client.get_experiment_by_name(experiment_name(benchmark))
        if exp is None:
            continue
        for run in _finished_runs_of(client, exp.experiment_id, flow_run_id):
            old = run.data.tags.get("train_run")
            if old == job["train_run"]:
                continue
            _move(client, exp.experiment_id, run, job)
            log.info("MLflow run %s (%s step %s) moved from job %s to job %s", run.info.run_id, benchmark,
                     int(run.data.tags["step"]), old, job["train_run"])
            moved.append(run.info.run_id)
    return moved


def _finished_runs_of(client, exp_id: str, flow_run_id: str) -> list:
    """The finished evaluation runs of the experiment that flow run `flow_run_id` logged, or found logged already
    (a result computed before: evaldag.tracking.write tags it `prefect.last_flow_run_id`)."""
    found = {}
    for tag in ("prefect.flow_run_id", "prefect.last_flow_run_id"):
        for run in tracking_client.all_runs(client, [exp_id], filter_string=(
                f"tags.`{tag}` = '{flow_run_id}' and tags.kind = 'ckpt_eval' and attributes.status = 'FINISHED'")):
            found[run.info.run_id] = run
    return list(found.values())


def _move(client, exp_id: str, run, job: dict[str, Any]) -> None:
    """Log `run`'s curve point into job `job`'s parent run and tag the run as that job's (the plan and metrics it
    was tracked with are its artifacts)."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = load_plan(client.download_artifacts(run.info.run_id, "config/plan.json", tmp))
        metrics = json.loads(Path(client.download_artifacts(run.info.run_id, "config/metrics.json", tmp)).read_text())
    plan = as_job(plan, job)
    step = plan.request.step
    history = job_history(client, exp_id, plan.train_run, comparison_key(plan)).filter(pl.col("step") != step)
    history = pl.concat([history, pl.DataFrame([history_row(step, metrics)]).cast(history.schema)]).sort("step")
    if PARENT_REFUSED_TAG in run.data.tags:   # said of the folder job's parent run; the new one says its own
        client.delete_tag(run.info.run_id, PARENT_REFUSED_TAG)
    # stamped with the run's start, as track() stamps it: a repeated move writes the same point again
    log_to_parent_run(client, run, plan, metrics, history)
    client.set_tag(run.info.run_id, "train_run", plan.train_run)


__all__ = ["JOB_FIELDS", "as_job", "move_to_job"]

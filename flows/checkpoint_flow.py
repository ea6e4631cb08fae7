"""on-checkpoint: a validated "checkpoint saved" event -> one evaluation flow run for all its benchmarks.

Deployed with an event trigger (deployments/prefect.yaml): the whole event payload arrives as the `event`
parameter and is validated here, so a malformed or hostile payload fails this flow run with a message naming the
problem, and starts nothing.
"""

from __future__ import annotations

import os

from prefect import flow

from evaldag.events.checkpoint_event import allowed_roots_from_env, job_overrides, validate_checkpoint_event
from evaldag.runtime.deployments import CHECKPOINT_FLOW
from evaldag.errors import CheckpointError
from evaldag.request.rules import check_limit, decide_overrides
from evaldag.events.identity import requested_benchmarks
from evaldag.tracking.refusals import record_refusal
from tasks.start_evaluation import start_evaluation


# a refused event's reason also goes on the job's MLflow parent run (the trainer hears of it at its next notify)
@flow(name=CHECKPOINT_FLOW, log_prints=True, on_failure=[record_refusal])
def on_checkpoint(event: dict, default_benchmarks: list[str] = ["math500"],  # noqa: B006 - a Prefect default
                  eval_overrides: dict | None = None, include_cancelled: bool = False) -> list[dict]:
    """Validate the payload (path under EVALDAG_CHECKPOINT_ROOTS, complete checkpoint, step >= 0) and start the
    evaluations; returns the started (or already existing) flow runs. A repeated event retries a failed evaluation
    once (nothing while a retry is live) and leaves one a person cancelled alone unless `include_cancelled`."""
    ckpt = validate_checkpoint_event(event, allowed_roots_from_env(),
                                     marker=os.environ.get("EVALDAG_CHECKPOINT_MARKER") or None)
    benchmarks = requested_benchmarks(ckpt.benchmarks, default_benchmarks)
    overrides = dict(eval_overrides or {})
    # a trainer may ask for a quick slice; it can only shrink the work
    limit = check_limit(ckpt.extra.get("limit"), "event field extra.limit", CheckpointError)
    if limit is not None:
        overrides["limit"] = min(limit, overrides.get("limit") or limit)
    if ckpt.mlflow_parent_run_id:   # the trainer made its own MLflow run for the job: log the curves there
        overrides["mlflow_parent_run_id"] = ckpt.mlflow_parent_run_id
    if ckpt.final_step:             # where the job is headed: its forecast is logged for that step
        overrides["final_step"] = ckpt.final_step
    overrides.update(decide_overrides(ckpt.decide))     # stop early once the verdict vs the job's best is known
    overrides.update(job_overrides(ckpt, overrides))    # the job's own sampling and engine settings
    # one flow run for all benchmarks: each gpu slot loads the checkpoint once for all of them. A repeated event
    # after a failed evaluation means "try again"; after a completed or cancelled one it starts nothing.
    return [start_evaluation(benchmarks, ckpt.path, ckpt.step, ckpt.train_run, overrides, relaunch_failed=True,
                             include_cancelled=include_cancelled)]

"""track task: log the evaluation to MLflow (get-or-create by eval_key), retrying while the server is away."""

from __future__ import annotations

from prefect import task
from prefect.tasks import exponential_backoff

from evaldag.request.plan import load_plan
from evaldag.runtime.cancel import KeepingCancel
from evaldag.tracking.write import TrackedRun, track
from tasks.start_evaluation import adopted_plan
from tasks.retry import retry_transient


@task(name="track", persist_result=False,
      retries=4, retry_delay_seconds=exponential_backoff(3), retry_jitter_factor=0.2,
      retry_condition_fn=retry_transient)
def track_task(plan_path: str, metrics: dict, flow_run_id: str | None) -> TrackedRun:
    """Log to MLflow; returns the run (existing one when this evaluation was logged before). The run is finished
    only if the flow run `flow_run_id` has not been asked to cancel by then (CancelRequested, not retried)."""
    # the job as the flow run names it now: a trainer's event may have adopted the sweeper's evaluation meanwhile
    return track(adopted_plan(load_plan(plan_path), flow_run_id), metrics, flow_run_id=flow_run_id,
                 before_finish=lambda: KeepingCancel(flow_run_id).check("finishing the MLflow run"))

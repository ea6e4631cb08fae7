"""dispatch task: start the evaluation flow run of one (checkpoint, benchmark) without waiting for it."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.deployments import run_deployment

from evaldag.triggers import evaluation_id


@task(name="start-evaluation", retries=3, retry_delay_seconds=[2, 5, 10])
def start_evaluation(benchmark: str, checkpoint: str, step: int, train_run: str,
                     overrides: dict | None = None, relaunch_failed: bool = False) -> dict:
    """run_deployment("eval/<benchmark>") keyed by the evaluation's identity (evaldag.triggers.evaluation_id: the
    checkpoint, step, benchmark and every override that changes the result): a duplicate request returns the
    existing flow run instead of starting a second one, a full evaluation after a quick slice starts its own. With `relaunch_failed`, an existing run that failed or
    crashed is started again under a fresh key (Prefect would otherwise hand back the failed run forever)."""
    key = evaluation_id(train_run, step, benchmark, checkpoint, overrides)   # settings that change the result too
    params = {**(overrides or {}), "checkpoint": checkpoint, "step": step, "train_run": train_run}
    name = f"eval/{benchmark}"
    fr = run_deployment(name, parameters=params, idempotency_key=key, timeout=0,
                        flow_run_name=f"{benchmark}-{train_run}-step{step}")
    if relaunch_failed and fr.state and fr.state.is_final() and not fr.state.is_completed():
        get_run_logger().warning("%s for %s step %d ended %s earlier; starting it again", name, train_run, step,
                                 fr.state.name)
        fr = run_deployment(name, parameters=params, idempotency_key=f"{key}:retry:{int(time.time())}", timeout=0,
                            flow_run_name=f"{benchmark}-{train_run}-step{step}-retry")
    get_run_logger().info("%s for %s step %d: flow run %s (%s)", name, train_run, step, fr.name,
                          fr.state.name if fr.state else "Scheduled")
    return {"benchmark": benchmark, "flow_run_id": str(fr.id), "flow_run_name": fr.name,
            "state": fr.state.name if fr.state else "Scheduled"}

"""start-evaluation task: start the evaluation flow run of one checkpoint on its benchmarks without waiting for it."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.deployments import run_deployment

from evaldag.deployments import SUITE_DEPLOYMENT, evaluation_deployment
from evaldag.triggers import evaluation_id


@task(name="start-evaluation", retries=3, retry_delay_seconds=[2, 5, 10])
def start_evaluation(benchmarks: str | list[str], checkpoint: str, step: int, train_run: str,
                     overrides: dict | None = None, relaunch_failed: bool = False) -> dict:
    """run_deployment keyed by the evaluation's identity (evaldag.triggers.evaluation_id: the checkpoint, step,
    benchmarks and every override that changes the result): a duplicate request returns the existing flow run
    instead of starting a second one, a full evaluation after a quick slice starts its own. One benchmark runs as
    eval/<benchmark>; several as one eval/suite run, so every gpu slot loads the checkpoint once for all of them.
    With `relaunch_failed`, an existing run that failed or crashed is started again under a fresh key (Prefect would
    otherwise hand back the failed run forever)."""
    names = [benchmarks] if isinstance(benchmarks, str) else list(dict.fromkeys(benchmarks))
    key = evaluation_id(train_run, step, names, checkpoint, overrides)
    params = {**(overrides or {}), "checkpoint": checkpoint, "step": step, "train_run": train_run}
    deployment = evaluation_deployment(names)
    if deployment == SUITE_DEPLOYMENT:
        params["benchmarks"] = names
    run_name = f"{'+'.join(names)}-{train_run}-step{step}"
    fr = run_deployment(deployment, parameters=params, idempotency_key=key, timeout=0, flow_run_name=run_name)
    if relaunch_failed and fr.state and fr.state.is_final() and not fr.state.is_completed():
        get_run_logger().warning("%s for %s step %d ended %s earlier; starting it again", deployment, train_run, step,
                                 fr.state.name)
        fr = run_deployment(deployment, parameters=params, idempotency_key=f"{key}:retry:{int(time.time())}",
                            timeout=0, flow_run_name=f"{run_name}-retry")
    get_run_logger().info("%s (%s) for %s step %d: flow run %s (%s)", deployment, ", ".join(names), train_run, step,
                          fr.name, fr.state.name if fr.state else "Scheduled")
    return {"benchmark": "+".join(names), "benchmarks": names, "flow_run_id": str(fr.id), "flow_run_name": fr.name,
            "state": fr.state.name if fr.state else "Scheduled"}

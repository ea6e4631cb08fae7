"""launch task: run one shard as a flow run of the shard deployment on the `gpu` work pool."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.context import get_run_context
from prefect.deployments import run_deployment

from evaldag.plan import load_plan
from evaldag.stages import finished_shard

SHARD_DEPLOYMENT = "eval-shard/gpu"


@task(name="launch-shard", retries=2, retry_delay_seconds=5)
def launch_shard(plan_path: str, shard_index: int, parent_run_id: str) -> str:
    """Start the shard flow run and wait for it; returns the shard's graded file."""
    plan = load_plan(plan_path)
    if (done := finished_shard(plan, shard_index)) is not None:
        get_run_logger().info("shard %d: every stage already in the result store (%s), not launched", shard_index, done)
        return str(done)
    attempt = get_run_context().task_run.run_count
    # Prefect hands back the existing run for a reused idempotency key even when it failed, so a retry must
    # carry its attempt number to really start the shard again.
    key = f"{parent_run_id}:{plan.eval_key}:{shard_index}:{attempt}"
    fr = run_deployment(
        SHARD_DEPLOYMENT,
        parameters={"plan_path": plan_path, "shard_index": shard_index},
        flow_run_name=f"{plan.benchmark.name}-{plan.eval_key[:8]}-shard{shard_index}of{plan.num_shards}",
        idempotency_key=key, timeout=None, poll_interval=2,
    )
    if not fr.state.is_completed():
        raise RuntimeError(f"shard {shard_index} (flow run {fr.name}) ended {fr.state.type.value}: "
                           f"{fr.state.message}")
    path = plan.graded_path(shard_index)
    if not path.is_file():
        raise RuntimeError(f"shard {shard_index} completed but wrote no {path}; is the result store shared "
                           "between the cpu and gpu workers?")
    get_run_logger().info("shard %d done: %s", shard_index, path)
    return str(path)

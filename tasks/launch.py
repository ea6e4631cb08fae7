"""launch task: run shard i of one or more plans as one flow run of the shard deployment on the `gpu` work pool."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.context import get_run_context
from prefect.deployments import run_deployment

from evaldag.deployments import SHARD_DEPLOYMENT
from evaldag.plan import load_plan
from evaldag.stages import record_reused, shard_done


@task(name="launch-shard", retries=2, retry_delay_seconds=5)
def launch_shard(plan_paths: list[str], shard_index: int, parent_run_id: str) -> list[str]:
    """Start one shard flow run for shard `shard_index` of every plan that still needs it, wait for it, and return
    the graded file of each plan (in the order of `plan_paths`). The plans are the benchmarks of one checkpoint:
    the shard run loads the engine once for all of them."""
    log = get_run_logger()
    plans = [load_plan(p) for p in plan_paths]
    graded = {path: shard_done(plan, shard_index) for path, plan in zip(plan_paths, plans)}
    for path, plan in zip(plan_paths, plans):
        if graded[path] is not None:
            record_reused(plan, shard_index)
            log.info("%s shard %d: every stage already in the result store (%s), not launched", plan.benchmark.name,
                     shard_index, graded[path])
    todo = [(path, plan) for path, plan in zip(plan_paths, plans) if graded[path] is None]
    if todo:
        attempt = get_run_context().task_run.run_count
        # Prefect hands back the existing run for a reused idempotency key even when it failed, so a retry must
        # carry its attempt number to really start the shard again.
        keys = "+".join(plan.eval_key[:16] for _, plan in todo)
        names = "+".join(plan.benchmark.name for _, plan in todo)
        width = max(plan.num_shards for _, plan in todo)
        fr = run_deployment(
            SHARD_DEPLOYMENT,
            parameters={"plan_path": [path for path, _ in todo], "shard_index": shard_index},
            flow_run_name=f"{names}-{todo[0][1].eval_key[:8]}-shard{shard_index}of{width}",
            idempotency_key=f"{parent_run_id}:{keys}:{shard_index}:{attempt}", timeout=None, poll_interval=1,
        )
        if not fr.state.is_completed():
            raise RuntimeError(f"shard {shard_index} (flow run {fr.name}) ended {fr.state.type.value}: "
                               f"{fr.state.message}")
        for path, plan in todo:
            graded[path] = plan.graded_path(shard_index)
            if not graded[path].is_file():
                raise RuntimeError(f"shard {shard_index} completed but wrote no {graded[path]}; is the result store "
                                   "shared between the cpu and gpu workers?")
        log.info("shard %d of %s done", shard_index, names)
    return [str(graded[path]) for path in plan_paths]

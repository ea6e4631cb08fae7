"""resolve task: request -> plan.json + inputs.parquet in the result store."""

from __future__ import annotations

from prefect import get_run_logger, task

from evaldag.request.plan import EvalRequest, resolve


@task(name="resolve", persist_result=False, retries=0)
def resolve_task(request: EvalRequest, num_gpus: int = 1) -> str:
    """Validate the request, resolve model and data, write the plan (shards fitting the pool's `num_gpus`); returns
    the plan's path."""
    plan = resolve(request, num_gpus=num_gpus)
    get_run_logger().info("eval_key %s: %s on %s, %d problems in %d shards -> %s", plan.eval_key[:12],
                          plan.model.name, plan.benchmark.name, plan.n_problems, plan.num_shards,
                          plan.result_dir)
    return str(plan.path("plan.json"))

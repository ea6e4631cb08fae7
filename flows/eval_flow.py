"""eval: resolve -> [generate -> grade] x shards on the gpu pool -> reduce -> track.

Deployed once per benchmark (eval/math500, eval/aime24, ...), so `prefect deployment run eval/math500` evaluates the
default model on MATH-500; `-p checkpoint=/path -p step=1200 -p limit=20` evaluates a checkpoint or a slice.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from evaldag.plan import DEFAULT_CHECKPOINT, EvalRequest, load_plan
from evaldag.report import headline_table, summary_markdown
from flows.shard_flow import shard_flow
from tasks.launch import launch_shard
from tasks.reduce import reduce_task
from tasks.resolve import resolve_task
from tasks.track import track_task


# persist_result: the summary lands in the result store (the server's default result storage, see
# evaldag.prefect_results), so `evaldag run`, a parent flow or any Prefect client can read it back.
@flow(name="eval", task_runner=ThreadPoolTaskRunner(max_workers=64), log_prints=True, persist_result=True)
def eval_flow(  # noqa: PLR0913 - one flat parameter each, so `-p key=value` works from the CLI
    benchmark: str = "math500",
    checkpoint: str = DEFAULT_CHECKPOINT,
    step: int = 0,
    limit: int | None = None,
    num_shards: int | None = None,
    sampling: dict | None = None,
    pass_k: list[int] | None = None,
    reference: str | None = None,
    train_run: str | None = None,
    mlflow_parent_run_id: str | None = None,
    engine: Literal["hf", "vllm", "openai"] | None = None,
    dispatch: Literal["deployment", "inline"] = "deployment",
) -> dict:
    """Evaluate one checkpoint on one benchmark and log it to MLflow; returns the headline figures.

    dispatch="deployment" runs every shard as a flow run of eval-shard/gpu (the normal path, needs gpu workers);
    "inline" runs the shards one after another inside this flow run (no workers needed).
    """
    request = EvalRequest.parse(benchmark=benchmark, checkpoint=checkpoint, step=step, limit=limit,
                                num_shards=num_shards, sampling=sampling, pass_k=pass_k, reference=reference,
                                train_run=train_run, mlflow_parent_run_id=mlflow_parent_run_id,
                                engine=engine)
    plan_path = resolve_task(request)
    plan = load_plan(plan_path)
    shards = list(range(plan.num_shards))
    if dispatch == "deployment":
        graded = launch_shard.map(plan_path, shards, flow_run.id).result()
    else:
        graded = [shard_flow(plan_path, i) for i in shards]
    metrics = reduce_task(plan_path, graded)
    run = track_task(plan_path, metrics, flow_run.id)
    summary = {"eval_key": plan.eval_key, "mlflow_run_id": run.run_id, "mlflow_url": run.url,
               "new_mlflow_run": run.created, "metrics": metrics}
    create_markdown_artifact(summary_markdown(plan, metrics, run.url, run.diagnostics),
                             key=f"eval-{plan.benchmark.name}",
                             description=f"{plan.resolved_model.name} on {plan.benchmark.name} at step {step}")
    create_table_artifact(headline_table(plan, metrics, run.url), key=f"eval-{plan.benchmark.name}-mlflow",
                          description="headline metrics and the MLflow run they were logged to")
    get_run_logger().info("%s on %s: accuracy %.4f over %d samples; MLflow run %s", plan.resolved_model.name,
                          plan.benchmark.name, metrics["accuracy"], int(metrics["n_samples"]), run.url or run.run_id)
    return summary

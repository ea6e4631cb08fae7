"""eval-select: which checkpoint of a training job is best on a benchmark, with a guarantee, for a fraction of
evaluating them all (evaldag.decisions.select: paired elimination over one shared problem order).

choose checkpoints -> resolve each (decide="select") -> [each survivor's shards generate the prefix it needs ->
select_step] until one survives, all survivors are equivalent, or the last look -> MLflow (the job's parent run)
and Prefect artifacts. Rows already generated for a checkpoint (a full evaluation, one stopped early, an earlier
selection) count; nothing generated is thrown away. Deployed as eval-select/eval-select: `evaldag select`, the
Prefect UI, a schedule, or the end of a training job start it.
"""

from __future__ import annotations

import time
from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from evaldag.decisions.select import planned_looks, too_small
from evaldag.decisions.select_rows import summarize
from evaldag.runtime.deployments import SELECT_FLOW
from tasks.gpu_slots import pool_num_gpus
from tasks.select import choose_task, log_task, plan_checkpoints, publish, run_rounds


@flow(name=SELECT_FLOW, task_runner=ThreadPoolTaskRunner(max_workers=64), log_prints=True, persist_result=True,
      result_serializer="json")
def select_flow(  # noqa: PLR0913 - one flat parameter each, so `-p key=value` works from the CLI
    train_run: str,
    benchmark: str = "math500",
    checkpoints: list[str] | None = None,
    steps: str | None = None,
    alpha: float = 0.05,
    margin: float = 0.02,
    rounds: int | None = None,
    limit: int | None = None,
    num_shards: int | None = None,
    sampling: dict | None = None,
    engine: Literal["hf", "vllm", "openai"] | None = None,
) -> dict:
    """The best checkpoint of `train_run` on `benchmark`, or the set within `margin` of the best when they cannot
    be told apart: with probability at least 1 - `alpha` the truly best is in it. Checkpoints: `checkpoints`
    (folders), else the job's known ones (its evaluations in MLflow, its folder under EVALDAG_CHECKPOINT_ROOTS),
    within `steps` ("A:B"). Read at select's planned looks (`planned_looks`: dense at first, where clearly
    worse checkpoints drop, then every twentieth of the problems), or at `rounds` equal steps; `limit`, `num_shards`, `sampling` and `engine` as for
    eval (the same as the evaluations whose rows it should reuse). Returns the selection (tracking.selection)."""
    t0 = time.monotonic()
    log = get_run_logger()
    chosen = choose_task(train_run, checkpoints, steps)
    settings = {k: v for k, v in dict(limit=limit, num_shards=num_shards, sampling=sampling, engine=engine).items()
                if v is not None}
    rows = plan_checkpoints(benchmark, chosen, train_run, settings, pool_num_gpus())
    n_problems = len(next(iter(rows.values())).order)
    warning = too_small(n_problems, len(rows), margin, alpha, benchmark)
    if warning:
        log.warning(warning)
    sel = run_rounds(rows, planned_looks(n_problems, rounds), alpha, margin, flow_run.id)
    summary = summarize(sel, rows, dict(zip(rows, chosen)), train_run, time.monotonic() - t0)
    summary |= {"warning": warning, "flow_run_id": str(flow_run.id)}
    summary["mlflow_parent_run_id"] = log_task(summary)
    publish(summary)
    from evaldag.tracking.selection import describe

    log.info(describe(summary))
    return summary

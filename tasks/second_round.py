"""plan-second-round, a task of the parent flow: an adaptive evaluation's second round (evaldag.request.second_round),
planned from the first round's graded rows once every first-round shard is done."""

from __future__ import annotations

import polars as pl
from prefect import get_run_logger, task

from evaldag.request.plan import load_plan
from evaldag.request.second_round import resolve_second_round, second_round_path
from evaldag.storage.schema import GRADED_SCHEMA, read_table
from tasks.retry import retry_transient


@task(name="plan-second-round", persist_result=False,
      retries=2, retry_delay_seconds=[2, 5], retry_condition_fn=retry_transient)
def second_round_task(plan_path: str, graded_paths: list[str]) -> str | None:
    """The second round's plan path of the adaptive evaluation at `plan_path`, from its first round's graded files;
    None when the design draws no more samples."""
    plan = load_plan(plan_path)
    rows = pl.concat([read_table(p, GRADED_SCHEMA, columns=["sample_id", "sample_index", "correct"])
                      for p in graded_paths])
    second = resolve_second_round(plan, rows)
    log = get_run_logger()
    if second is None:
        log.info("%s: the first round leaves no problem uncertain; no second round", plan.benchmark.name)
        return None
    more = sum(count for runs in second.sample_runs for _, count in runs)
    log.info("%s: second round of %d samples on %d problems in %d shards (first round: %d)", plan.benchmark.name,
             more, len(second.sample_ids()), second.num_shards, plan.n_problems * plan.sampling.n)
    return str(second_round_path(plan))

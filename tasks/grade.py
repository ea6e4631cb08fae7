"""grade task: math-verify grading of one shard in worker processes with a hard per-item timeout."""

from __future__ import annotations

from prefect import task

from evaldag.plan import load_plan
from evaldag.stages import grade_shard
from tasks.retry import retry_transient


@task(name="grade", persist_result=True, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_transient)
def grade_task(plan_path: str, shard_index: int) -> str:
    """Grade one shard (skipped when its output already exists); returns the graded file."""
    return str(grade_shard(load_plan(plan_path), shard_index))

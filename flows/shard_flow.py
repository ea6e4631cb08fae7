"""eval-shard: generate then grade one shard of an evaluation plan (deployed as eval-shard/gpu on the gpu pool)."""

from __future__ import annotations

from prefect import flow

from tasks.generate import generate_task
from tasks.grade import grade_task


@flow(name="eval-shard", log_prints=True)
def shard_flow(plan_path: str, shard_index: int) -> str:
    """One shard: one engine load, all its completions, then grading; returns the graded file's path."""
    generate_task(plan_path, shard_index)
    return grade_task(plan_path, shard_index)

"""generate task: one shard's completions, written as parquet."""

from __future__ import annotations

from prefect import task
from prefect.tasks import exponential_backoff

from evaldag.plan import load_plan
from evaldag.stages import generate_shard
from tasks.retry import retry_transient


@task(name="generate", persist_result=True,
      retries=2, retry_delay_seconds=exponential_backoff(5), retry_jitter_factor=0.2,
      retry_condition_fn=retry_transient)
def generate_task(plan_path: str, shard_index: int) -> str:
    """Generate one shard (skipped when its output already exists); returns the generations file."""
    return str(generate_shard(load_plan(plan_path), shard_index))

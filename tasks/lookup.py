"""lookup task: which checkpoints already have a finished evaluation in MLflow (for the sweeper)."""

from __future__ import annotations

from prefect import task

from tasks.retry import retry_transient


@task(name="evaluated-checkpoints", persist_result=False,
      retries=3, retry_delay_seconds=[2, 5, 10], retry_condition_fn=retry_transient)
def evaluated_checkpoints(benchmark: str, decided_counts: bool = True) -> set[tuple[str, int, str]]:
    """(checkpoint folder, step, settings key) of every FINISHED evaluation run of `benchmark`; a decided one
    counts for the full evaluation too unless `decided_counts` is False (evaldag.tracking.history)."""
    from evaldag.tracking.history import evaluated_checkpoints as lookup

    return lookup(benchmark, decided_counts)

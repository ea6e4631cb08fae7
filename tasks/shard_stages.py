"""The shard flow's two stages as tasks: generate (the GPU work, its progress a Prefect artifact) and grade
(math-verify in worker processes). Each skips work whose output is already in the result store, and retries what
is transient (tasks.retry)."""

from __future__ import annotations

from prefect import task
from prefect.tasks import exponential_backoff

from evaldag.request.plan import load_plan
from evaldag.pipeline.progress import artifact_progress, round_label
from evaldag.pipeline.generate import generate_shard
from evaldag.pipeline.grade import grade_shard
from tasks.retry import retry_transient


@task(name="generate", persist_result=False,
      retries=2, retry_delay_seconds=exponential_backoff(5), retry_jitter_factor=0.2,
      retry_condition_fn=retry_transient)
def generate_task(plan_path: str, shard_index: int) -> str | None:
    """Generate one shard (skipped when its output already exists), its progress published as a Prefect progress
    artifact; returns the generations file, or None when the parent stopped the evaluation early (evaldag.decisions.decide)."""
    plan = load_plan(plan_path)
    out = generate_shard(plan, shard_index, artifact_progress(round_label(plan.benchmark.name, plan.round), shard_index))
    return None if out is None else str(out)


@task(name="grade", persist_result=False, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_transient)
def grade_task(plan_path: str, shard_index: int) -> str:
    """Grade one shard with math-verify in worker processes with a hard per-item timeout (skipped when its output
    already exists); returns the graded file."""
    return str(grade_shard(load_plan(plan_path), shard_index))

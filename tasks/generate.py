"""generate task: one shard's completions, written as parquet, its progress published as a Prefect artifact."""

from __future__ import annotations

import logging
import re

from prefect import task
from prefect.tasks import exponential_backoff

from evaldag.plan import load_plan
from evaldag.progress import describe
from evaldag.stages import Progress, generate_shard
from tasks.retry import retry_transient

log = logging.getLogger(__name__)


def progress_key(benchmark: str, shard: int) -> str:
    """The progress artifact's key (Prefect keys: lowercase letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", f"progress-{benchmark}-shard-{shard}".lower())


def artifact_progress(benchmark: str, shard: int) -> Progress:
    """A generate_shard progress callback that creates, then updates, one Prefect progress artifact."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    artifact_id = None

    def report(done: int, total: int, tokens: int) -> None:
        nonlocal artifact_id
        pct = 100.0 * done / total if total else 100.0
        text = describe(benchmark, shard, done, total, tokens)   # `evaldag run` parses it back
        try:
            if artifact_id is None:
                artifact_id = create_progress_artifact(pct, key=progress_key(benchmark, shard), description=text)
            else:
                update_progress_artifact(artifact_id, pct, description=text)
        except Exception as e:  # progress is for people watching; it must never fail the generation
            log.warning("shard %d: could not publish progress (%s)", shard, e)

    return report


@task(name="generate", persist_result=True,
      retries=2, retry_delay_seconds=exponential_backoff(5), retry_jitter_factor=0.2,
      retry_condition_fn=retry_transient)
def generate_task(plan_path: str, shard_index: int) -> str:
    """Generate one shard (skipped when its output already exists); returns the generations file."""
    plan = load_plan(plan_path)
    return str(generate_shard(plan, shard_index, artifact_progress(plan.benchmark.name, shard_index)))

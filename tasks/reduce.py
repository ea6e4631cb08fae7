"""reduce task: merge shard files and compute metrics with polars."""

from __future__ import annotations

from prefect import task

from evaldag.pipeline import faults
from evaldag.request.plan import load_plan
from evaldag.pipeline.reduce import reduce_results


@task(name="reduce", persist_result=False, retries=0)
def reduce_task(plan_path: str, graded_paths: list[str], only: list[str] | None = None) -> dict:
    """Check one row per (sample, index), compute metrics; returns them. `only`: the problems of an evaluation
    stopped early (evaldag.decisions.decide), when not all of the plan's."""
    faults.maybe_fail("reduce")     # a drill's hold: a cancel during the reduce (tests/test_cancel_windows_e2e.py)
    return reduce_results(load_plan(plan_path), graded_paths, only)

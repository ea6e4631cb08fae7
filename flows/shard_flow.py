"""eval-shard: generate then grade shard `shard_index` of one or more evaluation plans (deployed as eval-shard/gpu
on the gpu pool)."""

from __future__ import annotations

import contextlib

from prefect import flow

from evaldag.deployments import SHARD_FLOW
from evaldag.engines.pool import keep_loaded
from evaldag.gpus import shard_gpus
from evaldag.plan import load_plan
from tasks.generate import generate_task
from tasks.gpus import gpu_slots
from tasks.grade import grade_task


@flow(name=SHARD_FLOW, log_prints=True)
def shard_flow(plan_path: str | list[str], shard_index: int) -> str | list[str]:
    """One shard of each plan (the benchmarks of one checkpoint): one engine load for all of them, every
    completion, then grading; returns the graded file's path (a list of them for a list of plans).

    Generation (the GPU work) holds tensor_parallel_size slots of the `evaldag-gpus` concurrency limit; grading is
    CPU work and holds none, and runs after the engine is closed, so its memory is free again. Generations already
    in the store are reused without waiting for a slot or loading the engine.
    """
    paths = [plan_path] if isinstance(plan_path, str) else list(plan_path)
    plans = [load_plan(p) for p in paths]
    to_generate = [plan for plan in plans
                   if plan.reference is not None or not plan.generations_path(shard_index).is_file()]
    gpus = max((shard_gpus(plan.resolved_model) for plan in to_generate), default=0)
    # engines close (keep_loaded ends) before the slots go back
    with gpu_slots(gpus) if gpus else contextlib.nullcontext(), keep_loaded():
        for path in paths:
            generate_task(path, shard_index)
    graded = [grade_task(path, shard_index) for path in paths]
    return graded[0] if isinstance(plan_path, str) else graded

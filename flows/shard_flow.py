"""eval-shard: generate then grade one shard of an evaluation plan (deployed as eval-shard/gpu on the gpu pool)."""

from __future__ import annotations

import contextlib

from prefect import flow

from evaldag.gpus import shard_gpus
from evaldag.plan import load_plan
from tasks.generate import generate_task
from tasks.gpus import gpu_slots
from tasks.grade import grade_task


@flow(name="eval-shard", log_prints=True)
def shard_flow(plan_path: str, shard_index: int) -> str:
    """One shard: one engine load, all its completions, then grading; returns the graded file's path.

    Generation (the GPU work) holds tensor_parallel_size slots of the `evaldag-gpus` concurrency limit; grading is
    CPU work and holds none. Generations already in the store are reused without waiting for a slot.
    """
    plan = load_plan(plan_path)
    reuse = plan.reference is None and plan.generations_path(shard_index).is_file()
    with contextlib.nullcontext() if reuse else gpu_slots(shard_gpus(plan.resolved_model)):
        generate_task(plan_path, shard_index)
    return grade_task(plan_path, shard_index)

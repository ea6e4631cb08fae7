"""eval-shard: one shard of each plan of a checkpoint (the benchmarks of one event) on the `gpu` work pool, started
by the parent's launch-shard task (tasks/launch_shard.py). It holds its GPU slots (tasks/gpu_slots.py) and one
engine load while it generates every benchmark, then grades them (tasks/shard_stages.py); the work itself is
evaldag.pipeline (generate, grade).
"""

from __future__ import annotations

import contextlib

from prefect import flow
from prefect.runtime import flow_run

from evaldag.runtime.deployments import SHARD_FLOW
from evaldag.engines import keep_loaded
from evaldag.request.gpus import shard_gpus
from evaldag.scoring.grading import start_worker_server
from evaldag.runtime.liveness import fence, revive, watch_for_false_crash
from evaldag.request.plan import load_plan
from evaldag.request.shard_plan import shard_plan
from evaldag.pipeline.generate import workload
from evaldag.pipeline.loss_files import missing as eval_loss_missing
from tasks.gpu_slots import hold_gpus, in_deployment
from tasks.launch_shard import check_models
from tasks.shard_stages import generate_task, grade_task


@flow(name=SHARD_FLOW, log_prints=True)
def shard_flow(plan_path: str | list[str], shard_index: int) -> str | None | list[str | None]:
    """One shard of each plan (the benchmarks of one checkpoint): one engine load for all of them, every
    completion, then grading; returns the graded file's path (a list of them for a list of plans; None for a plan
    its parent stopped early, evaldag.decisions.decide).

    Generation (the GPU work) holds tensor_parallel_size slots of the `evaldag-gpus` concurrency limit until the
    engine is closed; grading is CPU work in worker processes started before the engine loaded, and runs while the
    engine shuts down. Generations already in the store are reused without waiting for a slot or loading the engine.
    """
    # a deployed shard set Crashed while it runs (a clock step, a partition) is relaunched by its parent, so this
    # process stops; an inline shard runs in its parent's process and resumes instead (evaldag.runtime.liveness)
    with watch_for_false_crash(flow_run.id, fence if in_deployment() else revive):
        return _shard_flow_body(plan_path, shard_index)


def _shard_flow_body(plan_path: str | list[str], shard_index: int) -> str | None | list[str | None]:
    paths = [plan_path] if isinstance(plan_path, str) else list(plan_path)
    plans = [load_plan(p) for p in paths]
    # a plan whose reference solutions are not scored yet (eval_loss) needs its engine too
    to_generate = [plan for plan in plans
                   if plan.reference is not None or not plan.generations_path(shard_index).is_file()
                   or eval_loss_missing(plan, shard_index)]
    for plan in to_generate:      # a clear error before anything reads the folder (the tokenizer, just below)
        check_models(plan)
    gpus = max((shard_gpus(plan.model) for plan in to_generate), default=0)
    start_worker_server()  # grading's worker processes get ready while the engine loads
    # sized once for what all of them need together, so the first load serves them all
    need = None
    for plan in to_generate:
        if (w := workload(shard_plan(plan, shard_index))) is not None:
            need = w.covering(need)
    # engines close (keep_loaded ends) before the slots go back
    with hold_gpus(gpus) if gpus else contextlib.nullcontext(), keep_loaded(need):
        generated = [generate_task(path, shard_index) for path in paths]
        # grading needs no engine: it starts here, in a thread of the task runner, and runs beside the engine's
        # shutdown (1.5 s of a small model on this CPU, more for a GPU's workers) instead of after it. A plan stopped
        # early (evaldag.decisions.decide) has nothing to grade here: its parent grades the decided prefix.
        grading = [grade_task.submit(path, shard_index) if out is not None else None
                   for path, out in zip(paths, generated)]
    graded = [future.result() if future is not None else None for future in grading]
    return graded[0] if isinstance(plan_path, str) else graded

"""One shard's life, in reading order: the parent's launch task starts it as a flow run of eval-shard/gpu on the
`gpu` work pool; the shard flow holds its GPUs of the `evaldag-gpus` concurrency limit while it generates, then
grades. The work itself is evaldag.stages (generate_shard, grade_shard); the pure GPU rules are evaldag.gpus.

GPU slots: a shard holds `tensor_parallel_size` slots of the global concurrency limit `evaldag-gpus` while it
generates, so the `gpu` pool never runs more GPU work than it has GPUs.
- limit missing (a server where nobody ran `evaldag up` or created it): the shard runs without slots, with a log
  line that says so; the worker's `--limit 1` and the cluster's GPU requests still bound GPU use;
- limit inactive: the same (Prefect treats an inactive limit as unlimited);
- tp > limit: ConfigError at once (Prefect would answer 422 on every attempt; a shard must never wait forever for
  slots that cannot exist);
- otherwise the shard waits, as long as it takes, until tp slots are free, and holds them under a lease that a
  background thread renews; a shard process that dies frees its slots when the lease expires (evaldag.gpus.
  gpu_lease_s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from prefect import flow, get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.deployments import run_deployment
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from evaldag.deployments import SHARD_DEPLOYMENT, SHARD_FLOW
from evaldag.engines import keep_loaded
from evaldag.errors import CheckpointError
from evaldag.grading import start_worker_server
from evaldag.gpus import GPU_LIMIT, check_fits, check_visible_gpus, gpu_lease_s, shard_gpus
from evaldag.liveness import fence, is_lost_run_crash, revive, settled, watch_for_false_crash
from evaldag.models import check_unchanged
from evaldag.plan import EvalPlan, load_plan
from evaldag.progress import artifact_progress
from evaldag.stages import generate_shard, grade_shard, record_reused, shard_done, workload
from tasks.retry import retry_transient



# ---------------------------------------------------------------------- launch (a task of the parent flow)


def _relaunchable(task, task_run, state) -> bool:
    """retry_condition_fn of launch-shard: a shard whose checkpoint is gone or was rewritten since planning fails
    the same way every time (_run_shard raises CheckpointError for it); every other failure is launched again."""
    try:
        state.result()
    except CheckpointError:
        return False
    except Exception:
        return True
    return False


@task(name="launch-shard", retries=2, retry_delay_seconds=5, retry_condition_fn=_relaunchable)
def launch_shard(plan_paths: list[str], shard_index: int, parent_run_id: str) -> list[str]:
    """Start one shard flow run for shard `shard_index` of every plan that still needs it, wait for it, and return
    the graded file of each plan (in the order of `plan_paths`). The plans are the benchmarks of one checkpoint:
    the shard run loads the engine once for all of them."""
    log = get_run_logger()
    plans = [load_plan(p) for p in plan_paths]
    graded = {path: shard_done(plan, shard_index) for path, plan in zip(plan_paths, plans)}
    for path, plan in zip(plan_paths, plans):
        if graded[path] is not None:
            record_reused(plan, shard_index)
            log.info("%s shard %d: every stage already in the result store (%s), not launched", plan.benchmark.name,
                     shard_index, graded[path])
    todo = [(path, plan) for path, plan in zip(plan_paths, plans) if graded[path] is None]
    if todo:
        _run_shard(todo, shard_index, parent_run_id)
        for path, plan in todo:
            graded[path] = plan.graded_path(shard_index)
            if not graded[path].is_file():
                raise RuntimeError(f"shard {shard_index} completed but wrote no {graded[path]}; is the result store "
                                   "shared between the cpu and gpu workers?")
        log.info("shard %d of %s done", shard_index, "+".join(plan.benchmark.name for _, plan in todo))
    return [str(graded[path]) for path in plan_paths]


def _run_shard(todo: list[tuple[str, EvalPlan]], shard_index: int, parent_run_id: str) -> None:
    """Run shard `shard_index` of the plans `todo` as one flow run of the shard deployment and wait for it; raise
    unless it completed."""
    attempt = get_run_context().task_run.run_count
    # Prefect hands back the existing run for a reused idempotency key even when it failed, so a retry must carry
    # its attempt number to really start the shard again.
    keys = "+".join(plan.eval_key[:16] for _, plan in todo)
    names = "+".join(plan.benchmark.name for _, plan in todo)
    width = max(plan.num_shards for _, plan in todo)
    fr = run_deployment(
        SHARD_DEPLOYMENT,
        parameters={"plan_path": [path for path, _ in todo], "shard_index": shard_index},
        flow_run_name=f"{names}-{todo[0][1].eval_key[:8]}-shard{shard_index}of{width}",
        idempotency_key=f"{parent_run_id}:{keys}:{shard_index}:{attempt}", timeout=0,
    )
    from evaldag.tracking import preload

    preload()  # the parent logs to MLflow after its shards: its client loads while they run, not after
    with get_client(sync_client=True) as client:
        while not (fr.state and fr.state.is_final()):
            time.sleep(1)
            fr = client.read_flow_run(fr.id)
        if is_lost_run_crash(fr.state):
            # the same window may have crashed this parent too: its retry can start no task until it is revived
            settled(lambda: client.read_flow_run(parent_run_id))
    if not fr.state.is_completed():
        # a checkpoint removed or rewritten since planning cannot succeed on a relaunch: say so (CheckpointError,
        # which launch_shard does not retry) instead of launching it twice more
        for _, plan in todo:
            _check_models(plan)
        raise RuntimeError(f"shard {shard_index} (flow run {fr.name}) ended {fr.state.type.value}: "
                           f"{fr.state.message}")


def _check_models(plan: EvalPlan) -> None:
    """CheckpointError unless the plan's model (and reference) folders still hold what was planned."""
    check_unchanged(plan.resolved_model)
    if plan.reference is not None:
        check_unchanged(plan.reference, "reference model")


# ---------------------------------------------------------------------- the shard flow and its tasks


@flow(name=SHARD_FLOW, log_prints=True)
def shard_flow(plan_path: str | list[str], shard_index: int) -> str | list[str]:
    """One shard of each plan (the benchmarks of one checkpoint): one engine load for all of them, every
    completion, then grading; returns the graded file's path (a list of them for a list of plans).

    Generation (the GPU work) holds tensor_parallel_size slots of the `evaldag-gpus` concurrency limit; grading is
    CPU work and holds none, and runs after the engine is closed, so its memory is free again. Generations already
    in the store are reused without waiting for a slot or loading the engine.
    """
    # a deployed shard set Crashed while it runs (a clock step, a partition) is relaunched by its parent, so this
    # process stops; an inline shard runs in its parent's process and resumes instead (evaldag.liveness)
    with watch_for_false_crash(flow_run.id, fence if _in_deployment() else revive):
        return _shard_flow_body(plan_path, shard_index)


def _shard_flow_body(plan_path: str | list[str], shard_index: int) -> str | list[str]:
    paths = [plan_path] if isinstance(plan_path, str) else list(plan_path)
    plans = [load_plan(p) for p in paths]
    to_generate = [plan for plan in plans
                   if plan.reference is not None or not plan.generations_path(shard_index).is_file()]
    for plan in to_generate:      # a clear error before anything reads the folder (the tokenizer, just below)
        _check_models(plan)
    gpus = max((shard_gpus(plan.resolved_model) for plan in to_generate), default=0)
    start_worker_server()  # grading's worker processes get ready while the engine loads
    # sized once for what all of them need together, so the first load serves them all
    need = None
    for plan in to_generate:
        if (w := workload(plan, shard_index)) is not None:
            need = w.covering(need)
    # engines close (keep_loaded ends) before the slots go back
    with hold_gpus(gpus) if gpus else contextlib.nullcontext(), keep_loaded(need):
        for path in paths:
            generate_task(path, shard_index)
    graded = [grade_task(path, shard_index) for path in paths]
    return graded[0] if isinstance(plan_path, str) else graded


@task(name="generate", persist_result=True,
      retries=2, retry_delay_seconds=exponential_backoff(5), retry_jitter_factor=0.2,
      retry_condition_fn=retry_transient)
def generate_task(plan_path: str, shard_index: int) -> str:
    """Generate one shard (skipped when its output already exists), its progress published as a Prefect progress
    artifact; returns the generations file."""
    plan = load_plan(plan_path)
    return str(generate_shard(plan, shard_index, artifact_progress(plan.benchmark.name, shard_index)))


@task(name="grade", persist_result=True, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_transient)
def grade_task(plan_path: str, shard_index: int) -> str:
    """Grade one shard with math-verify in worker processes with a hard per-item timeout (skipped when its output
    already exists); returns the graded file."""
    return str(grade_shard(load_plan(plan_path), shard_index))


# ---------------------------------------------------------------------- GPU slots (see the module doc)


def _logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("evaldag")


def _in_deployment() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return bool(ctx and ctx.flow_run and ctx.flow_run.deployment_id)


def _read_limit(name: str):
    """The global concurrency limit `name`, or None when the server has none by that name."""
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return None


@contextlib.contextmanager
def hold_gpus(tp: int, name: str = GPU_LIMIT) -> Iterator[None]:
    """Hold `tp` slots of the global concurrency limit `name` for the duration of the block (see module doc)."""
    from prefect.concurrency.sync import concurrency

    log = _logger()
    check_visible_gpus(tp, os.environ.get("CUDA_VISIBLE_DEVICES"))
    lease_s = gpu_lease_s()
    limit = _read_limit(name)
    if limit is None or not limit.active:
        why = "does not exist" if limit is None else "is inactive"
        # a warning where it matters (a deployed shard on a real pool), an info line for inline runs without a stack
        level = logging.WARNING if _in_deployment() else logging.INFO
        log.log(level, "concurrency limit %r %s: running on %d GPU(s) without GPU slots (create it with `prefect "
                "gcl create %s --limit <GPUs of the pool>`, or run `evaldag up`)", name, why, tp, name)
        yield
        return
    check_fits(tp, limit.limit, name)
    log.info("waiting for %d of %d GPU slot(s) of %r (%d in use)", tp, limit.limit, name, limit.active_slots)
    # strict=False: a limit deleted between the read above and here means "no limit" (the case handled above);
    # a failed lease renewal (a server hiccup) must not kill an hour-long generation.
    with concurrency(name, occupy=tp, strict=False, raise_on_lease_renewal_failure=False,
                     lease_duration=lease_s):
        log.info("holding %d GPU slot(s) of %r", tp, name)
        yield


def pool_num_gpus(name: str = GPU_LIMIT) -> int:
    """GPUs of the gpu pool as the `evaldag-gpus` limit counts them (1 when it is missing or inactive: without the
    limit nothing says how many shards can run at once, and one shard never waits behind another)."""
    limit = _read_limit(name)
    return limit.limit if limit is not None and limit.active and limit.limit > 0 else 1

"""launch-shard, a task of the parent flow: start one shard as a flow run of eval-shard/gpu on the `gpu` work
pool, wait for it, and launch it again when it crashed or failed (a lost node, kill -9), unless its checkpoint is
gone or was rewritten since planning, which fails the same way every time, or its parent (the evaluation) has ended
or is being cancelled: a shard of a cancelled evaluation is never started again."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.deployments import run_deployment

from evaldag.decisions.decide import Decision, stop_requested
from evaldag.runtime.deployments import SHARD_DEPLOYMENT
from evaldag.errors import CheckpointError
from evaldag.pipeline import faults
from evaldag.runtime.liveness import is_lost_run_crash, settled
from evaldag.runtime.run_events import wait_until_final
from evaldag.request.checkpoint import check_unchanged
from evaldag.request.plan import EvalPlan, load_plan
from evaldag.pipeline.progress import ROUND_TAG, round_label
from evaldag.pipeline.records import record_reused, shard_done


class ParentEnded(RuntimeError):
    """The evaluation (the parent flow run) a shard belongs to is final or being cancelled: nobody waits for the
    shard any more, so it is not launched (again)."""


def _relaunchable(task, task_run, state) -> bool:
    """retry_condition_fn of launch-shard: a shard whose checkpoint is gone or was rewritten since planning fails
    the same way every time (_run_shard raises CheckpointError for it), and one whose parent has ended or is being
    cancelled must not start again (ParentEnded); every other failure is launched again."""
    try:
        state.result()
    except (CheckpointError, ParentEnded):
        return False
    except Exception:
        return True
    return False


@task(name="launch-shard", persist_result=False, retries=2, retry_delay_seconds=5, retry_condition_fn=_relaunchable)
def launch_shard(plan_paths: list[str], shard_index: int, parent_run_id: str, launch: str = "") -> list[str | None]:
    """Start one shard flow run for shard `shard_index` of every plan that still needs it, wait for it, and return
    the graded file of each plan (in the order of `plan_paths`; None for a plan its parent decided early and
    stopped, evaldag.decisions.decide). The plans are the benchmarks of one checkpoint: the shard run loads the engine once
    for all of them. `launch` tells apart launches of the same shard by one parent (a selection's rounds, each a
    longer prefix): the same one is the same shard run."""
    log = get_run_logger()
    plans = [load_plan(p) for p in plan_paths]
    graded = {path: shard_done(plan, shard_index) for path, plan in zip(plan_paths, plans)}
    for path, plan in zip(plan_paths, plans):
        if graded[path] is not None:
            record_reused(plan, shard_index)
            log.info("%s shard %d: every stage already in the result store (%s), not launched", plan.benchmark.name,
                     shard_index, graded[path])
    todo = [(path, plan) for path, plan in zip(plan_paths, plans)
            # a decided evaluation's shard still finishes its part of the decided prefix, until the decision is final
            if graded[path] is None and not (stop_requested(plan) and Decision.load(plan) is not None)]
    if todo:
        _run_shard(todo, shard_index, parent_run_id, launch)
        faults.maybe_fail("shard_done")     # a drill's hold: a cancel once the shard completed (test_cancel_windows)
        for path, plan in todo:
            graded[path] = plan.graded_path(shard_index)
            if not graded[path].is_file() and stop_requested(plan):
                graded[path] = None       # stopped before its end: the parent reduces the decided prefix
            elif not graded[path].is_file():
                raise RuntimeError(f"shard {shard_index} completed but wrote no {graded[path]}; is the result store "
                                   "shared between the cpu and gpu workers?")
        log.info("shard %d of %s done", shard_index, "+".join(plan.benchmark.name for _, plan in todo))
    return [None if graded[path] is None else str(graded[path]) for path in plan_paths]


def _run_shard(todo: list[tuple[str, EvalPlan]], shard_index: int, parent_run_id: str, launch: str = "") -> None:
    """Run shard `shard_index` of the plans `todo` as one flow run of the shard deployment and wait for it; raise
    unless it completed."""
    attempt = get_run_context().task_run.run_count
    # Prefect hands back the existing run for a reused idempotency key even when it failed, so a retry must carry
    # its attempt number to really start the shard again.
    keys = "+".join(plan.eval_key[:16] for _, plan in todo)
    names = "+".join(round_label(plan.benchmark.name, plan.round).replace("/", "-") for _, plan in todo)
    width = max(plan.num_shards for _, plan in todo)
    rounds = {plan.round for _, plan in todo}      # the plans of one launch are one round's (eval_flow._generate)
    with get_client(sync_client=True) as client:
        _check_parent(client, parent_run_id, shard_index)
    fr = run_deployment(
        SHARD_DEPLOYMENT,
        parameters={"plan_path": [path for path, _ in todo], "shard_index": shard_index},
        flow_run_name=f"{names}-{todo[0][1].eval_key[:8]}-shard{shard_index}of{width}",
        tags=[f"{ROUND_TAG}{r}" for r in sorted(rounds) if r > 1],
        idempotency_key=f"{parent_run_id}:{keys}:{shard_index}:{attempt}{':' + launch if launch else ''}", timeout=0,
    )
    from evaldag.tracking.client import preload

    preload()  # the parent logs to MLflow after its shards: its client loads while they run, not after
    with get_client(sync_client=True) as client:
        fr = wait_until_final(client, fr.id)
        if is_lost_run_crash(fr.state):
            # the same window may have crashed this parent too: its retry can start no task until it is revived
            settled(lambda: client.read_flow_run(parent_run_id))
        if not fr.state.is_completed():
            # a parent cancelled through the API (Cancelled at once, no Cancelling) goes on running this task, and
            # the server cancels its shards: that shard must stay cancelled, not come back on the next try
            _check_parent(client, parent_run_id, shard_index)
    if not fr.state.is_completed():
        # a checkpoint removed or rewritten since planning cannot succeed on a relaunch: say so (CheckpointError,
        # which launch_shard does not retry) instead of launching it twice more
        for _, plan in todo:
            check_models(plan)
        raise RuntimeError(f"shard {shard_index} (flow run {fr.name}) ended {fr.state.type.value}: "
                           f"{fr.state.message}")


def _check_parent(client, parent_run_id: str, shard_index: int) -> None:
    """Raise ParentEnded when the parent flow run is final or being cancelled. The lost-run automation's crash does
    not count: this task runs in the parent's process, so that crash is false and the parent undoes it
    (evaldag.runtime.liveness)."""
    state = client.read_flow_run(parent_run_id).state
    if state is None or is_lost_run_crash(state) or not (state.is_final() or state.is_cancelling()):
        return
    raise ParentEnded(f"shard {shard_index} is not launched: its evaluation (flow run {parent_run_id}) is "
                      f"{state.name} ({state.message or 'no message'})")


def check_models(plan: EvalPlan) -> None:
    """CheckpointError unless the plan's model (and reference) folders still hold what was planned."""
    check_unchanged(plan.model)
    if plan.reference is not None:
        check_unchanged(plan.reference, "reference model")

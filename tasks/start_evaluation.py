"""start-evaluation task: start the evaluation flow run of one checkpoint on its benchmarks without waiting for it."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.deployments import run_deployment

from evaldag.runtime import liveness, relaunch
from evaldag.runtime.liveness import is_lost_run_crash, settled
from evaldag.runtime.deployments import SUITE_DEPLOYMENT, evaluation_deployment
from evaldag.events.identity import checkpoint_tag, evaluation_id

_PAGE = 200
# The tag of evaluation flow runs the sweeper (or eval-latest) started under a job name made from the folder's
SWEPT_TAG = "evaldag-swept"
# The tag of a swept evaluation a trainer's event adopted: what it logged to MLflow before is moved to that job
ADOPTED_TAG = "evaldag-adopted"
# The parameters that say whose evaluation it is and where its job's curve goes (not part of its identity)
_JOB_PARAMETERS = ("train_run", "mlflow_parent_run_id", "final_step", "baseline")


@task(name="start-evaluation", persist_result=False, retries=3, retry_delay_seconds=[2, 5, 10])
def start_evaluation(benchmarks: str | list[str], checkpoint: str, step: int, train_run: str,
                     overrides: dict | None = None, relaunch_failed: bool = False,
                     include_cancelled: bool = False, adopt_train_run: bool = False) -> dict:
    """run_deployment keyed by the evaluation's identity (evaldag.events.identity.evaluation_id: the checkpoint, step,
    benchmarks and every override that changes the result): a duplicate request returns the existing flow run
    instead of starting a second one, a full evaluation after a quick slice starts its own. One benchmark runs as
    eval/<benchmark>; several as one eval/suite run, so every gpu slot loads the checkpoint once for all of them.

    With `relaunch_failed`, an evaluation whose first run did not complete is started again under a retry key
    (Prefect would otherwise hand back the failed run forever), as evaldag.runtime.relaunch decides over all its attempts:
    nothing while one of them is still live (the live one is returned), nothing after a completed one, nothing after
    a run a person cancelled unless `include_cancelled`, otherwise exactly one retry. The returned dict's `relaunch`
    says which (None without `relaunch_failed` or when the first run is live or completed).

    The job's name is not part of the identity: an evaluation under another job's name is that job's (the returned
    `train_run`), but the trainer's event adopts one the sweeper started (`adopt_train_run`): `_move_tracked`."""
    names = [benchmarks] if isinstance(benchmarks, str) else list(dict.fromkeys(benchmarks))
    tag = checkpoint_tag(checkpoint, step)
    if adopt_train_run and (known := _train_run_of_earlier_runs(tag)) and known != train_run:
        # the trainer named its job otherwise than the folder: the same checkpoint, one job, one evaluation
        get_run_logger().info("%s step %d was announced as job %s, not %s: evaluating it as %s", checkpoint, step,
                              known, train_run, known)
        train_run = known
    key = evaluation_id(step, names, checkpoint, overrides)
    params = {**(overrides or {}), "checkpoint": checkpoint, "step": step, "train_run": train_run}
    deployment = _deployment_for(names)
    if deployment == SUITE_DEPLOYMENT:
        params["benchmarks"] = names
    run_name = f"{'+'.join(names)}-{train_run}-step{step}"
    # the sweeper's job name is a guess from the folder: its runs are marked so that the trainer's event may adopt them
    tags = [tag, SWEPT_TAG] if adopt_train_run else [tag]
    fr = run_deployment(deployment, parameters=params, idempotency_key=key, timeout=0, flow_run_name=run_name,
                        tags=tags)
    if (fr.parameters or {}).get("train_run", train_run) != train_run:   # this evaluation, started under another name
        if not adopt_train_run and SWEPT_TAG in (fr.tags or []):
            fr = _adopt(fr, params)
        # the evaluation is that job's (now this event's, if adopted): so is a retry of it
        params = {**{k: v for k, v in params.items() if k not in _JOB_PARAMETERS},
                  **{k: fr.parameters[k] for k in _JOB_PARAMETERS if fr.parameters.get(k) is not None}}
        train_run = params["train_run"]
    _move_tracked(fr, names)
    run_name = fr.name                              # a retry is named after the evaluation's first run
    tags = [tag, SWEPT_TAG] if SWEPT_TAG in (fr.tags or []) else [tag]
    action = None
    if relaunch_failed and fr.state and fr.state.is_final() and not fr.state.is_completed():
        decision = _settled_decision(fr, key, [run_name, f"{run_name}-retry"], include_cancelled)
        action, fr = decision.action, decision.run
        if decision.start:
            get_run_logger().warning("%s for %s step %d: its latest run %s ended %s; starting it again", deployment,
                                     train_run, step, fr.name, fr.state.name)
            fr = run_deployment(deployment, parameters=params, idempotency_key=relaunch.retry_key(key, fr),
                                timeout=0, flow_run_name=f"{run_name}-retry", tags=tags)
        elif decision.action == "cancelled":
            get_run_logger().info("%s for %s step %d: %s was cancelled (%s); not starting it again without "
                                  "include_cancelled", deployment, train_run, step, fr.name,
                                  fr.state.message or "no message")
    get_run_logger().info("%s (%s) for %s step %d: flow run %s (%s)", deployment, ", ".join(names), train_run, step,
                          fr.name, fr.state.name if fr.state else "Scheduled")
    return {"benchmark": "+".join(names), "benchmarks": names, "flow_run_id": str(fr.id), "flow_run_name": fr.name,
            "state": fr.state.name if fr.state else "Scheduled", "relaunch": action, "train_run": train_run}


def _adopt(fr: Any, params: dict) -> Any:
    """Make the sweeper's flow run `fr` the evaluation of the job a trainer's event names (`params`): its job and
    where that job's curve goes (train_run, mlflow_parent_run_id, final_step, baseline) are the event's from now
    on, and it is no longer the sweeper's to give away. A run not started yet starts with them; a running one is
    tracked under them (`adopted_plan`, at its track step)."""
    from prefect.client.orchestration import get_client

    job = {k: params.get(k) for k in _JOB_PARAMETERS}
    parameters = {**{k: v for k, v in fr.parameters.items() if k not in _JOB_PARAMETERS},
                  **{k: v for k, v in job.items() if v is not None}}
    tags = [t for t in fr.tags if t != SWEPT_TAG] + [ADOPTED_TAG]
    with get_client(sync_client=True) as client:
        client.update_flow_run(fr.id, parameters=parameters, tags=tags)
        adopted = client.read_flow_run(fr.id)
    get_run_logger().info("flow run %s evaluates this checkpoint with these settings already, started by the sweeper "
                          "as job %s: it is job %s's evaluation from now on", fr.name, fr.parameters.get("train_run"),
                          params["train_run"])
    return adopted


def adopted_plan(plan: Any, flow_run_id: str | None) -> Any:
    """`plan` as the job that owns its flow run now: a trainer's event may adopt an evaluation the sweeper started
    under the folder's name after the plan was resolved (`_adopt`); the track step logs it under the adopting job.
    The plan itself as resolved where no Prefect flow run is behind it, or its job is unchanged."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    try:
        run_id = UUID(str(flow_run_id))
    except ValueError:
        return plan
    with get_client(sync_client=True) as client:
        parameters = client.read_flow_run(run_id).parameters
    from evaldag.tracking.adopt import as_job

    return as_job(plan, {k: parameters.get(k) for k in _JOB_PARAMETERS})


def _move_tracked(fr: Any, names: list[str]) -> None:
    """What the adopted flow run `fr` logged to MLflow before its adoption, moved to the job it evaluates for now
    (evaldag.tracking.adopt.move_to_job): an evaluation that finished before the trainer's late event, or whose
    track step had read its job before. Done by every start that finds it adopted and under way, so that one
    failing half way is finished by the next; what is moved already is not moved again. Nothing for a flow run
    not adopted, or not started yet."""
    if ADOPTED_TAG not in (fr.tags or []) or not fr.state or not (fr.state.is_running() or fr.state.is_completed()):
        return
    from evaldag.tracking.adopt import move_to_job

    moved = move_to_job(str(fr.id), names, {k: fr.parameters.get(k) for k in _JOB_PARAMETERS})
    if moved:
        get_run_logger().info("flow run %s had logged %d MLflow run(s) before its adoption: moved to job %s",
                              fr.name, len(moved), fr.parameters.get("train_run"))


def _settled_decision(fr: Any, key: str, names: list[str], include_cancelled: bool) -> relaunch.Decision:
    """relaunch.decide over the evaluation's attempts, retrying only what is settled: an attempt the lost-run
    automation set Crashed may still run (a clock step, a partition) and undoes that crash within the grace
    (evaldag.runtime.liveness.settled); a retry started before would generate beside it. So such an attempt is read
    again until the grace is over, and the attempts decided on anew."""
    from prefect.client.orchestration import get_client

    def decided() -> relaunch.Decision:
        return relaunch.decide(relaunch.attempts_of(_named_runs(fr.deployment_id, names), key) or [fr],
                               include_cancelled)

    decision = decided()
    if decision.start and is_lost_run_crash(decision.run.state):
        with get_client(sync_client=True) as client:
            settled(lambda: client.read_flow_run(decision.run.id), grace_s=liveness.REVIVE_GRACE_S)
        decision = decided()
    return decision


def _deployment_for(names: list[str]) -> str:
    """eval/<benchmark> for one benchmark, eval/suite for several, and for one whose config was added after the
    deployments were made (no eval/<benchmark>: deployments/prefect.yaml lists the project's own) eval/suite too,
    which evaluates any benchmark config it is given."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    name = evaluation_deployment(names)
    if name == SUITE_DEPLOYMENT:
        return name
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
        except ObjectNotFound:
            get_run_logger().info("no deployment %s: evaluating %s with %s", name, names[0], SUITE_DEPLOYMENT)
            return SUITE_DEPLOYMENT
    return name


def _train_run_of_earlier_runs(tag: str) -> str | None:
    """The train run of the first evaluation flow run tagged `tag` (evaldag.events.identity.checkpoint_tag), if any."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1)
    return runs[0].parameters.get("train_run") if runs else None


def _named_runs(deployment_id: UUID | None, names: list[str]) -> list[Any]:
    """Every flow run of `deployment_id` named one of `names`: the candidates for an evaluation's attempts (the name
    narrows the search on the server; several evaluations share a name, relaunch.attempts_of tells them apart by
    key). All pages: before retries were capped one evaluation could have gathered hundreds."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterName

    runs: list[Any] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)),
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])) if deployment_id
                else None, limit=_PAGE, offset=len(runs))
            runs.extend(page)
            if len(page) < _PAGE:
                return runs

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
    says which (None without `relaunch_failed` or when the first run is live or completed)."""
    names = [benchmarks] if isinstance(benchmarks, str) else list(dict.fromkeys(benchmarks))
    tag = checkpoint_tag(checkpoint, step)
    if adopt_train_run and (known := _train_run_of_earlier_runs(tag)) and known != train_run:
        # the trainer named its job otherwise than the folder: the same checkpoint, one job, one evaluation
        get_run_logger().info("%s step %d was announced as job %s, not %s: evaluating it as %s", checkpoint, step,
                              known, train_run, known)
        train_run = known
    key = evaluation_id(train_run, step, names, checkpoint, overrides)
    params = {**(overrides or {}), "checkpoint": checkpoint, "step": step, "train_run": train_run}
    deployment = _deployment_for(names)
    if deployment == SUITE_DEPLOYMENT:
        params["benchmarks"] = names
    run_name = f"{'+'.join(names)}-{train_run}-step{step}"
    fr = run_deployment(deployment, parameters=params, idempotency_key=key, timeout=0, flow_run_name=run_name,
                        tags=[tag])
    action = None
    if relaunch_failed and fr.state and fr.state.is_final() and not fr.state.is_completed():
        decision = _settled_decision(fr, key, [run_name, f"{run_name}-retry"], include_cancelled)
        action, fr = decision.action, decision.run
        if decision.start:
            get_run_logger().warning("%s for %s step %d: its latest run %s ended %s; starting it again", deployment,
                                     train_run, step, fr.name, fr.state.name)
            fr = run_deployment(deployment, parameters=params, idempotency_key=relaunch.retry_key(key, fr),
                                timeout=0, flow_run_name=f"{run_name}-retry", tags=[tag])
        elif decision.action == "cancelled":
            get_run_logger().info("%s for %s step %d: %s was cancelled (%s); not starting it again without "
                                  "include_cancelled", deployment, train_run, step, fr.name,
                                  fr.state.message or "no message")
    get_run_logger().info("%s (%s) for %s step %d: flow run %s (%s)", deployment, ", ".join(names), train_run, step,
                          fr.name, fr.state.name if fr.state else "Scheduled")
    return {"benchmark": "+".join(names), "benchmarks": names, "flow_run_id": str(fr.id), "flow_run_name": fr.name,
            "state": fr.state.name if fr.state else "Scheduled", "relaunch": action}


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

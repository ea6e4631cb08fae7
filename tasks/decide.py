"""The parent's side of sequential stopping (evaldag.decisions.decide): find what to compare with, then, while the shards
generate, read their chunks and stop them as soon as the verdict is decided."""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Sequence

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import MissingContextError
from prefect.futures import PrefectWrappedFuture

from evaldag.decisions.decide import Decider, Decision, poll_seconds, stop_path
from evaldag.decisions.reach import reach_note
from evaldag.storage import store
from evaldag.request.plan import EvalPlan, load_plan
from evaldag.pipeline.grade import grade_rows
from tasks.retry import retry_transient


@task(name="find-incumbent", persist_result=False,
      retries=3, retry_delay_seconds=[2, 5, 10], retry_condition_fn=retry_transient)
def find_incumbent(plan_path: str):
    """(per-problem scores of every candidate for the job's best so far with the same comparison key, JOB@STEP of
    the best of them), or None (evaldag.tracking.incumbent.best_so_far)."""
    from evaldag.tracking.incumbent import best_so_far

    return best_so_far(load_plan(plan_path))


def deciders_for(plan_paths: Sequence[str], plans: Sequence[EvalPlan]) -> tuple[dict[str, Decider], dict[str, Decision]]:
    """A Decider for each plan that asks for one and has an incumbent; the decision already known for the others
    (one kept from an earlier attempt of this evaluation, or `no_incumbent`). Where the plan's settings cannot reach
    every verdict on its problems (evaldag.decisions.reach: too few for the margin), it says so now, in the log and
    a Prefect artifact, before any shard starts; the decision keeps the statement (Decision.note)."""
    deciders, known = {}, {}
    for path, plan in zip(plan_paths, plans):
        if plan.request.decide is None:
            continue
        if (kept := Decision.load(plan)) is not None:
            known[path] = kept
            if kept.stopped and not stop_path(plan).is_file():
                # the attempt that decided died before it asked its shards to stop: they may still generate
                store.write_text(stop_path(plan), json.dumps({"verdict": kept.verdict, "problems": kept.problems}))
            continue
        found = find_incumbent(path)
        if found is None:
            alpha, margin, _ = plan.decide_settings
            known[path] = Decision("no_incumbent", n_problems=plan.n_problems, alpha=alpha, margin=margin,
                                   note=reach_note(plan))
            note = known[path].note
        else:
            scores, label = found
            deciders[path] = Decider(plan, scores, label, lambda rows, plan=plan: grade_rows(plan, rows))
            note = deciders[path].note
        if note:
            # said before any shard starts: the verdicts these settings cannot reach on this benchmark
            _logger().warning("decide %s: %s", plan.benchmark.name, note)
            create_markdown_artifact(f"**{plan.benchmark.name}**: {note}", key=f"decide-{plan.benchmark.name}",
                                     description="what decide cannot decide on this benchmark, said before it ran")
    return deciders, known


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger (its log in the Prefect UI), or this module's outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def still_running(futures: Sequence[PrefectWrappedFuture], timeout: float) -> list[PrefectWrappedFuture]:
    """The futures not done after waiting up to `timeout` seconds for all of them.

    Not prefect.futures.wait(timeout=...): in a flow run's main thread that bounds the wait with SIGALRM, whose
    handler raises into whatever the thread runs at that instant, an instant that falls on the wait's own timeout
    at every poll. Once in a while it landed inside threading.Condition.wait, between releasing the lock and the
    block that takes it back, and the parent flow failed with "RuntimeError: release unlocked lock" (seen in CI).
    The standard library's wait times out without signals."""
    concurrent.futures.wait([f.wrapped_future for f in futures], timeout=timeout)
    return [f for f in futures if not f.wrapped_future.done()]


def decide_while_generating(futures: list[PrefectWrappedFuture], deciders: dict[str, Decider]) -> dict[str, Decision]:
    """Wait for the shards' futures; meanwhile, every poll_seconds(), let each decider read the new rows: it stops
    the shards of an evaluation once a round is decided, and its decision is final once the shards have finished
    that round's prefix. Returns the final decisions, by plan path."""
    log = get_run_logger()
    decided: dict[str, Decision] = {}
    every = poll_seconds()
    while True:
        running = still_running(futures, every)
        for path, decider in list(deciders.items()):
            asked = decider.stopped_at
            try:
                decision = decider.poll()
            except Exception as e:  # noqa: BLE001 - a failed read (the store, grading) only delays the verdict
                if not running:
                    raise
                log.warning("decide %s: could not read the shards' rows this time (%s: %s); generation goes on and "
                            "the next poll tries again", decider.plan.benchmark.name, type(e).__name__, e)
                continue
            if asked is None and decider.stopped_at is not None:
                log.info("%s: decided at %d of %d problems; the shards finish that prefix and withdraw the rest",
                         decider.plan.benchmark.name, decider.stopped_at, len(decider.order))
            if decision is None:
                if not running and decider.stopped_at is not None:
                    raise RuntimeError(f"{decider.plan.benchmark.name}: decided on the first {decider.stopped_at} "
                                       "problems of its decision order, but the shards ended without generating all "
                                       "of them; run the evaluation again (it generates only what is missing)")
                continue
            decided[path] = decision
            del deciders[path]
            log.info("%s: %s", decider.plan.benchmark.name, decision.describe())
            publish(decider.plan, decision)
        if not running:
            return decided


def publish(plan: EvalPlan, decision: Decision) -> None:
    """The decision as a Prefect artifact of the evaluation's flow run (what the Prefect UI shows of it)."""
    create_markdown_artifact(f"**{plan.benchmark.name}**: {decision.describe()}",
                             key=f"decide-{plan.benchmark.name}", description="sequential verdict vs the job's best")


__all__ = ["decide_while_generating", "deciders_for", "find_incumbent", "publish"]

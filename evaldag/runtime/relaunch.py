"""Whether an evaluation that did not complete is started again: at most one live attempt, a person's cancel kept.

An evaluation (one `evaldag.events.identity.evaluation_id`) has attempts: its first flow run, keyed by the id, and the
retries, keyed `<id>:retry:<suffix>`. The sweeper, eval-latest and repeated checkpoint events ask for a retry when
the first run did not complete; `decide` looks at every attempt and says what to do:

- an attempt is still live (Scheduled, Pending, Running, Paused, Cancelling, AwaitingRetry, Late...: any state that
  is not final): start nothing and hand that run back. Retries used to stack here, one per sweep, all waiting on the
  gpu slots;
- the latest attempt completed: nothing to do;
- the latest attempt was cancelled by a person (see `is_deliberate_cancel`): start nothing unless `include_cancelled`;
- the latest attempt failed or crashed (or Prefect itself cancelled it): start one retry, keyed by `retry_key`. A
  crash by the lost-run automation may be false (the run revives within evaldag.runtime.liveness.REVIVE_GRACE_S):
  start_evaluation reads such an attempt again until that grace is over before it starts a retry beside it.

Pure functions over anything with `id`, `idempotency_key`, `state` and `created` (Prefect's FlowRun): the lookup of
the runs is tasks/start_evaluation.py's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

RETRY_INFIX = ":retry:"

# Cancels that Prefect's server makes by itself (deployment concurrency; prefect/server/orchestration/core_policy.py),
# not at anybody's request: such a run never got to run, so it is retried like a crash.
AUTOMATIC_CANCEL_MESSAGES = (
    "Deployment concurrency limit reached.",
    "Deployment concurrency slot lost during provisioning",
)

Action = Literal["live", "completed", "cancelled", "retry"]


@dataclass(frozen=True)
class Decision:
    """What to do about an evaluation's attempts: `action`, and the attempt it is about (the live one, the latest)."""

    action: Action
    run: Any

    @property
    def start(self) -> bool:
        """True when a new retry is to be started (of `run`, keyed by `retry_key(key, run)`)."""
        return self.action == "retry"


def attempts_of(runs: Iterable[Any], key: str) -> list[Any]:
    """The runs of `runs` that are attempts of the evaluation `key` (keyed `key` or `key:retry:...`), oldest first."""
    prefix = key + RETRY_INFIX
    mine = [r for r in runs if r.idempotency_key == key or (r.idempotency_key or "").startswith(prefix)]
    return sorted(mine, key=lambda r: r.created)


def is_live(state: Any) -> bool:
    """A run in `state` may still run, or is on its way to an end: anything but a final state (no state yet: a run
    just created, Scheduled)."""
    return state is None or not state.is_final()


def is_deliberate_cancel(state: Any) -> bool:
    """Whether `state` is a cancel somebody asked for, which the sweeper must not undo.

    The rule: every Cancelled state counts as a person's, except the few that Prefect's server makes by itself
    (`AUTOMATIC_CANCEL_MESSAGES`). A person cancels through the UI, `prefect flow-run cancel`, `evaldag run`'s
    Ctrl-C or by cancelling the parent flow run: all of these end Cancelled. Automation never does: a worker that
    loses its run, the lost-run automation (evaldag.runtime.cluster) and a killed process all end Crashed, an error ends
    Failed, and those are retried. A doubtful cancel is therefore kept rather than undone: undoing a person's cancel
    every hour is the failure this rule exists to stop, and `include_cancelled` starts such runs on request."""
    if state is None or not state.is_cancelled():
        return False
    message = state.message or ""
    return not any(message.startswith(auto) for auto in AUTOMATIC_CANCEL_MESSAGES)


def decide(attempts: list[Any], include_cancelled: bool = False) -> Decision:
    """What to do about an evaluation whose attempts (`attempts_of`, at least one) are `attempts`; see the module's
    docstring."""
    if not attempts:
        raise ValueError("decide() needs the evaluation's attempts; it has at least its first run")
    live = [r for r in attempts if is_live(r.state)]
    if live:
        return Decision("live", live[-1])
    latest = attempts[-1]
    if latest.state.is_completed():
        return Decision("completed", latest)
    if is_deliberate_cancel(latest.state) and not include_cancelled:
        return Decision("cancelled", latest)
    return Decision("retry", latest)


def retry_key(key: str, failed: Any) -> str:
    """Idempotency key of the retry of attempt `failed`: derived from it, not from the clock, so two sweeps (or a
    sweep and an event) that decide at the same moment to retry the same attempt get one run from Prefect."""
    return f"{key}{RETRY_INFIX}{failed.id}"

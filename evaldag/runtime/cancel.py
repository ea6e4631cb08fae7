"""A person's cancel of an evaluation stands, in every window (issue 51).

A cancel through the API sets the parent flow run Cancelled (or Cancelling) while its process goes on, and Prefect
lets a flow run go on from Cancelled to Completed or Failed: whatever the process proposes next overwrites the
cancel. The server cancels the parent's shard runs only in a loop (every 20 s), so shards that finish inside that
window, a cancel that lands during reduce or track, or an evaluation whose shards were all reused, used to end
Completed with a finished MLflow run. So the parent reads its own state before each irreversible step (launching a
shard, reducing, finishing the MLflow run, returning) and stops there (`KeepingCancel.check`); whatever then ends its
body, a `CancelRequested`, a shard's `ParentEnded` or any other error (a decided round whose shards were cancelled
before its prefix was complete), ends the run Cancelled with the canceller's message when the run was cancelled.

What is left: Prefect has no compare-and-set on a state. A cancel that lands between the body's last read and the
engine's Completed (the result's write and one API call, milliseconds) is undone by `restore_cancel`, an
on_completion hook, which finds it in the run's state history and sets the run Cancelled again; by then the MLflow run
is finished (the read before it is earlier still). A forced cancel after the run's Completed (Prefect rejects an
unforced one) is a cancel of a finished evaluation and is left as it is.
"""

from __future__ import annotations

import logging
from typing import Any

from evaldag.errors import EvalDagError

log = logging.getLogger("evaldag")


class CancelRequested(EvalDagError):
    """The evaluation's own flow run was asked to cancel: it stops before its next irreversible step. An
    EvalDagError, so that no task retries it (tasks.retry)."""


def cancel_state(state: Any) -> bool:
    """Whether `state` is a cancellation (Cancelling or Cancelled), as a person or a script sets it."""
    return state is not None and (state.is_cancelled() or state.is_cancelling())


def read_state(flow_run_id: Any) -> Any:
    """The flow run's current state, read from the API."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


class KeepingCancel:
    """Around a parent flow's body. `check(step)` raises CancelRequested once the flow run is Cancelled or
    Cancelling; any exception that ends the body while it is (that one, a shard's ParentEnded, a decided round's
    RuntimeError) is suppressed, and `state` is then a Cancelled state with the canceller's message, for the flow to
    return as its final state. Outside a flow run (`flow_run_id` None) it does nothing."""

    def __init__(self, flow_run_id: Any) -> None:
        self.flow_run_id = flow_run_id
        self.state = None

    def check(self, step: str) -> None:
        """Raise CancelRequested if the flow run has been asked to cancel; `step` names what it was about to do."""
        if self.flow_run_id is None:
            return
        own = read_state(self.flow_run_id)
        if cancel_state(own):
            raise CancelRequested(f"not {step}: flow run {self.flow_run_id} is {own.name} "
                                  f"({own.message or 'no message'})")

    def __enter__(self) -> "KeepingCancel":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        # BaseExceptions (a worker's SIGTERM, Ctrl-C) are the engine's to report, as Prefect does
        if kind is None or not issubclass(kind, Exception) or self.flow_run_id is None:
            return False
        try:
            own = read_state(self.flow_run_id)
        except Exception:  # noqa: BLE001 - the body's own error is the one to report when the state cannot be read
            log.warning("could not read flow run %s's state after %s", self.flow_run_id, kind.__name__, exc_info=True)
            return False
        if not cancel_state(own):
            return False
        from prefect.states import Cancelled

        log.info("flow run %s was cancelled (%s); it stops here: %s", self.flow_run_id, own.message, exc)
        self.state = Cancelled(message=own.message or str(exc))
        return True


def restore_cancel(flow: Any, flow_run: Any, state: Any) -> None:
    """on_completion hook of a parent flow: a cancel that landed after the body's last check, and that the engine's
    Completed then overwrote, is set again (forced: the person asked first). Read from the run's state history: a
    Cancelling or Cancelled state after the run's latest Running one."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(flow_run.id), key=lambda s: s.timestamp)
        running = [i for i, s in enumerate(states) if s.is_running()]
        cancels = [s for s in states[running[-1] + 1 if running else 0:] if cancel_state(s)]
        if not cancels:
            return
        message = cancels[0].message or "cancelled"
        client.set_flow_run_state(flow_run.id, Cancelled(message=message), force=True)
    log.warning("flow run %s was cancelled (%s) while it returned; its Completed is undone and it ends Cancelled",
                flow_run.id, message)


__all__ = ["CancelRequested", "KeepingCancel", "cancel_state", "read_state", "restore_cancel"]

"""Waking a loop that waits for a flow run the moment the run changes state, instead of at its next poll.

`evaldag run` and the parent's launch-shard task wait for a flow run by reading it every second. A run that ends
just after a read is noticed up to a second late, twice per evaluation (the shard, then the evaluation): about a
second of every evaluation's wall, on the path a user waits for (docs/performance.md). `state_changes` follows the
server's events for one flow run in a thread of its own and sets an Event whenever the run changes state; the loop
waits on it with its poll interval as the timeout. The poll stays the loop's own: a stream that cannot be followed
(a server restarting, a proxy that blocks websockets) only leaves the loop at its poll's pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

LOG = logging.getLogger("evaldag")
# How often the following thread checks whether its loop has ended (between events)
_CHECK_S = 0.5
# How far back the server replays the run's events when the thread subscribes: a change in the moment between the
# caller's last read and the subscription still wakes it (an extra read at worst)
_REPLAY_S = 5.0


async def _follow(flow_run_id: str, changed: threading.Event, done: threading.Event) -> None:
    from prefect.events.clients import get_events_subscriber
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    only_this_run = EventFilter(
        event=EventNameFilter(prefix=["prefect.flow-run."]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
        occurred=EventOccurredFilter(since=datetime.now(timezone.utc) - timedelta(seconds=_REPLAY_S)))
    async with get_events_subscriber(filter=only_this_run, reconnection_attempts=2) as events:
        stream = events.__aiter__()
        while not done.is_set():
            try:
                await asyncio.wait_for(stream.__anext__(), _CHECK_S)
            except asyncio.TimeoutError:
                continue
            changed.set()


def _run(flow_run_id: str, changed: threading.Event, done: threading.Event) -> None:
    try:
        asyncio.run(_follow(flow_run_id, changed, done))
    except Exception as exc:        # noqa: BLE001 - the caller's poll covers any failure of the stream
        LOG.debug("cannot follow flow run %s's events (%s): its waiter polls instead", flow_run_id, exc)


@contextlib.contextmanager
def state_changes(flow_run_id: object) -> Iterator[threading.Event]:
    """An Event set whenever the server reports a state change of flow run `flow_run_id`, for the duration of the
    block. Wait on it with the poll interval as timeout and clear it before each read:
    `changed.wait(poll_s); changed.clear(); run = client.read_flow_run(...)`."""
    changed, done = threading.Event(), threading.Event()
    # in the caller's context: Prefect's settings (the API URL a caller set with temporary_settings) are context
    # variables, which a new thread does not inherit
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(_run, str(flow_run_id), changed, done), daemon=True,
                              name=f"evaldag-run-events-{flow_run_id}")
    thread.start()
    try:
        yield changed
    finally:
        done.set()     # the thread ends within _CHECK_S; a daemon, it never holds the process up


def wait_until_final(client, flow_run_id: object, poll_s: float = 1.0):
    """Read flow run `flow_run_id` with `client` (a sync Prefect client) until its state is final, woken by its state
    changes (state_changes) and at least every `poll_s`; return the final read."""
    with state_changes(flow_run_id) as changed:
        while True:
            changed.clear()
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.is_final():
                return run
            changed.wait(poll_s)


__all__ = ["state_changes", "wait_until_final"]

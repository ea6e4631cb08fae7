"""The stack's workers: Prefect's process worker, woken the moment a flow run of its pool is scheduled.

`python -m evaldag.runtime.wake_worker --pool POOL --name NAME --limit N` runs what `prefect worker start --type
process` runs (the same worker class, loops and signal handling) and beside it follows the server's event stream:
when a flow run of its pool enters a scheduled state (Scheduled, AwaitingRetry, ...), it polls for flow runs at once.

Why. A Prefect worker finds its flow runs by polling (PREFECT_WORKER_QUERY_SECONDS), and each poll is a request the
server answers with SQLite reads and writes: two workers polling every 2 s kept an idle server at 6-7 % of a core
(docs/performance.md, "The idle stack"), and a run scheduled just after a poll waited for the next one. Woken by
the event, a flow run starts within a fraction of a second, so the poll only covers what the stream can miss (a
stream that is down while the server restarts, a run scheduled for later) and can be slow. Scheduling only: which
runs start, and their exactly-once proposal to Pending, are the worker's own, unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from datetime import datetime, timedelta, timezone
from collections.abc import Awaitable, Callable

import anyio

LOG = logging.getLogger("evaldag.wake_worker")
# How long the wake waits before following the event stream again after it failed (a server restarting): the
# worker's own poll covers the gap, so this only bounds how long runs start at the poll's pace
RETRY_S = 2.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def wakes(event, pool: str) -> bool:
    """Whether `event` (a Prefect event) says a flow run of work pool `pool` is now scheduled."""
    if not event.event.startswith("prefect.flow-run.") or event.resource.get("prefect.state-type") != "SCHEDULED":
        return False
    return any(r.role == "work-pool" and r.name == pool for r in event.related)


async def wake_on_schedule(pool: str, poll: Callable[[], Awaitable[list]], retry_s: float = RETRY_S) -> None:
    """Follow the server's flow-run events for ever and call `poll` (the worker's get_and_submit_flow_runs) when
    one of `pool` is scheduled; a stream that fails is followed again after `retry_s` (the worker's own poll covers
    the gap)."""
    from prefect.events.clients import get_events_subscriber
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

    warned = False
    while True:
        # from a moment before (re)subscribing: the server replays what matches, and older runs were polled for
        since = datetime.now(timezone.utc) - timedelta(seconds=retry_s + 5)
        flow_runs = EventFilter(event=EventNameFilter(prefix=["prefect.flow-run."]),
                                occurred=EventOccurredFilter(since=since))
        try:
            async with get_events_subscriber(filter=flow_runs, reconnection_attempts=2) as events:
                warned = False
                async for event in events:
                    if wakes(event, pool):
                        # one poll: a run it misses (scheduled for later, or not visible yet) is the worker's own
                        # poll's, as without the wake
                        await poll()
        except Exception as exc:          # noqa: BLE001 - any failure of the stream: the poll covers, retry
            # said once per outage: a server restarting drops it for seconds, a proxy that blocks websockets for good
            (LOG.debug if warned else LOG.warning)(
                "cannot follow the Prefect server's events (%s): flow runs of pool %r start at the workers' poll "
                "(PREFECT_WORKER_QUERY_SECONDS) until it is back; trying again every %.0f s", exc, pool, retry_s)
            warned = True
        await anyio.sleep(retry_s)


async def serve(pool: str, name: str, limit: int | None) -> None:
    """Run the process worker of `pool` and its wake until the worker stops."""
    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS
    from prefect.workers.process import ProcessWorker

    worker = ProcessWorker(name=name, work_pool_name=pool, limit=limit,
                           prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
                           heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()))
    loop = asyncio.get_running_loop()
    async with anyio.create_task_group() as group:

        def stop() -> None:
            # the first SIGINT or SIGTERM stops the worker (as `prefect worker start`'s first); a second kills
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            group.cancel_scope.cancel()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop)
        group.start_soon(wake_on_schedule, pool, worker.get_and_submit_flow_runs)
        await worker.start()
        group.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.pool, args.name, args.limit))
    print(f"Worker {args.name!r} stopped!")


if __name__ == "__main__":
    main()

"""A flow run that the lost-run automation set Crashed while its process still runs.

The automation (evaldag.runtime.cluster.crash_automation) judges silence on the server's wall clock. A clock step on the head
(NTP, a VM resumed after a pause) or a network partition longer than the window makes every live run look silent
at once, and the automation crashes them all. What each kind of run does when it finds itself crashed that way:
- an evaluation (the parent flow) is the only one that will ever finish its evaluation: it sets itself Running
  again and goes on (`revive`);
- a shard is relaunched by its parent as soon as it is seen Crashed: the old process must stop, so that two
  processes never generate the same shard (`fence`).
Followers of a parent (`evaldag run`, a parent's launch task) give such a crash `REVIVE_GRACE_S` to be undone
before taking it as final (`settled`). A run whose process is really gone never revives: nothing changes for it.

A watchdog thread (`watch_for_false_crash`) polls the run's own state every `POLL_S` seconds (one small API read);
it stops, and is joined, when the flow's body ends, and never forces a state over a final state or a cancellation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from evaldag.runtime.cluster import CRASH_AUTOMATION

# Each poll costs the server CPU (every 5 s: 0.4 % of a core per run, docs/performance.md). Prefect's own heartbeat
# is every 30 s.
POLL_S = 5.0
REVIVE_GRACE_S = 3 * POLL_S   # a parent undoes a false crash within one poll and one API round trip
STOP_WAIT_S = 10.0            # how long the end of a flow's body waits for its watcher's read in flight

log = logging.getLogger("evaldag")


def is_lost_run_crash(state: Any) -> bool:
    """Whether `state` is the Crashed state the lost-run automation sets (not one the run's own engine reported)."""
    return (state is not None and getattr(state.type, "value", state.type) == "CRASHED"
            and CRASH_AUTOMATION in (state.message or ""))


def revive(client: Any, flow_run_id: Any, crashed: Any) -> None:
    """Set the live flow run `flow_run_id` Running again after a false crash; until then Prefect lets none of its
    tasks start. Forced: the orchestration rules for a run entering Running are meant for one that starts.

    Only while the run is still in the automation's crash: the state is read again first, since a forced state
    overrides whatever came after the watcher's read (the engine's Completed, a person's Cancelling). A crash that
    cut a person's cancellation short gets that Cancelling back instead, so that the cancellation goes on (the
    worker stops the run) as the person asked. Prefect has no compare-and-set: a change in the milliseconds
    between this read and the write is not seen."""
    from prefect.states import Cancelling, Running

    current = client.read_flow_run(flow_run_id).state
    if not is_lost_run_crash(current):
        log.info("flow run %s is %s now, no longer crashed by %r: left as it is", flow_run_id,
                 getattr(current, "type", None), CRASH_AUTOMATION)
        return
    before = _state_before_crash(client, flow_run_id)
    kind = getattr(getattr(before, "type", None), "value", None)
    if kind == "CANCELLING":
        client.set_flow_run_state(flow_run_id, Cancelling(message=before.message), force=True)
        log.warning("flow run %s was being cancelled when %r set it Crashed: its cancellation is restored, it is "
                    "not resumed", flow_run_id, CRASH_AUTOMATION)
        return
    if kind == "CANCELLED":   # never resumed; the automation stops watching a run at its final state anyway
        return
    client.set_flow_run_state(flow_run_id, Running(message=(
        f"still alive: the crash ({crashed.message}) came from a missed heartbeat window (a clock step or a pause of "
        "the head, a network partition); resumed")), force=True)
    log.warning("flow run %s was set Crashed by %r while it still runs: set Running again", flow_run_id,
                CRASH_AUTOMATION)


def _state_before_crash(client: Any, flow_run_id: Any) -> Any:
    """The run's last state before its current lost-run crash (None if it has none): what the automation cut off."""
    states = sorted(client.read_flow_run_states(flow_run_id), key=lambda s: s.timestamp)
    earlier = [s for s in states if not is_lost_run_crash(s)]
    return earlier[-1] if earlier else None


def fence(client: Any, flow_run_id: Any, crashed: Any) -> None:
    """Stop this flow run's processes: it was declared lost and its parent relaunches it. SIGTERM to the run's
    process group, as a worker's cancellation sends it: the engine and its children (vLLM's workers) stop the way
    they do for any stop. Only for a run that leads its own group (a deployed run; evaldag.runtime.flow_run_launcher)."""
    log.warning("flow run %s was set Crashed by %r while it still runs; its parent relaunches it, so this process "
                "stops", flow_run_id, CRASH_AUTOMATION)
    os.killpg(os.getpgrp(), signal.SIGTERM)


@contextlib.contextmanager
def watch_for_false_crash(flow_run_id: Any, on_crash: Callable[[Any, Any, Any], None],
                          poll_s: float = POLL_S) -> Iterator[None]:
    """While the block runs, call `on_crash(client, flow_run_id, state)` each time the run is found in the lost-run
    automation's Crashed state. A failed read (a server restart) is tried again at the next poll."""
    from prefect.client.orchestration import get_client

    if flow_run_id is None:   # the flow's function called outside a flow run: there is no state to watch
        yield
        return
    stop = threading.Event()
    # held while on_crash acts; the block's end takes it to set `stop`, so no state is forced once the flow's body
    # has returned (the engine sets the final state next, and a late revive would overwrite it with Running)
    acting = threading.Lock()

    def watch() -> None:
        with get_client(sync_client=True) as client:
            while not stop.wait(poll_s):
                try:
                    state = client.read_flow_run(flow_run_id).state
                    if is_lost_run_crash(state):
                        with acting:
                            if stop.is_set():
                                break
                            on_crash(client, flow_run_id, state)
                except Exception:  # noqa: BLE001 - the next poll tries again; the run must not die of its watchdog
                    log.debug("liveness poll of flow run %s failed", flow_run_id, exc_info=True)

    thread = threading.Thread(target=watch, name="evaldag-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with acting:
            stop.set()
        # bounded: a read in flight against a server that is down would hold the flow's end for the client's whole
        # timeout; such a thread acts on nothing any more (`stop` is checked under `acting`) and ends with its read
        thread.join(STOP_WAIT_S)
        if thread.is_alive():
            log.debug("liveness watcher of flow run %s still waits for its last read; it will change nothing",
                      flow_run_id)


def settled(read_run: Callable[[], Any], grace_s: float = REVIVE_GRACE_S, poll_s: float = 1.0) -> Any:
    """The flow run `read_run()` returns, read again for up to `grace_s` seconds while it is in the lost-run
    automation's Crashed state: a parent that still runs undoes that crash (see `revive`), so only a crash that
    stays is returned as final."""
    run = read_run()
    deadline = time.monotonic() + grace_s
    while is_lost_run_crash(run.state) and time.monotonic() < deadline:
        time.sleep(poll_s)
        run = read_run()
    return run


__all__ = ["POLL_S", "REVIVE_GRACE_S", "STOP_WAIT_S", "fence", "is_lost_run_crash", "revive", "settled",
           "watch_for_false_crash"]

"""evaldag.liveness without a server: which crashes are the lost-run automation's, and how followers wait for a
parent to undo one."""

from __future__ import annotations

from types import SimpleNamespace

from prefect.states import Completed, Crashed, Running

from evaldag import liveness
from evaldag.cluster import MIN_HEARTBEAT_S, crash_automation

AUTOMATION_CRASH = crash_automation(MIN_HEARTBEAT_S).actions[0].message


def _runs(*states):
    """A read_run function that returns a flow run in each of `states` in turn (the last one from then on)."""
    seq = list(states)
    return lambda: SimpleNamespace(state=seq.pop(0) if len(seq) > 1 else seq[0])


def test_only_the_automations_crash_counts():
    assert liveness.is_lost_run_crash(Crashed(message=AUTOMATION_CRASH))
    assert not liveness.is_lost_run_crash(Crashed(message="Execution was interrupted by SIGTERM"))
    assert not liveness.is_lost_run_crash(Running())
    assert not liveness.is_lost_run_crash(None)


def test_settled_waits_for_a_revival():
    run = liveness.settled(_runs(Crashed(message=AUTOMATION_CRASH), Crashed(message=AUTOMATION_CRASH), Running()),
                           grace_s=5, poll_s=0.01)
    assert run.state.is_running()


def test_settled_returns_a_crash_that_stays_and_any_other_state_at_once():
    run = liveness.settled(_runs(Crashed(message=AUTOMATION_CRASH)), grace_s=0.05, poll_s=0.01)
    assert liveness.is_lost_run_crash(run.state)
    reads = []
    done = liveness.settled(lambda: reads.append(1) or SimpleNamespace(state=Completed()), grace_s=5, poll_s=0.01)
    assert done.state.is_completed() and len(reads) == 1


def test_no_watchdog_outside_a_flow_run():
    calls = []
    with liveness.watch_for_false_crash(None, lambda *a: calls.append(a), poll_s=0.01):
        pass
    assert calls == []

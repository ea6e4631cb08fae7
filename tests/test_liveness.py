"""evaldag.runtime.liveness without a server: which crashes are the lost-run automation's, how followers wait for a parent
to undo one, and what the watchdog does (revive, fence, nothing) with a fake client that returns scripted states."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from prefect.states import Cancelled, Cancelling, Completed, Crashed, Failed, Running

from evaldag.runtime import liveness
from evaldag.runtime.cluster import MIN_HEARTBEAT_S, crash_automation

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



# ------------------------------------------------------------ the watchdog (watch_for_false_crash) with a fake client


class FakeClient:
    """A Prefect client with a scripted flow run: each read returns the next of `states` (the last one from then on,
    and whatever `set_flow_run_state` set after that). Records every state set and the forced ones."""

    def __init__(self, *states, history=None, read_delay_s: float = 0.0):
        self.script = list(states)
        self.current = self.script[0]
        self.history = history
        self.read_delay_s = read_delay_s
        self.reads = 0
        self.sets: list[tuple] = []
        self.lock = threading.Lock()

    def read_flow_run(self, flow_run_id):
        time.sleep(self.read_delay_s)
        with self.lock:
            self.reads += 1
            if self.script:
                self.current = self.script.pop(0)
            return SimpleNamespace(id=flow_run_id, state=self.current)

    def read_flow_run_states(self, flow_run_id):
        with self.lock:
            return list(self.history if self.history is not None else [Running(), self.current])

    def set_flow_run_state(self, flow_run_id, state, force=False):
        with self.lock:
            self.sets.append((flow_run_id, state, force))
            self.current, self.script = state, []


@pytest.fixture
def fake_prefect(monkeypatch):
    """Route get_client (as watch_for_false_crash imports it) to the FakeClient the test installs."""
    import prefect.client.orchestration as orchestration

    holder = {}

    @contextlib.contextmanager
    def get_client(sync_client=False):
        assert sync_client
        holder.setdefault("opened", 0)
        holder["opened"] += 1
        yield holder["client"]

    monkeypatch.setattr(orchestration, "get_client", get_client)
    return holder


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _watchers():
    return [t for t in threading.enumerate() if t.name == "evaldag-liveness"]


def test_a_live_parent_crashed_by_the_automation_is_set_running_again(fake_prefect):
    client = fake_prefect["client"] = FakeClient(Running(), Crashed(message=AUTOMATION_CRASH))
    with liveness.watch_for_false_crash("run-1", liveness.revive, poll_s=0.01):
        _until(lambda: client.sets)
    [(run_id, state, force)] = client.sets
    assert run_id == "run-1" and state.is_running() and force and "still alive" in state.message


def test_a_deployed_shard_crashed_by_the_automation_stops_its_process_group(fake_prefect, monkeypatch):
    killed = []
    monkeypatch.setattr(liveness.os, "killpg", lambda pgid, sig: killed.append((pgid, sig)))
    client = fake_prefect["client"] = FakeClient(Running(), Crashed(message=AUTOMATION_CRASH))
    with liveness.watch_for_false_crash("shard-1", liveness.fence, poll_s=0.01):
        _until(lambda: killed)
    assert killed[0] == (os.getpgrp(), signal.SIGTERM)
    assert client.sets == []                                   # a fenced shard is relaunched, never revived


@pytest.mark.parametrize("final", [Completed(), Cancelling(), Cancelled(), Failed(),
                                   Crashed(message="Execution was interrupted by SIGTERM")],
                         ids=lambda s: s.type.value)
def test_nothing_is_forced_over_a_final_state_a_cancellation_or_the_engines_own_crash(fake_prefect, final):
    client = fake_prefect["client"] = FakeClient(Running(), final)
    calls = []
    with liveness.watch_for_false_crash("run-1", lambda *a: calls.append(a), poll_s=0.01):
        _until(lambda: client.reads >= 5)
    assert calls == [] and client.sets == []


def test_revive_forces_nothing_when_the_run_moved_on_since_the_crash_was_read():
    # the watcher read the automation's crash; by the time it acts the run has completed or a person cancels it
    crash = Crashed(message=AUTOMATION_CRASH)
    for now in (Completed(), Cancelling(), Cancelled()):
        client = FakeClient(now)
        liveness.revive(client, "run-1", crash)
        assert client.sets == [], now.type


def test_revive_gives_back_a_cancellation_the_automation_crashed():
    # a person set Cancelling, then the automation's window ran out: the run must not be set Running again, and the
    # person's cancellation goes on (the worker stops the run)
    crash, asked, started = Crashed(message=AUTOMATION_CRASH), Cancelling(message="cancelled by a person"), Running()
    t0 = started.timestamp
    started.timestamp, asked.timestamp, crash.timestamp = t0, t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)
    client = FakeClient(crash, history=[crash, started, asked])        # the server's order is not relied on
    liveness.revive(client, "run-1", crash)
    [(_, state, force)] = client.sets
    assert state.type.value == "CANCELLING" and state.message == "cancelled by a person" and force


def test_the_watcher_stops_and_is_joined_when_the_block_ends(fake_prefect):
    # a slow server: the block ends while a poll is in flight
    client = fake_prefect["client"] = FakeClient(Running(), read_delay_s=0.2)
    with liveness.watch_for_false_crash("run-1", lambda *a: None, poll_s=0.01):
        _until(lambda: _watchers())
        time.sleep(0.05)
    assert _watchers() == []
    reads = client.reads
    time.sleep(0.3)
    assert client.reads == reads                                 # no poll after the block


def test_no_state_is_forced_once_the_block_has_ended(fake_prefect):
    # the poll in flight when the flow's body returns finds the crash: the engine is about to set the final state,
    # which a late revive would overwrite with Running
    client = fake_prefect["client"] = FakeClient(Crashed(message=AUTOMATION_CRASH), read_delay_s=0.2)
    calls = []
    with liveness.watch_for_false_crash("run-1", lambda *a: calls.append(a), poll_s=0.01):
        time.sleep(0.05)                                         # the first poll is reading
    time.sleep(0.4)
    assert client.reads >= 1, "the watchdog never read the run: the test would pass for the wrong reason"
    assert calls == []


def test_no_watchdog_outside_a_flow_run(fake_prefect):
    fake_prefect["client"] = FakeClient(Crashed(message=AUTOMATION_CRASH))
    calls = []
    with liveness.watch_for_false_crash(None, lambda *a: calls.append(a), poll_s=0.01):
        time.sleep(0.1)                                          # ten polls' time
        assert _watchers() == []
    assert calls == [] and "opened" not in fake_prefect         # no client, no thread, no call

"""evaldag.runtime.cancel against Prefect's in-process test server: a flow run cancelled through the API (forced
Cancelled, its process goes on) ends Cancelled whatever ends its body, and a cancel that lands after the body's last
check is set again over the engine's Completed. The windows of a real evaluation: tests/test_cancel_windows_e2e.py."""

from __future__ import annotations

import pytest
from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Cancelled

from evaldag.runtime.cancel import CancelRequested, KeepingCancel, restore_cancel

MESSAGE = "cancelled by a script"


@pytest.fixture(scope="module", autouse=True)
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _client():
    from prefect import get_client

    return get_client(sync_client=True)


def _cancel_own_run() -> None:
    with _client() as client:
        client.set_flow_run_state(flow_run.id, Cancelled(message=MESSAGE), force=True)


def _history(state) -> list[str]:
    with _client() as client:
        run_id = state.state_details.flow_run_id
        return [s.type.value for s in sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)]


@flow
def _decided_round_then_error():
    """As a decided evaluation whose shards the server cancelled before they finished its prefix: the decide loop
    raises a RuntimeError once the flow run is Cancelled."""
    with KeepingCancel(flow_run.id) as cancel:
        _cancel_own_run()
        raise RuntimeError("decided on the first 4 problems of its decision order, but the shards ended without "
                           "generating all of them")
    return cancel.state


def test_an_error_after_a_cancel_ends_cancelled_not_failed():
    state = _decided_round_then_error(return_state=True)
    assert state.is_cancelled() and state.message == MESSAGE, (state.type, state.message)
    assert "FAILED" not in _history(state)


@flow
def _checked_before_returning():
    with KeepingCancel(flow_run.id) as cancel:
        _cancel_own_run()
        cancel.check("returning Completed")
        return "logged"
    return cancel.state


def test_the_check_stops_the_body():
    state = _checked_before_returning(return_state=True)
    assert state.is_cancelled() and state.message == MESSAGE
    assert "COMPLETED" not in _history(state)
    with pytest.raises(CancelRequested):
        KeepingCancel(state.state_details.flow_run_id).check("anything")


@flow(on_completion=[restore_cancel])
def _cancelled_after_its_last_check():
    with KeepingCancel(flow_run.id) as cancel:
        cancel.check("returning Completed")
        _cancel_own_run()         # the person's cancel lands between the last check and the engine's Completed
        return "logged"
    return cancel.state


def test_a_cancel_after_the_last_check_is_set_again_over_completed():
    state = _cancelled_after_its_last_check(return_state=True)
    assert state.is_completed()                    # what the engine proposed, and Prefect accepted over Cancelled
    with _client() as client:
        final = client.read_flow_run(state.state_details.flow_run_id).state
    assert final.is_cancelled() and final.message == MESSAGE, (final.type, final.message)
    assert _history(state)[-3:] == ["CANCELLED", "COMPLETED", "CANCELLED"]


def test_outside_a_flow_run_nothing_is_read():
    KeepingCancel(None).check("anything")
    with pytest.raises(ValueError), KeepingCancel(None):
        raise ValueError("kept")

"""Which server events wake a stack worker (evaldag.runtime.wake_worker.wakes): a flow run of its own pool that
enters a scheduled state, nothing else. Its end-to-end behaviour (a run leaves Scheduled within seconds on a 300 s
poll) is tests/test_stack.py's."""

from __future__ import annotations

from uuid import uuid4

import pytest
from prefect.events import Event

from evaldag.runtime.wake_worker import wakes


def _event(name: str, state_type: str, pool: str) -> Event:
    run = uuid4()
    return Event(event=name, resource={"prefect.resource.id": f"prefect.flow-run.{run}",
                                       "prefect.state-type": state_type, "prefect.state-name": name.rsplit(".")[-1]},
                 related=[{"prefect.resource.id": f"prefect.work-pool.{uuid4()}", "prefect.resource.role": "work-pool",
                           "prefect.resource.name": pool},
                          {"prefect.resource.id": f"prefect.flow.{uuid4()}", "prefect.resource.role": "flow",
                           "prefect.resource.name": "gpu"}])


@pytest.mark.parametrize("name,state_type,pool,woken", [
    ("prefect.flow-run.Scheduled", "SCHEDULED", "gpu", True),
    ("prefect.flow-run.AwaitingRetry", "SCHEDULED", "gpu", True),      # a retry is scheduled again
    ("prefect.flow-run.Scheduled", "SCHEDULED", "cpu", False),         # another pool's run
    ("prefect.flow-run.Running", "RUNNING", "gpu", False),
    ("prefect.task-run.Scheduled", "SCHEDULED", "gpu", False),         # a task run is no worker's business
])
def test_a_worker_is_woken_by_its_own_pools_scheduled_flow_runs_only(name, state_type, pool, woken):
    assert wakes(_event(name, state_type, pool), "gpu") is woken

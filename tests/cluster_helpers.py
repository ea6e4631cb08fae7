"""Helpers of the fault tests that kill whole nodes: Prefect reads, waiting, finding and killing processes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable

import psutil


def wait(predicate: Callable[[], Any], timeout: float = 600.0, every: float = 1.0) -> Any:
    """The first truthy value of `predicate()`, polled every `every` s; AssertionError after `timeout` s."""
    end = time.time() + timeout
    while time.time() < end:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def _run(coro_fn):
    from prefect.client.orchestration import get_client

    async def go():
        async with get_client() as client:
            return await coro_fn(client)
    return asyncio.run(go())


def flow_run(flow_run_id):
    """The flow run as the server has it now."""
    return _run(lambda c: c.read_flow_run(flow_run_id))


def state_history(flow_run_id) -> list:
    """Every state the flow run went through, oldest first."""
    return sorted(_run(lambda c: c.read_flow_run_states(flow_run_id)), key=lambda s: s.timestamp)


def wait_final(flow_run_id, timeout: float = 900.0):
    """The flow run's final state, once it has one."""
    return wait(lambda: (s := flow_run(flow_run_id).state) and s.is_final() and s, timeout=timeout, every=2)


def children(parent_id) -> list:
    """The flow runs started by the parent flow run `parent_id` (its shard runs)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return _run(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]))))


def flow_run_processes(flow_run_id) -> list[psutil.Process]:
    """This machine's processes of one flow run (the worker hands PREFECT__FLOW_RUN_ID to it and its children)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id):
                found.append(p)
    return found


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL every process at once (a lost node says nothing), then wait until they are gone."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)

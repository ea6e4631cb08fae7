"""evaldag.runtime.stack.processes stopping a component with real processes (no servers): a recorded process that
leads no process group of its own (one stopped before its setsid) is signalled itself, not only through the group.
And the command the stack's pools start flow runs with."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from evaldag.runtime.stack import Stack, StackSettings, processes


def test_a_component_outside_a_group_of_its_own_is_stopped_too(tmp_path):
    # no start_new_session: the child stays in pytest's process group, as one stopped before its setsid would be
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    processes._CHILDREN[proc.pid] = proc
    try:
        rec = {"kind": "worker", "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
               "start_ticks": processes.start_ticks(proc.pid)}
        stack = Stack(StackSettings(home=tmp_path, stop_timeout_s=1))
        stack._terminate([rec], (signal.SIGTERM,))
        assert proc.wait(timeout=1) == -signal.SIGTERM           # the first signal reached it, not SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Patches:
    """An httpx.Client stand-in that records PATCH bodies."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def patch(self, url: str, json: dict):
        self.sent.append((url, json))
        return type("Answer", (), {"status_code": 200, "text": ""})()


def _pool(command: str | None) -> dict:
    return {"type": "process",
            "base_job_template": {"variables": {"properties": {"command": {"default": command}}}}}


def test_a_pool_gets_the_launcher_command_unless_it_has_its_own():
    """A pool without a command, or with the launcher's former module path (evaldag.flow_run_launcher, before the
    runtime package), gets the current command; a command the user set stays."""
    from evaldag.runtime.stack.prefect_setup import FLOW_RUN_COMMAND, PrefectSetup

    assert FLOW_RUN_COMMAND == "python -m evaldag.runtime.flow_run_launcher"
    for before in (None, "python -m evaldag.flow_run_launcher"):
        client = _Patches()
        PrefectSetup._update_pool(client, "gpu", _pool(before))
        [(url, body)] = client.sent
        assert url == "/work_pools/gpu"
        assert body["base_job_template"]["variables"]["properties"]["command"]["default"] == FLOW_RUN_COMMAND
    client = _Patches()
    PrefectSetup._update_pool(client, "gpu", _pool("my-launcher --flag"))
    assert client.sent == []

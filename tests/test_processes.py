"""evaldag.stack.processes stopping a component with real processes (no servers): a recorded process that leads no
process group of its own (one stopped before its setsid) is signalled itself, not only through the group."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from evaldag.stack import Stack, StackSettings, processes


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

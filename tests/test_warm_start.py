"""evaldag.warm_start with the flow-run launcher: runs forked by a worker's warm server (imports done once), with
what a cold start guarantees: the launcher's streams, folder, environment and argv; stop signals reaching the run's
group; the run dying with its launcher and with its worker; the exit status passed on; a cold start whenever the
server cannot give the run what a fresh interpreter would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from evaldag.warm_start import SOCKET_ENV

# Preloaded by the server: counts its imports in a file, and sets a variable (as torch and polars do at import).
PROBE = ("import os\nwith open(os.environ['PROBE_COUNT'], 'a') as f: f.write('x')\n"
         "os.environ['PROBE_SET'] = 'at import'\n")
# The run: reports where and how it runs, optionally starts a child and waits, then exits with a given code.
RUN = textwrap.dedent("""
    import json, os, subprocess, sys, time
    out, code, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "wait"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) if wait else None
    info = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv[1:],
            "flow_run": os.environ.get("PREFECT__FLOW_RUN_ID"), "preloaded": "warmprobe" in sys.modules,
            "probe_set": os.environ.get("PROBE_SET"),
            "child": child.pid if child else None}
    print("hello from the run", flush=True)
    with open(out + ".tmp", "w") as f: json.dump(info, f)
    os.replace(out + ".tmp", out)
    if wait: time.sleep(600)
    sys.exit(code)
""")


class _Worker:
    """A stand-in worker (a sleeping interpreter) started through warm_start with its server."""

    def __init__(self, tmp_path: Path) -> None:
        lib = tmp_path / "lib"
        lib.mkdir()
        (lib / "warmprobe.py").write_text(PROBE)
        (lib / "warmrun.py").write_text(RUN)
        self.count = tmp_path / "count"
        self.socket = str(tmp_path / "run" / "warm.sock")
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lib), *sys.path]),
                    "PROBE_COUNT": str(self.count)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import runpy; runpy.run_module('evaldag.warm_start', run_name='__main__')",
             self.socket, "warmprobe", "--", sys.executable, "-c", "import time; time.sleep(600)"],
            env=self.env, start_new_session=True)
        deadline = time.monotonic() + 60
        while not Path(self.socket).exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, "the warm server did not start"
            time.sleep(0.05)
        [self.server] = psutil.Process(self.proc.pid).children()

    def launcher(self, out: Path, code: int = 0, wait: bool = False, **env: str) -> subprocess.Popen:
        """The flow-run launcher running `warmrun` as the worker would start it (its environment, a run id)."""
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; from evaldag.flow_run_launcher import run_program; "
             "sys.exit(run_program('warmrun', sys.argv[1:]))", str(out), str(code), "wait" if wait else "no"],
            env={**self.env, SOCKET_ENV: self.socket, "PREFECT__FLOW_RUN_ID": "run-1", **env},
            cwd=out.parent, stdout=subprocess.PIPE, stderr=open(out.parent / "launcher.err", "a"), text=True)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def worker(tmp_path):
    w = _Worker(tmp_path)
    yield w
    w.close()


def _info(out: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not out.is_file():
        assert time.monotonic() < deadline, "the run did not report"
        time.sleep(0.05)
    return json.loads(out.read_text())


@pytest.fixture
def workdir(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def test_runs_are_forks_of_the_warm_server_with_the_launchers_streams_folder_and_argv(worker, workdir):
    for i, code in enumerate((0, 3)):
        out = workdir / f"info-{i}.json"
        launcher = worker.launcher(out, code)
        stdout, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == code, (workdir / "launcher.err").read_text()
        info = _info(out)
        assert info["ppid"] == worker.server.pid and info["preloaded"], info     # forked, imports already done
        assert info["sid"] == info["pid"] != os.getsid(0)                      # a session of its own
        assert info["cwd"] == str(workdir) and info["argv"] == [str(out), str(code), "no"]
        assert info["flow_run"] == "run-1" and stdout == "hello from the run\n"
        assert info["probe_set"] == "at import"             # what the import set, as a cold import would
    assert worker.count.read_text() == "x"                  # imported once, by the server, not by each run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_reaches_the_run_and_its_children(worker, workdir, sig):
    out = workdir / "info.json"
    launcher = worker.launcher(out, wait=True)
    info = _info(out)
    procs = [psutil.Process(info["pid"]), psutil.Process(info["child"])]
    launcher.send_signal(sig)
    _, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive
    assert launcher.wait(20) == -sig                        # ended by `sig`, as the run was


def test_the_run_dies_with_a_killed_launcher(worker, workdir):
    out = workdir / "info.json"
    launcher = worker.launcher(out, wait=True)
    run = psutil.Process(_info(out)["pid"])
    assert run.name() == "evaldag-run"
    # `evaldag down` finds a stack's leftovers by the environment a process was started with: the server's here
    assert run.environ().get("PROBE_COUNT") == str(worker.count)
    launcher.kill()
    launcher.wait(20)
    _, alive = psutil.wait_procs([run, psutil.Process(_info(out)["child"])], timeout=20)
    assert not alive
    assert worker.server.is_running()                       # the server goes on for the next runs


def test_the_server_and_its_runs_die_with_the_worker(worker, workdir):
    """A lost node: the worker is killed; its server and the runs it forked do not outlive it."""
    out = workdir / "info.json"
    launcher = worker.launcher(out, wait=True)
    info = _info(out)
    run, child = psutil.Process(info["pid"]), psutil.Process(info["child"])
    worker.proc.kill()                                      # the worker alone, as `kill -9 <worker pid>`
    _, alive = psutil.wait_procs([worker.server, run, child], timeout=20)
    assert not alive
    assert launcher.wait(20) == -signal.SIGKILL             # its launcher reports the run killed


def test_a_run_with_another_environment_starts_cold(worker, workdir):
    out = workdir / "info.json"
    launcher = worker.launcher(out, code=4, HF_HUB_OFFLINE="0")   # read at import: a fork would miss it
    assert launcher.wait(60) == 4
    info = _info(out)
    assert info["ppid"] != worker.server.pid and not info["preloaded"]
    stderr = (workdir / "launcher.err").read_text()
    assert "environment differs in HF_HUB_OFFLINE; starting the run cold" in stderr, stderr


def test_without_a_server_the_run_starts_cold(worker, workdir):
    out = workdir / "info.json"
    launcher = worker.launcher(out, code=5, **{SOCKET_ENV: str(workdir / "nothing.sock")})
    assert launcher.wait(60) == 5
    assert _info(out)["ppid"] == launcher.pid


def test_a_silent_or_malformed_client_does_not_stall_the_server(worker, workdir):
    """One thread serves every run of the worker: a connection that never sends its request (or sends garbage) is
    dropped, and the next launcher's run still starts warm."""
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(worker.socket)
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbage.connect(worker.socket)
    garbage.sendall(b"\x00\x00\x00\x05hello")               # no file descriptors: not a launcher
    try:
        out = workdir / "info.json"
        launcher = worker.launcher(out, code=6)
        launcher.communicate(timeout=60)
        assert launcher.returncode == 6, (workdir / "launcher.err").read_text()
        assert _info(out)["ppid"] == worker.server.pid        # forked by the server, once the silent one was dropped
        assert silent.recv(1) == b""                           # the server closed the silent connection
        assert len(os.listdir(f"/proc/{worker.server.pid}/fd")) < 16   # and leaked none of its descriptors
    finally:
        silent.close()
        garbage.close()

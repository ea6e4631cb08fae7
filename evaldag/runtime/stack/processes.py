"""Process supervision of the stack's components: start each in its own process group with its log, recognise it again
(pid *and* start time, so a recycled pid is never ours), stop whole process groups plus the descendants that left
them, and sweep leftovers by their EVALDAG_STACK_ID.

Facts this relies on (docs/notes/prefect-mlflow.md 1.3, 1.5): a worker whose SIGINT is inherited as ignored never
stops on SIGTERM, so children get SIGINT reset to default; flow runs spawned by a worker run in their own process
groups, so a process-group kill alone would miss them.

Groups, not sessions: a component stays in the session of whoever ran `evaldag up`, because the kernel's autogroup
scheduling shares CPU between sessions first and by nice only within one; in a session of their own, the workers'
flow runs would compete as equals with a `nice -n 19` job the user started (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import psutil

from evaldag import paths
from evaldag.errors import StackError
from evaldag.runtime.stack.settings import MLFLOW_SERVER, POSTGRES, PREFECT_SERVER, STACK_ID_ENV, StackSettings

_CHILDREN: dict[int, subprocess.Popen] = {}  # components started by this process, reaped once they exit


@dataclass
class _Spec:
    """How one component is started; `key` is what must match for a running component to be kept."""

    name: str
    kind: str  # "server", "worker" or "db" (stopped last, after the servers that use it)
    argv: list[str]
    env: dict[str, str]           # overrides on top of the caller's environment
    cwd: Path
    url: str | None = None
    port: int | None = None
    pool: str | None = None
    key: dict[str, Any] = field(default_factory=dict)
    popen: dict[str, Any] = field(default_factory=dict)  # extra subprocess.Popen arguments (user=, group=)


STOP_ORDER = {"worker": 0, "server": 1, "db": 2}


class ProcessSupervisor:
    """Starting, recognising and stopping component processes (a part of `evaldag.runtime.stack.Stack`)."""

    settings: StackSettings
    home: Path
    logs_dir: Path

    def _spawn(self, spec: _Spec) -> dict:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        spec.cwd.mkdir(parents=True, exist_ok=True)
        if spec.name == MLFLOW_SERVER:
            (self.home / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
        if spec.name == PREFECT_SERVER:
            (self.home / "prefect").mkdir(parents=True, exist_ok=True)
        log = self.logs_dir / f"{spec.name}.log"
        with open(log, "ab") as out:
            offset = out.tell()
            out.write(f"\n===== {datetime.now().isoformat(timespec='seconds')} evaldag starts {spec.name}: "
                      f"{shlex.join(spec.argv)}\n".encode())
            out.flush()
            started_at = time.time()
            proc = subprocess.Popen(spec.argv, cwd=spec.cwd, env={**os.environ, **spec.env}, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, process_group=0,
                                    preexec_fn=_reset_sigint, **spec.popen)
        _CHILDREN[proc.pid] = proc
        return {
            "kind": spec.kind, "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
            "start_ticks": start_ticks(proc.pid),
            "argv": spec.argv, "url": spec.url, "port": spec.port, "pool": spec.pool, "key": spec.key,
            "log": str(log), "log_offset": offset, "started_at": started_at,
        }

    def _proc(self, rec: dict) -> psutil.Process | None:
        """The recorded process if it still runs and is the one we started (same pid *and* start time)."""
        pid = rec.get("pid")
        if not pid:
            return None
        self._reap(pid)
        try:
            p = psutil.Process(pid)
            ticks = rec.get("start_ticks")
            if ticks is not None and (now := start_ticks(pid)) is not None:
                same = now == ticks
            else:   # another OS, or a state file written before start ticks were recorded
                same = abs(p.create_time() - rec["create_time"]) <= 0.05
            if not same or not _running(p):
                return None
            return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def _alive(self, rec: dict) -> bool:
        return self._proc(rec) is not None

    def _reap(self, pid: int) -> None:
        proc = _CHILDREN.get(pid)
        if proc is not None and proc.poll() is not None:  # collect the exit status: no zombie in this process
            del _CHILDREN[pid]

    def _stop(self, state: dict, names: list[str]) -> None:
        """Stop components: workers first (SIGINT, SIGTERM, SIGKILL), then servers (SIGTERM, SIGKILL), then the
        database (SIGINT to the postmaster alone: PostgreSQL's fast shutdown, which stops its own children)."""
        comps = state["components"]
        names = [n for n in names if n in comps]
        kinds = {n: comps[n]["kind"] if comps[n]["kind"] in STOP_ORDER else "server" for n in names}
        for kind, signals in (("worker", (signal.SIGINT, signal.SIGTERM)), ("server", (signal.SIGTERM,)),
                              ("db", (signal.SIGINT,))):
            group = [comps[n] for n in names if kinds[n] == kind]
            if group:
                self._terminate(group, signals, leader_only=kind == "db")

    def _terminate(self, recs: list[dict], signals: tuple[int, ...], leader_only: bool = False) -> None:
        """Signal each component's process group (pgid == pid: each leads its own group), plus descendants that
        left the group (flow runs run in groups of their own); escalate to SIGKILL; wait until all are gone."""
        leaders: list[psutil.Process] = []
        targets: dict[int, psutil.Process] = {}
        loose: list[psutil.Process] = []
        for rec in recs:
            p = self._proc(rec)
            if p is None:
                continue
            leaders.append(p)
            members = [p, *_group_members(p.pid)]
            in_group = {q.pid for q in members}
            loose += [q for q in _safe(p.children, recursive=True) if q.pid not in in_group]
            targets.update({q.pid: q for q in [*members, *loose]})
        if not targets:
            return
        procs = list(targets.values())
        for sig in (*signals, signal.SIGKILL):
            for p in leaders:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if leader_only and sig != signal.SIGKILL:
                        os.kill(p.pid, sig)
                    else:
                        _kill_group(p.pid, sig)
                        if sig != signal.SIGKILL:   # a stopped (SIGSTOP) process acts on the signal only once resumed
                            _kill_group(p.pid, signal.SIGCONT)
            if sig != signal.SIGINT and not leader_only:  # a worker's SIGINT handler stops its own flow runs first
                for p in loose:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)
            procs = self._wait_gone(procs, self.settings.stop_timeout_s if sig != signal.SIGKILL else 10)
            if not procs:
                return
        raise StackError("could not stop pids " + ", ".join(str(p.pid) for p in procs) + " even with SIGKILL")

    def _wait_gone(self, procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while True:
            running = [p for p in procs if _running(p)]
            # reaped after the check: a child that exits between the two is collected now, not left a zombie
            for p in procs:
                self._reap(p.pid)
            procs = running
            if not procs or time.monotonic() > deadline:
                return procs
            time.sleep(0.1)

    def _sweep(self, stack_id: str) -> None:
        """Kill leftovers of this stack (e.g. flow runs whose worker died earlier), found by their environment."""
        mine = {os.getpid(), *(p.pid for p in _safe(psutil.Process().parents))}
        leftovers = []
        for p in psutil.process_iter():
            if p.pid in mine:
                continue
            with contextlib.suppress(psutil.Error):
                if p.environ().get(STACK_ID_ENV) == stack_id:
                    leftovers.append(p)
        for p in leftovers:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self._wait_gone(leftovers, 10)

    def _port_host(self, spec: _Spec) -> str:
        return "127.0.0.1" if spec.name == POSTGRES else self.settings.host

    def _wait_port_released(self, spec: _Spec, timeout_s: float = 10.0) -> None:
        """Wait (up to `timeout_s`) until the port of a component just stopped can be bound again: the kernel
        may still be tearing down its listening socket. A port that stays blocked is reported by
        `_check_port_free` before anything starts."""
        deadline = time.monotonic() + timeout_s
        while _bind_error(self._port_host(spec), spec.port) is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def _check_port_free(self, spec: _Spec) -> None:
        """Fail with the holder and a free port to use instead if `spec`'s port is taken."""
        host, port = self._port_host(spec), spec.port
        err = _bind_error(host, port)
        if err is None:
            return
        holder = _port_holder(port)
        var, what = {PREFECT_SERVER: ("EVALDAG_PREFECT_PORT", "Prefect server"),
                     POSTGRES: ("EVALDAG_POSTGRES_PORT", "PostgreSQL cluster")}.get(
                         spec.name, ("EVALDAG_MLFLOW_PORT", "MLflow server"))
        raise StackError(
            f"port {port} on {host}, needed by the {what}, is busy ({err.strerror}): held by "
            f"{holder or 'a process psutil cannot identify'}. Stop that program, or pick another port, e.g. "
            f"`export {var}={_free_port(host)}` (then run `evaldag up` again)")


def _reset_sigint() -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def exec_foreground(spec: _Spec) -> NoReturn:
    """Become `spec`'s program (its environment over this process's, in its folder), attached and in the
    foreground: the scheduler that started this process (an sbatch job's srun, a Kubernetes pod, a systemd unit)
    then signals the worker itself, which stops as a stack's worker does, and the worker's exit status is the job's."""
    if prefect_home := spec.env.get("PREFECT_HOME"):  # a job's fresh EVALDAG_HOME: Prefect only warns without it
        Path(prefect_home).mkdir(parents=True, exist_ok=True)
    os.chdir(spec.cwd)
    for sig in (signal.SIGINT, signal.SIGTERM):   # an ignored signal stays ignored across exec (`cmd &` ignores SIGINT)
        signal.signal(sig, signal.SIG_DFL)
    os.execve(spec.argv[0], spec.argv, {**os.environ, **spec.env})


def _cli(name: str) -> str:
    """The `prefect`/`mlflow` executable of this interpreter's environment (never one found on PATH)."""
    exe = Path(sys.executable).parent / name
    if not exe.exists():
        raise StackError(f"`{name}` is not installed next to {sys.executable}; install evaldag's dependencies "
                         f"into this environment (pip install -e .)")
    return str(exe)


def _repo() -> str:
    """The checkout flow runs start in: $EVALDAG_REPO (e.g. a path all workers share), default this repository."""
    return os.environ.get("EVALDAG_REPO") or str(paths.REPO_ROOT)


def _tail(path: str | Path, offset: int = 0, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"



def _log_tail(rec: dict) -> str:
    """`last lines of <log>:` and the lines a component wrote since it was started: the tail of every start error."""
    return f"last lines of {rec['log']}:\n{_tail(rec['log'], rec.get('log_offset', 0))}"


def _safe(fn: Any, **kwargs: Any) -> list:
    try:
        return list(fn(**kwargs))
    except psutil.Error:
        return []


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux; None elsewhere or once it is gone).

    Not `psutil.Process.create_time()`: that adds the boot time the kernel derives from the wall clock, so a clock
    step (NTP, a VM resumed after a pause) moves every process's create time by the step, and a check against the
    recorded value then takes live components for dead ones. The tick count since boot never changes."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields are counted after its closing one
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])  # field 22 of proc(5), starttime


def _running(p: psutil.Process) -> bool:
    """Whether `p` still runs. A process whose main thread has exited shows as a zombie while its other threads
    are still exiting, and it keeps its sockets (a server's port) and cannot be reaped until they are gone: it
    counts as running until it is a zombie of one thread."""
    try:
        return p.is_running() and (p.status() != psutil.STATUS_ZOMBIE or p.num_threads() > 1)
    except psutil.Error:
        return False


def _kill_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid`, or to the process `pid` alone when it leads no group (one stopped
    before its setsid): the group signal would miss it. Never both: a leader that got a second SIGINT would take it
    as "quit now" (uvicorn does)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        os.kill(pid, sig)


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):
            if p.pid != pgid and os.getpgid(p.pid) == pgid:
                members.append(p)
    return members


def _bind_error(host: str, port: int) -> OSError | None:
    """Why `port` cannot be bound on `host` now, or None if it can."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is not "busy"
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def _port_holder(port: int) -> str | None:
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                p = psutil.Process(c.pid)
                cmd = shlex.join(p.cmdline())[:160] or p.name()
                return f"pid {c.pid} ({cmd})"
            except psutil.Error:
                return f"pid {c.pid}"
    return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

"""Warm starts for flow runs: a process that has already imported what a flow run imports, and forks each run.

A shard's flow run spends about 10 s of a 2-core box importing Prefect, torch, transformers and vLLM before its
first token, and every evaluation pays it once per shard, on the critical path (measured: the imports alone take
10.4 s in one interpreter). A worker started through `serve_then_exec` forks a *warm server* first: a child that
imports the `preload` modules once, then listens on a Unix socket in a private folder. The flow-run launcher
(`evaldag.flow_run_launcher`) asks it for each run: the server forks a copy of itself, which becomes the flow run
(its own session, the launcher's stdin/stdout/stderr, environment and folder), and reports the run's exit status
back. What a cold start guarantees holds here too:
- a stop signal sent to the launcher reaches the run's whole process group;
- the run ends with its launcher (a worker's hard kill reaches the launcher alone: the server sees the launcher's
  connection close and kills the run's group), and with the server, which ends with its worker (a lost node);
- the launcher ends as the run ended (its exit code, or the same signal).
Nothing is shared between runs: each is a fresh fork of the server, which never runs anything itself. When no
server answers (none configured, not started yet, gone), the launcher starts the run cold, as before.

The server runs on one Python thread (a selector and a SIGCHLD wake-up pipe) and serves nothing if the preloaded
modules started Python threads. Native threads that libraries start at import (jemalloc's background threads under
polars, one of torch's) are not copied into a fork; these libraries handle fork themselves (a forked run's vLLM
engine generates at the tokens/s of a cold one, measured), and nothing is preloaded where fork is unsafe (vLLM on a
host with NVIDIA devices).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
from pathlib import Path

SOCKET_ENV = "EVALDAG_WARM_START_SOCKET"
# A run's environment may differ from the server's only in Prefect's settings (re-read in the fork) and in the
# worker's per-run variables (PREFECT__FLOW_RUN_ID...). Anything else (PYTHONPATH, read at interpreter start; HF_*,
# read by transformers at import) would not reach a fork of the server: such a run starts cold.
_PER_RUN_PREFIXES = ("PREFECT_",)
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_MAX_REQUEST = 4 << 20          # environment and argv of one run, as JSON
_FDS = 3                        # stdin, stdout, stderr
_REQUEST_TIMEOUT_S = 10.0       # to send one request: a connected client that stays silent is dropped after it
_STARTING_ENV: dict[str, str] = {}


def _name_process(name: bytes) -> None:
    """Set this process's short name (/proc/PID/comm: `ps -o comm`, top, psutil's name()); its command line stays
    the server's (rewriting it would overwrite the environment block that `evaldag down` finds leftovers by)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """SIGKILL this process when its parent (thread) ends. Linux only; a no-op elsewhere (there `evaldag down`
    sweeps such leftovers)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------- the launcher's side

def run_module(path: str, module: str, argv: list[str]) -> int | None:
    """Run `module` as the program with `argv` in a fork of the warm server at `path`, with this process's
    environment, folder and standard streams; forward SIGTERM/SIGINT to the run's group; return its exit code
    (negative: the signal that ended it). None when no server answers there (the caller starts the run cold)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    replies = conn.makefile("rb")      # buffered: the pid and the exit status may arrive in one read
    try:
        conn.connect(path)
        data = json.dumps({"module": module, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(data)) + data], list(range(_FDS)))
        reply = replies.readline().decode().strip()
        if reply.startswith("cold"):
            print(f"evaldag warm start: {reply}; starting the run cold", file=sys.stderr)
        pid = int(reply)
    except (OSError, ValueError):   # no server, it went away before forking (a fork it made dies with it), or
        conn.close()                # it declined the run: nothing runs
        return None

    def forward(sig: int, _frame: object) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        status = replies.readline().decode().strip()
    except OSError:
        status = ""
    finally:
        conn.close()
    if not status:                   # the server died, and the run with it: its children must not outlive it
        _kill_group(pid)
        return -signal.SIGKILL
    return int(status)


# ---------------------------------------------------------------------------------------------- the server's side

def serve_then_exec(path: str, preload: list[str], command: list[str]) -> None:
    """Fork the warm server (it dies with this process), then become `command` (the worker), with SOCKET_ENV
    naming the server's socket so that the worker's flow-run launchers find it."""
    os.environ[SOCKET_ENV] = path
    pid = os.fork()
    if pid == 0:
        try:
            die_with_parent()
            serve(path, preload)
        finally:
            os._exit(0)
    os.execvp(command[0], command)


def serve(path: str, preload: list[str]) -> None:
    """Import `preload`, then fork a flow run for every request on the socket at `path` until killed."""
    global _STARTING_ENV
    _STARTING_ENV = dict(os.environ)    # what a cold run starts with; the imports below may add to it
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # not installed here (vLLM on a CPU-only main environment): the runs import it
            print(f"evaldag warm start: not preloading {name} ({type(e).__name__}: {e})", file=sys.stderr)
    if threading.active_count() > 1:   # forking a multithreaded process can deadlock its copies: serve nothing
        print(f"evaldag warm start: the preloaded modules started threads ({threading.enumerate()}); runs start "
              "cold", file=sys.stderr)
        return
    _name_process(b"evaldag-warm")
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)                 # only this user may ask for runs
    Path(path).unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
    except OSError as e:                # e.g. a path over the 107 bytes a Unix socket's may have
        print(f"evaldag warm start: cannot listen on {path} ({e}); runs start cold", file=sys.stderr)
        return
    listener.listen(64)
    _Server(listener).loop()


class _Server:
    """One thread: accept requests and fork runs, report exits (SIGCHLD), kill runs whose launcher is gone."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)    # a handler, so that the wake-up fd is written
        self.wake_w = wake_w
        self.runs: dict[int, socket.socket] = {}          # run pid -> its live launcher's connection
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")

    def loop(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self._accept()
                elif key.data == "child":
                    self._reap()
                else:
                    self._launcher_gone(key.data, key.fileobj)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        # one thread serves every run of this worker: a client that connects and sends nothing must not stall them
        conn.settimeout(_REQUEST_TIMEOUT_S)
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError, KeyError) as e:
            print(f"evaldag warm start: bad request ({e})", file=sys.stderr)
            conn.close()
            return
        differing = _differing_env(request["env"])
        if differing:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"cold: the run's environment differs in {', '.join(differing[:5])}\n".encode())
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self._become_run(conn, request, fds)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"{pid}\n".encode())
        except OSError:                 # the launcher is already gone
            _kill_group(pid)
        self.runs[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.runs.pop(pid, None)
            if conn is not None:
                self.selector.unregister(conn)
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()

    def _launcher_gone(self, pid: int, conn: socket.socket) -> None:
        """A launcher sends nothing after its request: readable means closed, i.e. the launcher died."""
        try:
            if conn.recv(1):
                return
        except OSError:
            pass
        _kill_group(pid)                 # reaped by _reap once it is gone, with nobody left to tell
        self.selector.unregister(conn)
        conn.close()
        del self.runs[pid]

    def _become_run(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        """In the forked child: shed the server, take the launcher's streams, environment and folder, run."""
        code = 1
        try:
            os.setsid()                  # a session and process group of its own, as a cold start has
            die_with_parent()
            _name_process(b"evaldag-run")
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
            self.selector.close()
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.listener.close()
            for other in self.runs.values():
                other.close()
            conn.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            env = _run_env(request["env"])
            os.environ.clear()
            os.environ.update(env)
            if "prefect.context" in sys.modules:   # Prefect read its settings from the server's environment
                sys.modules["prefect.context"].refresh_global_settings_context()
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:       # as an interpreter ends on an uncaught one: killed by SIGINT
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A launcher's request and its streams; on any error the received descriptors are closed, not leaked."""
    msg, fds, _, _ = socket.recv_fds(conn, 4 + _MAX_REQUEST, _FDS)
    try:
        if len(fds) != _FDS or len(msg) < 4:
            raise ValueError(f"expected {_FDS} file descriptors and a request")
        (size,) = struct.unpack("!I", msg[:4])
        body = msg[4:]
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("request cut short")
            body += chunk
        request = json.loads(body)
        return {k: request[k] for k in ("module", "argv", "env", "cwd")}, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _differing_env(env: dict[str, str]) -> list[str]:
    """The variables, other than Prefect's, whose value in `env` is not the one this server started with."""
    return sorted(k for k in set(env) | set(_STARTING_ENV)
                  if env.get(k) != _STARTING_ENV.get(k) and not k.startswith(_PER_RUN_PREFIXES))


def _run_env(env: dict[str, str]) -> dict[str, str]:
    """A run's environment: this server's (what its own imports of the preloaded modules set included, as a cold
    run's imports would set it) with the run's Prefect variables instead of the server's."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(_PER_RUN_PREFIXES)},
            **{k: v for k, v in env.items() if k.startswith(_PER_RUN_PREFIXES)}}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def command(path: str, preload: list[str], worker: list[str]) -> list[str]:
    """The command that starts `worker` with a warm server at `path` preloading `preload` (a `-c` program, so that
    the runs' multiprocessing children have no main module to import again)."""
    return [sys.executable, "-c", "import runpy; runpy.run_module('evaldag.warm_start', run_name='__main__')",
            path, ",".join(preload), "--", *worker]


def main(argv: list[str]) -> None:
    """`python -c ... evaldag.warm_start SOCKET PRELOAD[,PRELOAD...] -- COMMAND...`: the worker with its server."""
    path, preload, sep, *command = argv
    if sep != "--" or not command:
        raise SystemExit("usage: warm_start SOCKET MODULE[,MODULE...] -- COMMAND...")
    serve_then_exec(path, [m for m in preload.split(",") if m], command)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The local stack: a Prefect server, process work pools `cpu`/`gpu` with their workers, and an MLflow server.

Two roles share this code. A head (`evaldag up`) runs the servers (Prefect on SQLite, or on PostgreSQL: a private
cluster with `--postgres`, any server with `--database-url`), the pools, a `cpu` worker and its own gpu workers,
and publishes what worker nodes need (evaldag.cluster). A worker node (`evaldag worker --server http://head:4200`,
`StackSettings.server` set) runs only its gpu workers, pointed at the head. Every worker sends flow-run heartbeats
(`heartbeat_s`), and the head's crash automation turns a run whose heartbeats stop into Crashed (lost nodes).

The `gpu` pool gets num_gpus // tp workers, each pinned to tp GPUs (evaldag.gpus.assign_gpus), and the server a
global concurrency limit `evaldag-gpus` with one slot per GPU, which shard flows hold while generating.

Everything lives under one state directory, `evaldag.paths.home()`:

    <home>/prefect/          PREFECT_HOME of the server and the workers (SQLite DB, result storage)
    <home>/mlflow/           mlflow.db (SQLite backend store) and artifacts/
    <home>/logs/<name>.log   stdout+stderr of every component, and deploy.log
    <home>/stack/state.json  what `up` started: pid + process create time (so a recycled pid is never ours), URLs
    evaldag.postgres.default_dir(home)   the private PostgreSQL cluster, when asked for (`--postgres`)

`Stack.up()` is idempotent: a component that is alive, ours and configured as asked is left alone; a dead one, a
server that does not answer (stopping, or hung), or one started with another configuration, is (re)started.
`Stack.down()` stops workers first, then the servers, and kills whole process groups plus every process that carries
this stack's `EVALDAG_STACK_ID` (flow runs spawned by a worker run in their own sessions, so a process-group kill
alone would miss them).

Facts this relies on (docs/notes/prefect-mlflow.md 1.3, 1.5, 5.2):
- a worker whose SIGINT is inherited as ignored never stops on SIGTERM, so children get SIGINT reset to default;
- `mlflow server --workers 1` with MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: 2 processes, ~0.5 GB, instead of 15;
- the worker poll (PREFECT_WORKER_QUERY_SECONDS, default 10 s) dominates run latency, so the local stack uses 1 s
  (one cheap query a second per worker).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import httpx
import psutil
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from evaldag import cluster, paths, prefect_results, store
from evaldag import postgres as pg
from evaldag.deployments import CPU_POOL, GPU_POOL, MANIFEST, POOLS
from evaldag.errors import EvalDagError, StackError
from evaldag.gpus import GPU_LIMIT, assign_gpus, detect_gpu_ids, parse_gpu_ids

PREFECT_SERVER = "prefect-server"
MLFLOW_SERVER = "mlflow-server"
POSTGRES = "postgres"
CPU_WORKER = "cpu-worker"
SERVERS = (PREFECT_SERVER, MLFLOW_SERVER)
STACK_ID_ENV = "EVALDAG_STACK_ID"
STATE_VERSION = 1
_CHILDREN: dict[int, subprocess.Popen] = {}  # components started by this process, reaped once they exit

# EVALDAG_* variables that configure the stack itself; every other EVALDAG_* variable is passed to the workers and,
# when it changes, restarts them (a flow must see the data/models/results folders the user asked for).
_STACK_ENV = {
    "EVALDAG_HOME", "EVALDAG_HOST", "EVALDAG_PREFECT_PORT", "EVALDAG_MLFLOW_PORT", "EVALDAG_GPU_WORKERS",
    "EVALDAG_GPUS", "EVALDAG_TP", "EVALDAG_WORKER_QUERY_SECONDS", "EVALDAG_REPO", STACK_ID_ENV,
    "EVALDAG_ADVERTISE_HOST", "EVALDAG_DATABASE_URL", "EVALDAG_POSTGRES", "EVALDAG_POSTGRES_PORT",
    "EVALDAG_POSTGRES_DIR", "EVALDAG_PG_BIN", "EVALDAG_HEARTBEAT_S", "EVALDAG_NODE_NAME",
}
_WILDCARD = ("0.0.0.0", "::", "")


class StackSettings(BaseModel):
    """Where and how the local stack runs. `from_env()` reads the EVALDAG_* overrides."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home: Path = Field(default_factory=paths.home, description="State directory (EVALDAG_HOME, default ~/.evaldag).")
    host: str = Field("127.0.0.1", description="Interface both servers bind to (EVALDAG_HOST).")
    prefect_port: int = Field(4200, ge=1, le=65535, description="Prefect server port (EVALDAG_PREFECT_PORT).")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="MLflow server port (EVALDAG_MLFLOW_PORT).")
    num_gpus: int = Field(
        1, ge=0, le=64, validation_alias=AliasChoices("num_gpus", "gpu_workers"),
        description="GPUs (on a CPU box: shard slots) of the `gpu` pool; `--gpus`, EVALDAG_GPU_WORKERS. Also the "
                    f"limit of the Prefect global concurrency limit {GPU_LIMIT!r}.")
    tp: int = Field(1, ge=1, le=64, description="GPUs per gpu worker (`--tp`, EVALDAG_TP): num_gpus // tp workers, "
                                                "one shard at a time each.")
    gpus: tuple[str, ...] | None = Field(
        None, description="GPU ids, tp per worker via CUDA_VISIBLE_DEVICES (EVALDAG_GPUS=0,1). "
        "None: nothing to pin (CPU box); workers inherit the caller's CUDA_VISIBLE_DEVICES.")
    cpu_worker_limit: int = Field(4, ge=1, description="Concurrent parent flow runs of the `cpu` worker.")
    worker_query_seconds: float = Field(
        1, gt=0, description="Worker poll interval (PREFECT_WORKER_QUERY_SECONDS); Prefect's default is 10.")
    start_timeout_s: float = Field(180, gt=0, description="How long a server or worker may take to become healthy.")
    stop_timeout_s: float = Field(10, gt=0, description="Grace period per signal (SIGINT, SIGTERM) before SIGKILL.")
    advertise_host: str | None = Field(
        None, description="Address worker nodes reach this head by (EVALDAG_ADVERTISE_HOST); default: `host`, or "
                          "this machine's address when `host` is 0.0.0.0.")
    heartbeat_s: int = Field(
        cluster.MIN_HEARTBEAT_S, ge=cluster.MIN_HEARTBEAT_S,
        description="Seconds between flow-run heartbeats of the workers (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, "
                    "EVALDAG_HEARTBEAT_S); a run silent for 3 periods is set Crashed by the head's automation.")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL of the Prefect server's database (EVALDAG_DATABASE_URL), e.g. "
                          "postgresql+asyncpg://user:pw@db:5432/prefect; default: SQLite in <home>/prefect.")
    postgres: bool = Field(False, description="Run the Prefect server on a private PostgreSQL cluster that the "
                                              "stack starts (EVALDAG_POSTGRES=1, `--postgres`).")
    postgres_port: int = Field(5433, ge=1, le=65535, description="Port of that cluster on 127.0.0.1.")
    postgres_dir: Path | None = Field(None, description="Folder of that cluster (EVALDAG_POSTGRES_DIR); default "
                                                        "evaldag.postgres.default_dir(home).")
    server: str | None = Field(
        None, description="Set on a worker node: the head's Prefect URL (http://head:4200). The node runs only "
                          "gpu workers, configured from the head (evaldag.cluster) and `worker_env`.")
    node_name: str = Field(default_factory=socket.gethostname, min_length=1,
                           description="Name of a worker node (EVALDAG_NODE_NAME): prefix of its workers' names.")
    worker_env: dict[str, str] = Field(default_factory=dict, description="Variables a worker node's workers get "
                                       "over the head's (`evaldag worker --env K=V`, --mlflow-url, --results-url).")

    @model_validator(mode="after")
    def _database_choice(self) -> StackSettings:
        if self.postgres and self.database_url:
            raise ValueError("--postgres starts a private PostgreSQL cluster and --database-url names another "
                             "database; give one of them")
        url = self.database_url
        if url and not url.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            hint = ("postgresql+asyncpg://" + url.split("://", 1)[1]) if url.startswith(("postgres://",
                                                                                         "postgresql://")) else None
            raise ValueError(f"database_url {url!r} is not one the Prefect server can use: it needs "
                             "postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB (or sqlite+aiosqlite:///PATH)"
                             + (f"; did you mean {hint}?" if hint else ""))
        return self

    @field_validator("server")
    @classmethod
    def _server_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return cluster.server_url(value)
        except StackError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _gpus_match_workers(self) -> StackSettings:
        if self.gpus is not None and len(self.gpus) != self.num_gpus:
            raise ValueError(f"gpus={list(self.gpus)} names {len(self.gpus)} GPUs but num_gpus={self.num_gpus} "
                             "(--gpus); name exactly one id per GPU")
        try:
            assign_gpus(self.num_gpus, self.tp, self.gpus)
        except EvalDagError as e:
            raise ValueError(str(e)) from None
        if self.prefect_port == self.mlflow_port:
            raise ValueError(f"prefect_port and mlflow_port are both {self.prefect_port}")
        return self

    @property
    def gpu_workers(self) -> int:
        """Workers on the `gpu` pool: one per `tp` GPUs."""
        return self.num_gpus // self.tp

    @property
    def gpu_assignment(self) -> list[tuple[str, ...] | None]:
        """CUDA_VISIBLE_DEVICES ids of each gpu worker (None: not pinned); see evaldag.gpus.assign_gpus."""
        return assign_gpus(self.num_gpus, self.tp, self.gpus)

    @classmethod
    def from_env(cls, **overrides: Any) -> StackSettings:
        """Settings from EVALDAG_* variables; keyword overrides (e.g. from CLI options, None = unset) win.

        When the number of GPUs is asked for (`--gpus`/EVALDAG_GPU_WORKERS) without naming them (EVALDAG_GPUS),
        the workers are pinned to the GPUs this machine shows (the caller's CUDA_VISIBLE_DEVICES, else
        `nvidia-smi -L`), the first tp to the first worker and so on; on a machine without GPUs nothing is pinned
        and each worker is just a slot. Without either, one unpinned worker, as before.
        """
        env = os.environ
        values: dict[str, Any] = {}
        if "gpu_workers" in overrides:  # the old keyword of --gpu-workers
            legacy = overrides.pop("gpu_workers")
            if overrides.get("num_gpus") is None:
                overrides["num_gpus"] = legacy
        for key, var in (("host", "EVALDAG_HOST"), ("prefect_port", "EVALDAG_PREFECT_PORT"),
                         ("mlflow_port", "EVALDAG_MLFLOW_PORT"), ("num_gpus", "EVALDAG_GPU_WORKERS"),
                         ("tp", "EVALDAG_TP"), ("worker_query_seconds", "EVALDAG_WORKER_QUERY_SECONDS"),
                         ("advertise_host", "EVALDAG_ADVERTISE_HOST"), ("heartbeat_s", "EVALDAG_HEARTBEAT_S"),
                         ("database_url", "EVALDAG_DATABASE_URL"), ("postgres_port", "EVALDAG_POSTGRES_PORT"),
                         ("postgres_dir", "EVALDAG_POSTGRES_DIR"), ("node_name", "EVALDAG_NODE_NAME")):
            if env.get(var):
                values[key] = env[var]
        if env.get("EVALDAG_POSTGRES", "").strip().lower() in ("1", "true", "yes", "on"):
            values["postgres"] = True
        if env.get("EVALDAG_GPUS"):
            values["gpus"] = parse_gpu_ids(env["EVALDAG_GPUS"])
            values.setdefault("num_gpus", len(values["gpus"]))
        values.update({k: v for k, v in overrides.items() if v is not None})
        if overrides.get("gpus") is not None:
            values["gpus"] = tuple(str(g) for g in overrides["gpus"])
            if overrides.get("num_gpus") is None:
                values["num_gpus"] = len(values["gpus"])
        try:
            num_gpus, tp = int(values.get("num_gpus", 1)), int(values.get("tp", 1))
            if values.get("gpus") is None and values.get("num_gpus") is not None:
                values["gpus"] = _detected_gpus(num_gpus)
            assign_gpus(num_gpus, tp, values.get("gpus"))  # the GPU layout's errors, in words (not pydantic's)
            return cls(**values)
        except EvalDagError as e:
            raise StackError(str(e)) from None
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            raise StackError(f"invalid stack settings: {e}") from None

    @property
    def local_host(self) -> str:
        """The address clients on this machine use: `host`, or 127.0.0.1 when the servers listen everywhere."""
        return "127.0.0.1" if self.host in _WILDCARD else self.host

    @property
    def public_host(self) -> str:
        """The address other hosts use (advertise_host, else evaldag.cluster.public_host(host))."""
        return self.advertise_host or cluster.public_host(self.host)

    @property
    def prefect_url(self) -> str:
        """The Prefect server for this machine's clients (a worker node: the head's)."""
        return self.server or f"http://{self.local_host}:{self.prefect_port}"

    @property
    def prefect_api_url(self) -> str:
        return f"{self.prefect_url}/api"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.local_host}:{self.mlflow_port}"


class ComponentStatus(NamedTuple):
    """One row of `Stack.status()`."""

    component: str
    pid: int | None
    alive: bool
    healthy: bool
    url: str | None


@dataclass
class UpReport:
    """What `Stack.up()` did."""

    started: list[str] = field(default_factory=list)      # components started (or restarted) by this call
    kept: list[str] = field(default_factory=list)         # components that were already running as asked
    stopped: list[str] = field(default_factory=list)      # components stopped because they are no longer wanted
    deployed: bool = False
    elapsed_s: float = 0.0
    status: list[ComponentStatus] = field(default_factory=list)


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


_STOP_ORDER = {"worker": 0, "server": 1, "db": 2}
# MLflow's default allowed Host headers (mlflow.server.security_utils): a head reached by a name needs it added
_MLFLOW_ALLOWED_HOSTS = ("localhost,127.0.0.1,[::1],0.0.0.0,localhost:*,127.0.0.1:*,[[]::1]:*,0.0.0.0:*,192.168.*,"
                         "10.*," + ",".join(f"172.{i}.*" for i in range(16, 32)) + ",fc00:*,fd00:*")


class _RetryBusy(httpx.BaseTransport):
    """Re-sends a request the Prefect server answered 503, which it does for SQLite busy/locked and tells clients to
    retry: right after a (re)start its own services hold the database for a moment, and `up` must not fail then."""

    def __init__(self, inner: httpx.BaseTransport | None = None, delays: tuple[float, ...] = (0.2, 0.5, 1, 2, 4, 8)):
        self.inner = inner or httpx.HTTPTransport()
        self.delays = delays

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for delay in self.delays:
            response = self.inner.handle_request(request)
            if response.status_code != 503:
                return response
            response.close()
            time.sleep(delay)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def _reset_sigint() -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(name: str) -> str:
    """The `prefect`/`mlflow` executable of this interpreter's environment (never one found on PATH)."""
    exe = Path(sys.executable).parent / name
    if not exe.exists():
        raise StackError(f"`{name}` is not installed next to {sys.executable}; install evaldag's dependencies "
                         f"into this environment (pip install -e .)")
    return str(exe)


class Stack:
    """Start, stop and inspect the local stack described by `settings` (default: `StackSettings.from_env()`)."""

    def __init__(self, settings: StackSettings | None = None) -> None:
        self.settings = settings or StackSettings.from_env()
        self.home = Path(self.settings.home).expanduser().resolve()
        self.state_dir = self.home / "stack"
        self.state_path = self.state_dir / "state.json"
        self.env_path = self.state_dir / "worker-env.json"
        self.logs_dir = self.home / "logs"

    # ------------------------------------------------------------------ public API

    @property
    def deployments_file(self) -> Path:
        return MANIFEST

    def up(self, deploy: bool = True) -> UpReport:
        """Start what is missing, wait until everything is healthy, then deploy (if `deploy`). Idempotent.

        On a worker node (settings.server set) this starts only the node's gpu workers, configured from the head,
        and never deploys (the head did)."""
        t0 = time.monotonic()
        report = UpReport()
        node = self.settings.server is not None
        with self._lock():
            state = self._load_state() or self._new_state()
            self._check_role(state)
            state["role"] = "node" if node else "head"
            specs = self._desired_specs(state["stack_id"])
            comps: dict[str, dict] = state["components"]

            self._reconcile(state, specs, report)
            to_start = [n for n in specs if n not in comps]
            started: list[str] = []
            try:
                self._start_missing(state, specs, to_start, started)
            except BaseException:
                # Leave no half-started stack behind: stop what this call started (what ran before stays).
                with contextlib.suppress(Exception):
                    self._stop(state, started)
                for name in started:
                    comps.pop(name, None)
                with contextlib.suppress(Exception):
                    self._save_state(state) if comps else self._remove_state()
                raise
            report.started = started
        if deploy and not node:
            self.deploy()
            report.deployed = True
        report.elapsed_s = time.monotonic() - t0
        report.status = self.status()
        return report

    def _reconcile(self, state: dict, specs: dict[str, _Spec], report: UpReport) -> None:
        """Keep what runs as asked, stop what is stale or unwanted, forget what died (records in `state`)."""
        comps: dict[str, dict] = state["components"]
        to_stop = []
        for name, rec in list(comps.items()):
            alive = self._alive(rec)
            # a server that runs but does not answer is shutting down (a restart caught midway) or hung:
            # keeping it would fail below when it exits, or never turn healthy, so it is replaced
            answering = rec["kind"] != "server" or (alive and self._server_healthy(name, rec["url"]))
            if alive and answering and name in specs and rec.get("key") == specs[name].key:
                report.kept.append(name)
                continue
            if alive:
                to_stop.append(name)
                if name not in specs:
                    report.stopped.append(name)
            else:
                del comps[name]
        if to_stop:
            self._stop(state, to_stop)
            for name in to_stop:
                comps.pop(name, None)

    def _start_missing(self, state: dict, specs: dict[str, _Spec], to_start: list[str], started: list[str]) -> None:
        """Start the components of `to_start` and wait until they are healthy; each one started is appended to
        `started` as it starts, so that a failure can stop exactly those."""
        comps: dict[str, dict] = state["components"]
        node = self.settings.server is not None
        # Ports first, so a busy port fails before anything starts.
        for name in to_start:
            if specs[name].port is not None:
                self._check_port_free(specs[name])
        # The database, then both servers at once (they are independent), then pools, workers, health.
        if POSTGRES in specs:
            if POSTGRES in to_start:
                comps[POSTGRES] = self._spawn(specs[POSTGRES])
                started.append(POSTGRES)
                self._save_state(state)
            self._wait_healthy(state, [POSTGRES])
            pg.ensure_database(self._pg_credentials(), self.settings.postgres_port)
        for name in SERVERS:
            if name in to_start:
                comps[name] = self._spawn(specs[name])
                started.append(name)
                self._save_state(state)
        if node:
            self._check_head_pools()
        else:
            self._wait_healthy(state, [PREFECT_SERVER])
            self._configure_server(fresh=PREFECT_SERVER in started)
        workers = [n for n in to_start if specs[n].kind == "worker"]
        for name in workers:
            comps[name] = self._spawn(specs[name])
            started.append(name)
        self._save_state(state)
        if not node:
            self._wait_healthy(state, [MLFLOW_SERVER])
        self._wait_workers_online(state, workers)  # kept workers are checked by status()

    def _configure_server(self, fresh: bool) -> None:
        """Work pools, the gpu limit, result storage, crash automation and cluster info on the head's server."""
        self._ensure_pools()
        # a fresh server lost every lease (leases live in its memory): slots counted as held are orphans
        self._ensure_gpu_limit(reset_slots=fresh)
        # flow and task results go to the workers' result store, where every node can read them
        prefect_results.configure(self.settings.prefect_api_url, self._results_root())
        # lost nodes: runs whose heartbeats stop are set Crashed, so their parents relaunch them
        cluster.ensure_crash_automation(self.settings.prefect_api_url, self.settings.heartbeat_s)
        cluster.publish(self.settings.prefect_api_url, self._cluster_info())

    def deploy(self) -> None:
        """`prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml` against the running server."""
        state = self._load_state()
        if not state or not self._alive(state["components"].get(PREFECT_SERVER, {})):
            raise StackError("the Prefect server of the local stack is not running; start it with `evaldag up`")
        if not self.deployments_file.exists():
            raise StackError(f"no deployment manifest at {self.deployments_file}; nothing to deploy "
                             "(use `evaldag up --no-deploy` to start the stack without deploying)")
        log = self.logs_dir / "deploy.log"
        argv = [_cli("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(self.deployments_file)]
        env = {**os.environ, **self._client_env(state), "PREFECT_HOME": str(self.home / "prefect"),
               "EVALDAG_REPO": _repo()}
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            out.write(f"$ {shlex.join(argv)}\n".encode())
            out.flush()
            try:
                proc = subprocess.run(argv, cwd=paths.REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, timeout=600)
            except subprocess.TimeoutExpired:
                raise StackError(f"`prefect deploy` took more than 600 s; see {log}:\n{_tail(log)}") from None
        if proc.returncode != 0:
            raise StackError(f"`prefect deploy` failed (exit code {proc.returncode}); last lines of {log}:\n"
                             f"{_tail(log)}")

    def down(self) -> list[str]:
        """Stop workers, then servers; remove the state file. Returns the components that were running."""
        with self._lock():
            state = self._load_state()
            if not state:
                return []
            comps = state["components"]
            order = sorted(comps, key=lambda n: _STOP_ORDER.get(comps[n]["kind"], 1))  # workers, servers, db
            running = [n for n in order if self._alive(comps[n])]
            self._stop(state, list(comps))
            self._sweep(state["stack_id"])
            self._remove_state()
            return running

    def status(self) -> list[ComponentStatus]:
        """One row per recorded component: pid, alive (our process still runs), healthy, URL."""
        state = self._load_state()
        if not state:
            return []
        rows = []
        comps = state["components"]
        online = self._online_workers(state, [n for n in comps if comps[n]["kind"] == "worker"])
        for name, rec in comps.items():
            alive = self._alive(rec)
            if not alive:
                healthy = False
            elif rec["kind"] in ("server", "db"):
                healthy = self._server_healthy(name, rec["url"])
            else:
                healthy = name in online
            rows.append(ComponentStatus(name, rec.get("pid"), alive, healthy, rec.get("url")))
        return rows

    def env_lines(self) -> list[str]:
        """`export` lines that point a shell at this stack (`eval "$(evaldag env)"`)."""
        state = self._load_state()
        env = self._client_env(state) if state else {
            "PREFECT_API_URL": self.settings.prefect_api_url, "MLFLOW_TRACKING_URI": self.settings.mlflow_url,
            "EVALDAG_HOME": str(self.home)}
        keys = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "EVALDAG_HOME")
        return [f"export {k}={shlex.quote(env[k])}" for k in keys]

    @property
    def prefect_url(self) -> str:
        """Prefect UI of the running stack (or of the settings when nothing runs)."""
        state = self._load_state()
        return state["urls"]["prefect"] if state else self.settings.prefect_url

    @property
    def mlflow_url(self) -> str:
        state = self._load_state()
        return state["urls"]["mlflow"] if state else self.settings.mlflow_url

    # ------------------------------------------------------------------ what to run

    def _client_env(self, state: dict) -> dict[str, str]:
        return {
            "PREFECT_API_URL": state["urls"]["prefect"] + "/api",
            "MLFLOW_TRACKING_URI": state["urls"]["mlflow"],
            "EVALDAG_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }

    def _desired_specs(self, stack_id: str) -> dict[str, _Spec]:
        s = self.settings
        home = self.home
        prefect_home = home / "prefect"
        common = {"EVALDAG_HOME": str(home), STACK_ID_ENV: stack_id, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        if s.server is not None:
            return self._node_specs(common)
        mlflow_dir = home / "mlflow"
        repo = {"EVALDAG_REPO": _repo()}  # where flow runs start (the pull step of deployments/prefect.yaml)
        specs: dict[str, _Spec] = {}

        db_url = s.database_url or f"sqlite+aiosqlite:///{prefect_home / 'prefect.db'}"
        if s.postgres:
            root = self.postgres_dir
            creds = pg.ensure_cluster(root)
            db_url = pg.url(creds, s.postgres_port)
            argv = pg.server_argv(root, s.postgres_port)
            specs[POSTGRES] = _Spec(POSTGRES, "db", argv, dict(common), root, f"postgresql://127.0.0.1:"
                                    f"{s.postgres_port}", s.postgres_port, key={"argv": argv}, popen=pg.run_as())

        argv = [_cli("prefect"), "server", "start", "--host", s.host, "--port", str(s.prefect_port)]
        env = {**common, "PREFECT_HOME": str(prefect_home), "PREFECT_API_URL": s.prefect_api_url,
               "PREFECT_SERVER_DATABASE_CONNECTION_URL": db_url}
        if s.host != s.local_host or s.advertise_host:
            # the UI runs in browsers on other hosts: it must call the API by an address they reach
            env["PREFECT_UI_API_URL"] = f"http://{s.public_host}:{s.prefect_port}/api"
        specs[PREFECT_SERVER] = _Spec(PREFECT_SERVER, "server", argv, env, home, s.prefect_url, s.prefect_port,
                                      key={"argv": argv, "env": env})

        argv = [_cli("mlflow"), "server",
                "--backend-store-uri", f"sqlite:///{mlflow_dir / 'mlflow.db'}",
                "--artifacts-destination", str(mlflow_dir / "artifacts"),
                "--host", s.host, "--port", str(s.mlflow_port), "--workers", "1"]
        env = {**common, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        if s.advertise_host and not os.environ.get("MLFLOW_SERVER_ALLOWED_HOSTS"):
            # MLflow answers 403 to a Host header it does not know; private addresses are known, names are not
            env["MLFLOW_SERVER_ALLOWED_HOSTS"] = f"{_MLFLOW_ALLOWED_HOSTS},{s.advertise_host},{s.advertise_host}:*"
        specs[MLFLOW_SERVER] = _Spec(MLFLOW_SERVER, "server", argv, env, home, s.mlflow_url, s.mlflow_port,
                                     key={"argv": argv, "env": env})

        passthrough = self._worker_settings()
        # where checkpoint events may point: examples/train_sft.py writes to <repo>/runs unless told otherwise
        passthrough.setdefault("EVALDAG_CHECKPOINT_ROOTS", str(paths.REPO_ROOT / "runs"))
        worker_env = {**passthrough, **common, **repo, **self._worker_runtime_env(),
                      "PREFECT_HOME": str(prefect_home), "PREFECT_API_URL": s.prefect_api_url,
                      "MLFLOW_TRACKING_URI": s.mlflow_url}
        workers = [(CPU_WORKER, CPU_POOL, s.cpu_worker_limit, None)]
        workers += [(f"gpu-worker-{i}", GPU_POOL, 1, ",".join(ids) if ids is not None else None)
                    for i, ids in enumerate(s.gpu_assignment)]
        for name, pool, limit, gpu in workers:
            specs[name] = self._worker_spec(name, pool, limit, gpu, worker_env, passthrough)
        return specs

    def _node_specs(self, common: dict[str, str]) -> dict[str, _Spec]:
        """A worker node's gpu workers: the head's Prefect API, its published MLflow URL, result store and
        settings (evaldag.cluster), the node's `worker_env` over them, and this node's own state folder."""
        s = self.settings
        info = self._head_info()
        passthrough = {**info.env, **self._worker_settings(), **s.worker_env}
        worker_env = {**passthrough, **common, "EVALDAG_REPO": _repo(), **self._worker_runtime_env(),
                      "PREFECT_HOME": str(self.home / "prefect"), "PREFECT_API_URL": s.prefect_api_url,
                      "MLFLOW_TRACKING_URI": s.worker_env.get("MLFLOW_TRACKING_URI",
                                                              cluster.reachable(info.mlflow_url, s.server)),
                      "EVALDAG_RESULTS_URL": s.worker_env.get("EVALDAG_RESULTS_URL", info.results_url)}
        # the head's crash automation expects its period; a node that beat slower would be crashed while alive
        worker_env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(info.heartbeat_s)
        return {name: self._worker_spec(name, GPU_POOL, 1, ",".join(ids) if ids is not None else None, worker_env,
                                        passthrough)
                for name, ids in ((f"{s.node_name}-gpu-{i}", ids) for i, ids in enumerate(s.gpu_assignment))}

    def _worker_runtime_env(self) -> dict[str, str]:
        """Prefect and MLflow client settings every worker of this stack (head or node) runs with."""
        return {
            "PREFECT_WORKER_QUERY_SECONDS": f"{self.settings.worker_query_seconds:g}",
            # lost nodes: a flow run's heartbeat stops with its process; the head's automation then crashes it
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(self.settings.heartbeat_s),
            # progress lines of the core (generation tok/s per batch) reach the Prefect UI too
            "PREFECT_LOGGING_EXTRA_LOGGERS": "evaldag",
            # fail an MLflow call within seconds and let the track task's backoff retry it, instead of
            # MLflow's own retries blocking a worker slot for minutes
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}

    def _worker_spec(self, name: str, pool: str, limit: int, gpu: str | None, worker_env: dict[str, str],
                     passthrough: dict[str, str]) -> _Spec:
        s = self.settings
        argv = [_cli("prefect"), "worker", "start", "--pool", pool, "--name", name, "--type", "process",
                "--limit", str(limit)]
        env = dict(worker_env)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        elif pool == GPU_POOL and s.gpu_workers > 1 and "EVALDAG_TORCH_THREADS" not in env:
            # unpinned slots share this machine's cores: two torch processes with all cores each
            # oversubscribe them and both slow down (see the CPU notes), so each gets its share
            env["EVALDAG_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // s.gpu_workers))
        return _Spec(name, "worker", argv, env, paths.REPO_ROOT, pool=pool,
                     key={"argv": argv, "env": env, "passthrough": passthrough})

    def _head_info(self) -> cluster.ClusterInfo:
        """What the head publishes (fetched once per Stack); with --mlflow-url and --results-url both given on
        the command line, a head without the block (not started by `evaldag up`) is fine too."""
        if getattr(self, "_info", None) is None:
            s = self.settings
            try:
                self._info = cluster.fetch(s.prefect_api_url)
            except StackError:
                if not {"MLFLOW_TRACKING_URI", "EVALDAG_RESULTS_URL"} <= s.worker_env.keys():
                    raise
                self._info = cluster.ClusterInfo(prefect_url=s.server, mlflow_url=s.worker_env["MLFLOW_TRACKING_URI"],
                                                 results_url=s.worker_env["EVALDAG_RESULTS_URL"],
                                                 heartbeat_s=s.heartbeat_s)
        return self._info

    def _cluster_info(self) -> cluster.ClusterInfo:
        """What this head publishes for its worker nodes."""
        s = self.settings
        host = s.public_host
        worker_env = {**self._worker_settings()}
        return cluster.ClusterInfo(
            prefect_url=f"http://{host}:{s.prefect_port}", mlflow_url=f"http://{host}:{s.mlflow_port}",
            results_url=self._results_root(), heartbeat_s=s.heartbeat_s,
            env=cluster.shared_env(worker_env, os.environ), head=socket.gethostname())

    def _check_role(self, state: dict) -> None:
        """A home is either a head or a worker node; never turn one into the other by accident."""
        role = state.get("role", "head")
        want = "node" if self.settings.server is not None else "head"
        if not state["components"] or role == want:
            return
        if role == "node":
            raise StackError(f"{self.home} holds a worker node of {state['urls']['prefect']}; run `evaldag worker "
                             f"--server ...` to change it, or `evaldag down` first (or use another EVALDAG_HOME)")
        raise StackError(f"{self.home} holds a head stack (Prefect and MLflow servers); a worker node needs a state "
                         "folder of its own: set EVALDAG_HOME to another folder, or `evaldag down` first")

    def _check_head_pools(self) -> None:
        with httpx.Client(base_url=self.settings.prefect_api_url, timeout=30) as client:
            try:
                r = client.get("/work_pools/gpu")
            except httpx.HTTPError as e:
                raise StackError(f"cannot reach the head's Prefect API at {self.settings.prefect_api_url}: {e}")
        if r.status_code != 200:
            raise StackError(f"the Prefect server at {self.settings.server} has no `gpu` work pool (HTTP "
                             f"{r.status_code}); run `evaldag up` on the head first")

    @property
    def postgres_dir(self) -> Path:
        """Folder of the private PostgreSQL cluster (settings.postgres_dir, else evaldag.postgres.default_dir)."""
        d = self.settings.postgres_dir
        return Path(d).expanduser().resolve() if d else pg.default_dir(self.home)

    def _pg_credentials(self) -> dict[str, str]:
        return pg.ensure_cluster(self.postgres_dir)

    def _urls(self) -> dict[str, str]:
        s = self.settings
        if s.server is not None:
            info = self._head_info()
            return {"prefect": s.server,
                    "mlflow": s.worker_env.get("MLFLOW_TRACKING_URI", cluster.reachable(info.mlflow_url, s.server))}
        return {"prefect": s.prefect_url, "mlflow": s.mlflow_url}

    def _results_root(self) -> str:
        """The workers' result store: their EVALDAG_RESULTS_URL (or _DIR), else <home>/results."""
        return str(store.root(self._worker_settings(), self.home))

    def _worker_settings(self) -> dict[str, str]:
        """EVALDAG_* settings for the workers (data mirror, checkpoint roots, ...): the caller's, else remembered.

        Remembered in <home>/stack/worker-env.json, so a later bare `evaldag up` (another shell, without the
        Makefile's exports) keeps the workers as they were instead of restarting them without the data mirror.
        To drop a setting, set it to an empty value.
        """
        saved = json.loads(self.env_path.read_text()) if self.env_path.is_file() else {}
        current = {k: v for k, v in os.environ.items() if k.startswith("EVALDAG_") and k not in _STACK_ENV}
        merged = {k: v for k, v in {**saved, **current}.items() if v != ""}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.env_path.write_text(json.dumps(merged, indent=2, sort_keys=True))
        return merged

    # ------------------------------------------------------------------ processes

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
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_reset_sigint, **spec.popen)
        _CHILDREN[proc.pid] = proc
        return {
            "kind": spec.kind, "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
            "argv": spec.argv, "url": spec.url, "port": spec.port, "pool": spec.pool, "key": spec.key,
            "log": str(log), "log_offset": offset, "started_at": started_at,
        }

    def _proc(self, rec: dict) -> psutil.Process | None:
        """The recorded process if it still runs and is the one we started (same pid *and* create time)."""
        pid = rec.get("pid")
        if not pid:
            return None
        self._reap(pid)
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - rec["create_time"]) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
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
        kinds = {n: comps[n]["kind"] if comps[n]["kind"] in _STOP_ORDER else "server" for n in names}
        for kind, signals in (("worker", (signal.SIGINT, signal.SIGTERM)), ("server", (signal.SIGTERM,)),
                              ("db", (signal.SIGINT,))):
            group = [comps[n] for n in names if kinds[n] == kind]
            if group:
                self._terminate(group, signals, leader_only=kind == "db")

    def _terminate(self, recs: list[dict], signals: tuple[int, ...], leader_only: bool = False) -> None:
        """Signal each component's process group (pgid == pid: each leads its own session), plus descendants that
        left the group (flow runs run in their own sessions); escalate to SIGKILL; wait until all are gone."""
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
                        os.killpg(p.pid, sig)
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
            for p in procs:
                self._reap(p.pid)
            procs = [p for p in procs if _running(p)]
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

    # ------------------------------------------------------------------ health

    def _server_healthy(self, name: str, url: str, timeout: float = 2.0) -> bool:
        if name == POSTGRES:
            return pg.is_ready(int(url.rsplit(":", 1)[1]))
        try:
            if name == PREFECT_SERVER:
                r = httpx.get(f"{url}/api/health", timeout=timeout)
                return r.status_code == 200 and r.json() is True
            r = httpx.get(f"{url}/health", timeout=timeout)
            return r.status_code == 200
        except (httpx.HTTPError, ValueError):
            return False

    def _wait_healthy(self, state: dict, names: list[str]) -> None:
        comps = state["components"]
        deadline = time.monotonic() + self.settings.start_timeout_s
        for name in names:
            rec = comps[name]
            while not self._server_healthy(name, rec["url"]):
                if not self._alive(rec):
                    raise StackError(f"{name} exited during start-up; last lines of {rec['log']}:\n"
                                     f"{_tail(rec['log'], rec.get('log_offset', 0))}")
                if time.monotonic() > deadline:
                    raise StackError(f"{name} did not become healthy at {rec['url']} within "
                                     f"{self.settings.start_timeout_s:g} s; last lines of {rec['log']}:\n"
                                     f"{_tail(rec['log'], rec.get('log_offset', 0))}")
                time.sleep(0.25)

    def _ensure_pools(self) -> None:
        """Create the process work pools `cpu` and `gpu` if missing (with Prefect's default process job template)."""
        api = self.settings.prefect_api_url
        with httpx.Client(base_url=api, timeout=30, transport=_RetryBusy()) as client:
            for pool in POOLS:
                r = client.get(f"/work_pools/{pool}")
                if r.status_code == 200:
                    if r.json().get("type") != "process":
                        raise StackError(f"work pool {pool!r} exists with type {r.json().get('type')!r}, expected "
                                         f"'process'; delete it (prefect work-pool delete {pool}) and run up again")
                    continue
                from prefect.workers.process import ProcessWorker  # ~1 s import, only when a pool is missing

                r = client.post("/work_pools/", json={
                    "name": pool, "type": "process",
                    "base_job_template": ProcessWorker.get_default_base_job_template(),
                    "description": f"evaldag {'parent flows' if pool == CPU_POOL else 'shard flows, one per GPU'}"})
                if r.status_code not in (200, 201, 409):
                    raise StackError(f"could not create work pool {pool!r}: HTTP {r.status_code} {r.text[:500]}")

    def _ensure_gpu_limit(self, reset_slots: bool = False) -> None:
        """Create or update the global concurrency limit GPU_LIMIT: one slot per GPU of the `gpu` pool.

        Shard flows hold `tensor_parallel_size` slots of it while generating (tasks/gpus.py). With no GPUs
        (--gpus 0) the limit is made inactive, which Prefect treats as unlimited, so inline shards still run.
        """
        n = self.settings.num_gpus
        body: dict[str, Any] = {"limit": n, "active": n > 0}
        if reset_slots:
            body.update(active_slots=0, denied_slots=0)
        with httpx.Client(base_url=self.settings.prefect_api_url, timeout=30, transport=_RetryBusy()) as client:
            r = client.patch(f"/v2/concurrency_limits/{GPU_LIMIT}", json=body)
            if r.status_code == 404:
                r = client.post("/v2/concurrency_limits/", json={"name": GPU_LIMIT, **body})
                if r.status_code == 409:  # created meanwhile by another client: update it
                    r = client.patch(f"/v2/concurrency_limits/{GPU_LIMIT}", json=body)
            if r.status_code not in (200, 201, 204):
                raise StackError(f"could not create or update the concurrency limit {GPU_LIMIT!r}: "
                                 f"HTTP {r.status_code} {r.text[:500]}")

    def _online_workers(self, state: dict, names: list[str], since: dict[str, float] | None = None) -> set[str]:
        """Names of workers the server sees ONLINE (with a heartbeat after `since[name]`, when given)."""
        comps = state["components"]
        api = state["urls"]["prefect"] + "/api"
        online: set[str] = set()
        try:
            with httpx.Client(base_url=api, timeout=2) as client:
                for pool in {comps[n]["pool"] for n in names}:
                    r = client.post(f"/work_pools/{pool}/workers/filter", json={})
                    if r.status_code != 200:
                        continue
                    for w in r.json():
                        name = w.get("name")
                        if name not in names or comps[name]["pool"] != pool or w.get("status") != "ONLINE":
                            continue
                        if since is not None:
                            beat = w.get("last_heartbeat_time")
                            if not beat or datetime.fromisoformat(beat).timestamp() < since[name]:
                                continue
                        online.add(name)
        except (httpx.HTTPError, ValueError):
            pass
        return online

    def _wait_workers_online(self, state: dict, names: list[str]) -> None:
        comps = state["components"]
        since = {n: comps[n]["started_at"] for n in names}  # wall clock (create_time can be ~1 s early)
        deadline = time.monotonic() + self.settings.start_timeout_s
        pending = set(names)
        while pending:
            pending -= self._online_workers(state, sorted(pending), since)
            for name in sorted(pending):
                rec = comps[name]
                if not self._alive(rec):
                    raise StackError(f"{name} exited during start-up; last lines of {rec['log']}:\n"
                                     f"{_tail(rec['log'], rec.get('log_offset', 0))}")
            if pending and time.monotonic() > deadline:
                name = sorted(pending)[0]
                raise StackError(f"{name} did not register with the Prefect server within "
                                 f"{self.settings.start_timeout_s:g} s; last lines of {comps[name]['log']}:\n"
                                 f"{_tail(comps[name]['log'], comps[name].get('log_offset', 0))}")
            if pending:
                time.sleep(0.5)

    def _check_port_free(self, spec: _Spec) -> None:
        host, port = ("127.0.0.1" if spec.name == POSTGRES else self.settings.host), spec.port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is not "busy"
            try:
                s.bind((host, port))
                return
            except OSError as e:
                err = e
        holder = _port_holder(port)
        var, what = {PREFECT_SERVER: ("EVALDAG_PREFECT_PORT", "Prefect server"),
                     POSTGRES: ("EVALDAG_POSTGRES_PORT", "PostgreSQL cluster")}.get(
                         spec.name, ("EVALDAG_MLFLOW_PORT", "MLflow server"))
        raise StackError(
            f"port {port} on {host}, needed by the {what}, is busy ({err.strerror}): held by "
            f"{holder or 'a process psutil cannot identify'}. Stop that program, or pick another port, e.g. "
            f"`export {var}={_free_port(host)}` (then run `evaldag up` again)")

    # ------------------------------------------------------------------ state

    def _new_state(self) -> dict:
        return {"version": STATE_VERSION, "stack_id": uuid.uuid4().hex, "home": str(self.home),
                "created_at": time.time(), "urls": self._urls(), "components": {}}

    def _load_state(self) -> dict | None:
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StackError(f"cannot read {self.state_path} ({e}); stop any leftover processes by hand and "
                             f"delete the file") from None
        if state.get("version") != STATE_VERSION:
            raise StackError(f"{self.state_path} has version {state.get('version')}, expected {STATE_VERSION}; "
                             "stop the stack with the evaldag version that started it")
        return state

    def _save_state(self, state: dict) -> None:
        s = self.settings
        state["urls"] = self._urls()
        state["settings"] = s.model_dump(mode="json", exclude={"worker_env"})  # it may hold credentials
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.chmod(0o600)  # the recorded environments may hold credentials (database, result store)
        tmp.replace(self.state_path)

    def _remove_state(self) -> None:
        self.state_path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """One `up`/`down` at a time per home."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------- helpers

def _detected_gpus(num_gpus: int) -> tuple[str, ...] | None:
    """The first `num_gpus` GPU ids of this machine (evaldag.gpus.detect_gpu_ids), None on a machine without GPUs."""
    ids = detect_gpu_ids()
    if ids is None:
        return None
    if len(ids) < num_gpus:
        raise StackError(f"--gpus {num_gpus} asks for more GPUs than this machine shows: {len(ids)} "
                         f"({','.join(ids)}); use --gpus {len(ids)} or name the GPUs with EVALDAG_GPUS")
    return ids[:num_gpus]


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


def _safe(fn: Any, **kwargs: Any) -> list:
    try:
        return list(fn(**kwargs))
    except psutil.Error:
        return []


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):
            if p.pid != pgid and os.getpgid(p.pid) == pgid:
                members.append(p)
    return members


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

"""The local stack: a Prefect server, process work pools `cpu`/`gpu` with their workers, and an MLflow server.

Two roles share this code. A head (`evaldag up`) runs the servers (Prefect on SQLite, or on PostgreSQL: a private
cluster with `--postgres`, any server with `--database-url`), the pools, a `cpu` worker and its own gpu workers,
and publishes what worker nodes need (evaldag.runtime.cluster). A worker node (`evaldag worker --server http://head:4200`,
`StackSettings.server` set) runs only its gpu workers, pointed at the head. Every worker sends flow-run heartbeats
(`heartbeat_s`), and the head's crash automation turns a run whose heartbeats stop into Crashed (lost nodes).

The `gpu` pool gets num_gpus // tp workers, each pinned to tp GPUs (evaldag.request.gpus.assign_gpus), and the server a
global concurrency limit `evaldag-gpus` with one slot per GPU, which shard flows hold while generating.

Everything lives under one state directory, `evaldag.paths.home()`:

    <home>/prefect/          PREFECT_HOME of the server and the workers (SQLite DB, result storage)
    <home>/mlflow/           mlflow.db (SQLite backend store) and artifacts/
    <home>/logs/<name>.log   stdout+stderr of every component, and deploy.log
    <home>/stack/state.json  what `up` started: pid + process create time (so a recycled pid is never ours), URLs
    evaldag.runtime.postgres.default_dir(home)   the private PostgreSQL cluster, when asked for (`--postgres`)

`Stack.up()` is idempotent: a component that is alive, ours and configured as asked is left alone; a dead one, a
server that does not answer (stopping, or hung), or one started with another configuration, is (re)started.
`Stack.down()` stops workers first, then the servers, and kills whole process groups plus every process that carries
this stack's `EVALDAG_STACK_ID` (flow runs spawned by a worker run in their own process groups, so a process-group kill
alone would miss them).

The package, one job per module: `settings` (StackSettings, component names), `components` (what to run: argv,
environment and the key that decides whether a running component is kept), `processes` (start, recognise, stop),
`prefect_setup` (health, work pools, the gpu limit, deploy: the server over HTTP), `state` (state.json and the
lock). `Stack` here composes them and holds the public API: up, down, status, deploy, env_lines.

Facts this relies on (docs/notes/prefect-mlflow.md 1.3, 1.5, 5.2):
- a worker whose SIGINT is inherited as ignored never stops on SIGTERM, so children get SIGINT reset to default;
- `mlflow server --workers 1` with MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: 2 processes, ~0.5 GB, instead of 15;
- the worker poll (PREFECT_WORKER_QUERY_SECONDS, default 10 s) dominated run latency, and each poll costs the server
  CPU (docs/performance.md): the workers are woken by the server's flow-run events instead (runtime.wake_worker)
  and poll at Prefect's 10 s only for what the event stream misses.
"""

from __future__ import annotations

import contextlib
import shlex
import time
from pathlib import Path

from evaldag.runtime import postgres as pg
from evaldag.runtime.stack.components import Components
from evaldag.runtime.stack.prefect_setup import PrefectSetup, _RetryBusy
from evaldag.runtime.stack.processes import STOP_ORDER, ProcessSupervisor, _Spec
from evaldag.runtime.stack.settings import (CPU_WORKER, MLFLOW_SERVER, POSTGRES, PREFECT_SERVER, SERVERS, STACK_ID_ENV,
                                    STATE_VERSION, ComponentStatus, StackSettings, UpReport)
from evaldag.runtime.stack.state import StateFile


class Stack(Components, ProcessSupervisor, PrefectSetup, StateFile):
    """Start, stop and inspect the local stack described by `settings` (default: `StackSettings.from_env()`)."""

    def __init__(self, settings: StackSettings | None = None) -> None:
        self.settings = settings or StackSettings.from_env()
        self.home = Path(self.settings.home).expanduser().resolve()
        self.state_dir = self.home / "stack"
        self.state_path = self.state_dir / "state.json"
        self.env_path = self.state_dir / "worker-env.json"
        self.logs_dir = self.home / "logs"

    # ------------------------------------------------------------------ public API

    def up(self, deploy: bool = True) -> UpReport:
        """Start what is missing, wait until everything is healthy, then deploy (if `deploy`). Idempotent.

        On a worker node (settings.server set) this starts only the node's gpu workers, configured from the head,
        and never deploys (the head did)."""
        t0 = time.monotonic()
        report = UpReport()
        node = self.settings.server is not None
        self.settings.check_exposure()  # before anything starts: no open head on a network
        self._make_private()
        with self._lock():
            state = self._load_state() or self._new_state()
            self._check_role(state)
            state["role"] = "node" if node else "head"
            self._remember_worker_settings()
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
                if name in specs and specs[name].port is not None:  # replaced below, on the same port
                    self._wait_port_released(specs[name])

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

    def down(self) -> list[str]:
        """Stop workers, then servers; remove the state file. Returns the components that were running."""
        with self._lock():
            state = self._load_state()
            if not state:
                return []
            comps = state["components"]
            order = sorted(comps, key=lambda n: STOP_ORDER.get(comps[n]["kind"], 1))  # workers, servers, db
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

    def env_lines(self, secrets: bool = True) -> list[str]:
        """`export` lines that point a shell at this stack (`eval "$(evaldag env)"`); with `secrets`, also the
        API auth's variables of a stack that has one (`client_auth_env`)."""
        state = self._load_state()
        env = self._client_env(state) if state else {
            "PREFECT_API_URL": self.settings.prefect_api_url, "MLFLOW_TRACKING_URI": self.settings.mlflow_url,
            "EVALDAG_HOME": str(self.home), **self.client_auth_env({})}
        keys = ["PREFECT_API_URL", "MLFLOW_TRACKING_URI", "EVALDAG_HOME"]
        if secrets:
            keys += [k for k in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
                     if k in env]
        return [f"export {k}={shlex.quote(env[k])}" for k in keys]

    @property
    def prefect_url(self) -> str:
        """Prefect UI of the running stack (or of the settings when nothing runs)."""
        state = self._load_state()
        return state["urls"]["prefect"] if state else self.settings.prefect_url

    @property
    def mlflow_url(self) -> str:
        """MLflow UI of the running stack (or of the settings when nothing runs)."""
        state = self._load_state()
        return state["urls"]["mlflow"] if state else self.settings.mlflow_url


__all__ = ["Stack", "StackSettings", "ComponentStatus", "UpReport", "CPU_WORKER", "MLFLOW_SERVER", "POSTGRES",
           "PREFECT_SERVER", "SERVERS", "STACK_ID_ENV", "STATE_VERSION", "_RetryBusy"]

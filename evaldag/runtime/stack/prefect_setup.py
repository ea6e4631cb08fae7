"""What the stack sets up on its Prefect server over HTTP: health checks, the `cpu`/`gpu` process work pools, the
`evaldag-gpus` concurrency limit, result storage, crash automation, the cluster block, and `prefect deploy`; and
waiting until workers register.

What any Prefect server needs for evaldag (pools, the gpu limit, the crash automation, the deployments) is in
module-level functions (`ensure_pools`, `ensure_gpu_limit`, `deploy_manifest`, `register`), which the stack and
`evaldag deploy` on a team's own server (docs/own-servers.md) both call."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from evaldag import paths

from evaldag.runtime import cluster, prefect_results
from evaldag.runtime import postgres as pg
from evaldag.runtime.deployments import CPU_POOL, MANIFEST, POOLS
from evaldag.errors import StackError
from evaldag.request.gpus import GPU_LIMIT
from evaldag.runtime.stack.processes import _cli, _log_tail, _repo, _tail
from evaldag.runtime.stack.settings import POSTGRES, PREFECT_SERVER, StackSettings

# How the local pools' workers start a flow run: evaldag.runtime.flow_run_launcher, one bare interpreter start instead of
# Prefect's workspace supervisor (seconds of imports per flow run, docs/performance.md). `python` is the workers' environment's:
# they run with its bin folder first on PATH (the pool is shared by every host, each with its own environment).
FLOW_RUN_COMMAND = "python -m evaldag.runtime.flow_run_launcher"
# What earlier versions of evaldag set: a pool that still holds one is given FLOW_RUN_COMMAND (the module moved)
_FORMER_COMMANDS = frozenset({"python -m evaldag.flow_run_launcher"})


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


def _head_pool_problem(server: str, status: int, body: str) -> str | None:
    """What a node's GET of the head's `gpu` work pool answered, when it is not the pool (200): the status received,
    what it means, and the fix. Only a 404 means there is no pool; a 403 or a 5xx says nothing about pools."""
    got = f"the Prefect server at {server} answered HTTP {status} for the `gpu` work pool ({body.strip()[:200]!r})"
    if status == 200:
        return None
    if status == 401:
        return (f"{got}: it refused this node's auth; give the USER:PASSWORD the head was started with as "
                "`evaldag worker --auth` or EVALDAG_API_AUTH")
    if status == 404:
        return (f"{got}: it has no `gpu` work pool; run `evaldag up` on the head first (or, if it has run, check "
                "that --server is the head's Prefect address, http://HEAD:4200)")
    if status == 403:
        return (f"{got}: a proxy or firewall between this node and the head refused the request; let this node "
                f"reach {server} directly (add the head to NO_PROXY, or fix the proxy's rules) and try again")
    if status >= 500:
        return (f"{got}: the head's Prefect server failed (or a proxy in front of it); look at its log "
                "on the head ($EVALDAG_HOME/logs/prefect-server.log), fix the cause or restart it with `evaldag up` "
                "there, then try again")
    return (f"{got}, not the pool; check that --server is the head's Prefect address (http://HEAD:4200, nothing "
            "that redirects or proxies it elsewhere)")


def deploy_manifest(env: dict[str, str], log: Path | None = None, manifest: Path = MANIFEST) -> None:
    """`prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml` from the repository root, with
    `env` (PREFECT_API_URL and its auth, EVALDAG_REPO): its output to `log`, or to this terminal when None."""
    if not manifest.exists():
        raise StackError(f"no deployment manifest at {manifest}; nothing to deploy "
                         "(use `evaldag up --no-deploy` to start the stack without deploying)")
    argv = [_cli("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(manifest)]
    out = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "wb")   # noqa: SIM115 - closed below
        out.write(f"$ {shlex.join(argv)}\n".encode())
        out.flush()
    where = f"; last lines of {log}:\n" if log is not None else " (its output is above)"
    try:
        proc = subprocess.run(argv, cwd=paths.REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT if out else None, timeout=600)
    except subprocess.TimeoutExpired:
        raise StackError(f"`prefect deploy` took more than 600 s{where}{_tail(log) if log else ''}") from None
    finally:
        if out is not None:
            out.close()
    if proc.returncode != 0:
        raise StackError(f"`prefect deploy` failed (exit code {proc.returncode}){where}{_tail(log) if log else ''}")


def register(api_url: str, headers: dict[str, str], num_gpus: int, heartbeat_s: int,
             missed_heartbeats: int = cluster.MISSED_HEARTBEATS) -> None:
    """Everything evaldag's flows need on a Prefect server besides the deployments: the `cpu` and `gpu` pools, the
    gpu concurrency limit (`num_gpus` slots) and the crash automation for runs whose heartbeats stop. Idempotent.
    The server's default result storage is left alone: on a shared server it is everybody's."""
    ensure_pools(api_url, headers)
    ensure_gpu_limit(api_url, headers, num_gpus)
    cluster.ensure_crash_automation(api_url, heartbeat_s, missed_heartbeats)


def ensure_pools(api_url: str, headers: dict[str, str]) -> None:
    """Create the process work pools `cpu` and `gpu` if missing: Prefect's default process job template, whose
    flow runs start with FLOW_RUN_COMMAND. A pool that exists without a command gets it; one with a command of
    its own keeps it."""
    with httpx.Client(base_url=api_url, timeout=30, transport=_RetryBusy(), headers=headers) as client:
        for pool in POOLS:
            r = client.get(f"/work_pools/{pool}")
            if r.status_code == 200:
                _update_pool(client, pool, r.json())
                continue
            if r.status_code in (401, 403):
                raise StackError(f"the Prefect server at {api_url} refused access (HTTP {r.status_code}); set "
                                 "PREFECT_API_AUTH_STRING (USER:PASSWORD) or PREFECT_API_KEY to what it accepts")
            from prefect.workers.process import ProcessWorker  # ~1 s import, only when a pool is missing

            template = ProcessWorker.get_default_base_job_template()
            template["variables"]["properties"]["command"]["default"] = FLOW_RUN_COMMAND
            r = client.post("/work_pools/", json={
                "name": pool, "type": "process", "base_job_template": template,
                "description": f"evaldag {'parent flows' if pool == CPU_POOL else 'shard flows, one per GPU'}"})
            if r.status_code not in (200, 201, 409):
                raise StackError(f"could not create work pool {pool!r}: HTTP {r.status_code} {r.text[:500]}")


def _update_pool(client: httpx.Client, pool: str, existing: dict) -> None:
    """Check that an existing pool is a process pool; give it FLOW_RUN_COMMAND if it has no command or one that
    an earlier evaldag set (_FORMER_COMMANDS); a command of the user's own stays."""
    if existing.get("type") != "process":
        raise StackError(f"work pool {pool!r} exists with type {existing.get('type')!r}, expected "
                         f"'process'; delete it (prefect work-pool delete {pool}) and run up again")
    template = existing.get("base_job_template") or {}
    command = template.get("variables", {}).get("properties", {}).get("command")
    if command is not None and (command.get("default") is None or command["default"] in _FORMER_COMMANDS):
        command["default"] = FLOW_RUN_COMMAND
        r = client.patch(f"/work_pools/{pool}", json={"base_job_template": template})
        if r.status_code not in (200, 204):
            raise StackError(f"could not update work pool {pool!r}: HTTP {r.status_code} {r.text[:500]}")


def ensure_gpu_limit(api_url: str, headers: dict[str, str], num_gpus: int, reset_slots: bool = False) -> None:
    """Create or update the global concurrency limit GPU_LIMIT: one slot per GPU of the `gpu` pool.

    Shard flows hold `tensor_parallel_size` slots of it while generating (tasks/gpu_slots.py). With no GPUs
    (--gpus 0) the limit is made inactive, which Prefect treats as unlimited, so inline shards still run.
    """
    body: dict[str, Any] = {"limit": num_gpus, "active": num_gpus > 0}
    if reset_slots:
        body.update(active_slots=0, denied_slots=0)
    with httpx.Client(base_url=api_url, timeout=30, transport=_RetryBusy(), headers=headers) as client:
        r = client.patch(f"/v2/concurrency_limits/{GPU_LIMIT}", json=body)
        if r.status_code == 404:
            r = client.post("/v2/concurrency_limits/", json={"name": GPU_LIMIT, **body})
            if r.status_code == 409:  # created meanwhile by another client: update it
                r = client.patch(f"/v2/concurrency_limits/{GPU_LIMIT}", json=body)
        if r.status_code not in (200, 201, 204):
            raise StackError(f"could not create or update the concurrency limit {GPU_LIMIT!r}: "
                             f"HTTP {r.status_code} {r.text[:500]}")


class PrefectSetup:
    """The Prefect server side of the stack (a part of `evaldag.runtime.stack.Stack`)."""

    settings: StackSettings
    home: Path
    logs_dir: Path

    @property
    def deployments_file(self) -> Path:
        return MANIFEST

    def deploy(self) -> None:
        """`prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml` against the running server."""
        state = self._load_state()
        if not state or not self._alive(state["components"].get(PREFECT_SERVER, {})):
            raise StackError("the Prefect server of the local stack is not running; start it with `evaldag up`")
        env = {**os.environ, **self._client_env(state), "PREFECT_HOME": str(self.home / "prefect"),
               "EVALDAG_REPO": _repo()}
        deploy_manifest(env, self.logs_dir / "deploy.log", self.deployments_file)

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
                    raise StackError(f"{name} exited during start-up; {_log_tail(rec)}")
                if time.monotonic() > deadline:
                    raise StackError(f"{name} did not become healthy at {rec['url']} within "
                                     f"{self.settings.start_timeout_s:g} s; {_log_tail(rec)}")
                time.sleep(0.25)

    def _configure_server(self, fresh: bool) -> None:
        """Work pools, the gpu limit, result storage, crash automation and cluster info on the head's server."""
        from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

        with temporary_settings(updates={PREFECT_API_AUTH_STRING: self.settings.api_auth}):
            self._configure_server_authenticated(fresh)

    def _configure_server_authenticated(self, fresh: bool) -> None:
        self._ensure_pools()
        # a fresh server lost every lease (leases live in its memory): slots counted as held are orphans
        self._ensure_gpu_limit(reset_slots=fresh)
        # flow and task results go to the workers' result store, where every node can read them
        prefect_results.configure(self.settings.prefect_api_url, self._results_root())
        # lost nodes: runs whose heartbeats stop are set Crashed, so their parents relaunch them
        cluster.ensure_crash_automation(self.settings.prefect_api_url, self.settings.heartbeat_s,
                                        self.settings.missed_heartbeats)
        # the block holds credentials and the Prefect API hands it to whoever asks: only a head started for nodes
        # (which has API auth, see StackSettings.check_exposure) publishes it
        if self.settings.for_nodes:
            cluster.publish(self.settings.prefect_api_url, self._cluster_info())
        else:
            cluster.unpublish(self.settings.prefect_api_url)

    def _ensure_pools(self) -> None:
        ensure_pools(self.settings.prefect_api_url, self._api_headers())

    _update_pool = staticmethod(_update_pool)

    def _ensure_gpu_limit(self, reset_slots: bool = False) -> None:
        ensure_gpu_limit(self.settings.prefect_api_url, self._api_headers(), self.settings.num_gpus, reset_slots)

    def _check_head_pools(self) -> None:
        with httpx.Client(base_url=self.settings.prefect_api_url, timeout=30, headers=self._api_headers()) as client:
            try:
                r = client.get("/work_pools/gpu")
            except httpx.HTTPError as e:
                raise StackError(f"cannot reach the head's Prefect API at {self.settings.prefect_api_url}: {e}")
        if problem := _head_pool_problem(self.settings.server, r.status_code, r.text):
            raise StackError(problem)

    def _online_workers(self, state: dict, names: list[str], since: dict[str, float] | None = None) -> set[str]:
        """Names of workers the server sees ONLINE (with a heartbeat after `since[name]`, when given)."""
        comps = state["components"]
        api = state["urls"]["prefect"] + "/api"
        online: set[str] = set()
        try:
            with httpx.Client(base_url=api, timeout=2, headers=self._api_headers()) as client:
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
                    raise StackError(f"{name} exited during start-up; {_log_tail(rec)}")
            if pending and time.monotonic() > deadline:
                name = sorted(pending)[0]
                raise StackError(f"{name} did not register with the Prefect server within "
                                 f"{self.settings.start_timeout_s:g} s; {_log_tail(comps[name])}")
            if pending:
                time.sleep(0.5)

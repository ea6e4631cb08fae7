"""What the stack runs: one spec per component (argv, environment, port, the key that decides whether a running one
is kept), for a head or a worker node, and the worker settings remembered between `evaldag up` calls."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

from evaldag import paths
from evaldag.storage import store

from evaldag.runtime import cluster
from evaldag.runtime import postgres as pg
from evaldag.runtime.deployments import CPU_POOL, GPU_POOL
from evaldag.errors import StackError
from evaldag.runtime.stack.processes import _cli, _repo, _Spec
from evaldag.runtime.stack.settings import (_STACK_ENV, CPU_WORKER, MLFLOW_SERVER, POSTGRES, PREFECT_SERVER, STACK_ID_ENV,
                                    StackSettings)

# MLflow's default allowed Host headers (mlflow.server.security_utils): a head reached by a name needs it added
_MLFLOW_ALLOWED_HOSTS = ("localhost,127.0.0.1,[::1],0.0.0.0,localhost:*,127.0.0.1:*,[[]::1]:*,0.0.0.0:*,192.168.*,"
                         "10.*," + ",".join(f"172.{i}.*" for i in range(16, 32)) + ",fc00:*,fd00:*")


# How an MLflow client authenticates and trusts its server: taken from the caller's environment with its
# MLFLOW_TRACKING_URI (a team's own server), never mixed with the stack's credentials
MLFLOW_CLIENT_VARS = frozenset({"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                                "MLFLOW_TRACKING_AUTH", "MLFLOW_TRACKING_INSECURE_TLS",
                                "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_CLIENT_CERT_PATH"})

# MLflow client retries of one request in a flow run (its own default is 7): the track task's backoff retries after
MLFLOW_RETRIES = 2


class Components:
    """The specs of the stack's components (a part of `evaldag.runtime.stack.Stack`)."""

    settings: StackSettings
    home: Path
    state_dir: Path
    env_path: Path

    def _client_env(self, state: dict) -> dict[str, str]:
        return {
            "PREFECT_API_URL": state["urls"]["prefect"] + "/api",
            "MLFLOW_TRACKING_URI": state["urls"]["mlflow"],
            "EVALDAG_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **self.client_auth_env(state),
        }

    def client_auth_env(self, state: dict | None = None) -> dict[str, str]:
        """The variables that let a Prefect and an MLflow client in through the stack's auth (empty without auth):
        PREFECT_API_AUTH_STRING, MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD."""
        auth = self._api_auth(state)
        if not auth:
            return {}
        user, _, password = auth.partition(":")
        return {"PREFECT_API_AUTH_STRING": auth, "MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}

    def _api_auth(self, state: dict | None = None) -> str | None:
        """USER:PASSWORD of the stack's servers: the settings' (`--auth`, EVALDAG_API_AUTH), else the one the
        running stack was started with (so `evaldag run` or `status` in another shell gets in too)."""
        if self.settings.api_auth:
            return self.settings.api_auth
        state = state if state is not None else self._load_state()
        for rec in (state or {}).get("components", {}).values():
            env = rec.get("key", {}).get("env", {})
            if auth := env.get("PREFECT_SERVER_API_AUTH_STRING") or env.get("PREFECT_API_AUTH_STRING"):
                return auth
        return None

    def _api_headers(self) -> dict[str, str]:
        """The Authorization header of a request to the stack's Prefect API (none without auth)."""
        auth = self._api_auth()
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}

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
        if s.api_auth:
            env["PREFECT_SERVER_API_AUTH_STRING"] = s.api_auth
        specs[PREFECT_SERVER] = _Spec(PREFECT_SERVER, "server", argv, env, home, s.prefect_url, s.prefect_port,
                                      key={"argv": argv, "env": env})

        argv = [_cli("mlflow"), "server",
                "--backend-store-uri", f"sqlite:///{mlflow_dir / 'mlflow.db'}",
                "--artifacts-destination", str(mlflow_dir / "artifacts"),
                "--host", s.host, "--port", str(s.mlflow_port), "--workers", "1"]
        env = {**common, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        if s.api_auth:
            argv += ["--app-name", "basic-auth"]
            env.update(self._mlflow_auth_env(mlflow_dir, s.api_auth))
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
                      **self.client_auth_env({}), **self._tracking_env()}
        workers = [(CPU_WORKER, CPU_POOL, s.cpu_worker_limit, None)]
        workers += [(f"gpu-worker-{i}", GPU_POOL, 1, ",".join(ids) if ids is not None else None)
                    for i, ids in enumerate(s.gpu_assignment)]
        for name, pool, limit, gpu in workers:
            specs[name] = self._worker_spec(name, pool, limit, gpu, worker_env, passthrough)
        return specs

    def _node_specs(self, common: dict[str, str]) -> dict[str, _Spec]:
        """A worker node's gpu workers: the head's Prefect API, its published MLflow URL, result store and
        settings (evaldag.runtime.cluster), the node's `worker_env` over them, and this node's own state folder."""
        s = self.settings
        worker_env, passthrough = self._node_worker_env(common)
        return {name: self._worker_spec(name, GPU_POOL, 1, ",".join(ids) if ids is not None else None, worker_env,
                                        passthrough)
                for name, ids in ((f"{s.node_name}-gpu-{i}", ids) for i, ids in enumerate(s.gpu_assignment))}

    def foreground_worker(self, pool: str, name: str) -> _Spec:
        """The one worker `evaldag worker --foreground` runs in its own process: what a node's `evaldag worker`
        would start for `pool` (the same module, environment and settings), on the GPUs this process sees (a
        cluster scheduler's CUDA_VISIBLE_DEVICES is left as it is), with no stack id: nothing of it is recorded or
        swept, its job's scheduler owns it."""
        s = self.settings
        worker_env, passthrough = self._node_worker_env({"EVALDAG_HOME": str(self.home),
                                                         "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        limit = 1 if pool == GPU_POOL else s.cpu_worker_limit
        return self._worker_spec(name, pool, limit, None, worker_env, passthrough)

    def _node_worker_env(self, common: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        """The environment of a node's workers and the settings passed through to them (see `_node_specs`)."""
        s = self.settings
        info = self._head_info()
        # the block is only as trustworthy as the Prefect API: take what the allow-list names, nothing that could
        # change what the workers load or run (LD_PRELOAD, PYTHONPATH)
        passthrough = {**cluster.accepted_env(info.env), **self._worker_settings(), **s.worker_env}
        worker_env = {**passthrough, **common, "EVALDAG_REPO": _repo(), **self._worker_runtime_env(),
                      "PREFECT_HOME": str(self.home / "prefect"), "PREFECT_API_URL": s.prefect_api_url,
                      "MLFLOW_TRACKING_URI": s.worker_env.get("MLFLOW_TRACKING_URI",
                                                              cluster.reachable(info.mlflow_url, s.server)),
                      "EVALDAG_RESULTS_URL": s.worker_env.get("EVALDAG_RESULTS_URL", info.results_url)}
        # the head's crash automation expects its period; a node that beat slower would be crashed while alive
        worker_env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(info.heartbeat_s)
        if s.api_auth:
            auth = self.client_auth_env({})
            if "MLFLOW_TRACKING_URI" in s.worker_env:  # another MLflow than the head's: its credentials stay
                auth = {"PREFECT_API_AUTH_STRING": auth["PREFECT_API_AUTH_STRING"]}
            worker_env.update(auth)
        return worker_env, passthrough

    def _tracking_env(self) -> dict[str, str]:
        """The MLflow server the head's workers log to: settings.tracking_uri (a team's own) when it names another
        than the stack's, with the auth variables of this environment, not the stack's; else the stack's."""
        own = (self.settings.tracking_uri or "").strip()
        if own and own.rstrip("/") != self.settings.mlflow_url:
            return {"MLFLOW_TRACKING_URI": own, "MLFLOW_TRACKING_USERNAME": "", "MLFLOW_TRACKING_PASSWORD": "",
                    **{k: v for k, v in os.environ.items() if k in MLFLOW_CLIENT_VARS}}
        return {"MLFLOW_TRACKING_URI": self.settings.mlflow_url}

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
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(MLFLOW_RETRIES),
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.settings.mlflow_timeout_s)}

    def _worker_spec(self, name: str, pool: str, limit: int, gpu: str | None, worker_env: dict[str, str],
                     passthrough: dict[str, str]) -> _Spec:
        s = self.settings
        # Prefect's process worker, woken by the server's events when a run of its pool is scheduled
        argv = [sys.executable, "-m", "evaldag.runtime.wake_worker", "--pool", pool, "--name", name,
                "--limit", str(limit)]
        env = dict(worker_env)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        elif pool == GPU_POOL and s.num_gpu_workers > 1 and "EVALDAG_TORCH_THREADS" not in env:
            # unpinned slots share this machine's cores: two torch processes with all cores each
            # oversubscribe them and both slow down (see the CPU notes), so each gets its share
            env["EVALDAG_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // s.num_gpu_workers))
        # the pools' flow-run command names `python`: this environment's, not the shell's (a worker started before
        # that, without the key's `python`, is replaced)
        bin_dir = str(Path(sys.executable).parent)
        key = {"argv": argv, "env": dict(env), "passthrough": passthrough, "python": bin_dir}
        env["PATH"] = os.pathsep.join(dict.fromkeys([bin_dir, *os.environ.get("PATH", os.defpath).split(os.pathsep)]))
        return _Spec(name, "worker", argv, env, paths.REPO_ROOT, pool=pool, key=key)

    @staticmethod
    def _mlflow_auth_env(mlflow_dir: Path, auth: str) -> dict[str, str]:
        """Environment of MLflow's basic-auth app with one admin user, USER:PASSWORD of `auth`.

        MLflow creates the admin from MLFLOW_AUTH_ADMIN_PASSWORD only when its user store lacks that user, and
        ignores the variable afterwards: each auth string gets a user store of its own, so a new password works
        at once (users added by hand to the old store stay in its file)."""
        user, _, password = auth.partition(":")
        digest = hashlib.sha256(auth.encode()).hexdigest()
        mlflow_dir.mkdir(parents=True, exist_ok=True)
        ini = mlflow_dir / "basic_auth.ini"
        ini.write_text("[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                       f"database_uri = sqlite:///{mlflow_dir / f'basic_auth-{digest[:12]}.db'}\n"
                       f"admin_username = {user}\n"
                       "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
        return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_USERNAME": user,
                "MLFLOW_AUTH_ADMIN_PASSWORD": password,
                # the app's CSRF protection needs a key that stays the same across restarts: derived from the
                # auth string, as secret as it is
                "MLFLOW_FLASK_SERVER_SECRET_KEY": hashlib.sha256(f"evaldag-mlflow-csrf:{auth}".encode()).hexdigest()}

    def _head_info(self) -> cluster.ClusterInfo:
        """What the head publishes (fetched once per Stack); with --mlflow-url and --results-url both given on
        the command line, a head without the block (not started by `evaldag up`) is fine too."""
        if getattr(self, "_info", None) is None:
            s = self.settings
            try:
                self._info = cluster.fetch(s.prefect_api_url, auth=s.api_auth)
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

    @property
    def postgres_dir(self) -> Path:
        """Folder of the private PostgreSQL cluster (settings.postgres_dir, else evaldag.runtime.postgres.default_dir)."""
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
        """EVALDAG_* settings for the workers (data mirror, checkpoint roots, ...): the caller's, else remembered
        (`_remember_worker_settings`). To drop a setting, set it to an empty value."""
        saved = json.loads(self.env_path.read_text()) if self.env_path.is_file() else {}
        current = {k: v for k, v in os.environ.items() if k.startswith("EVALDAG_") and k not in _STACK_ENV}
        return {k: v for k, v in {**saved, **current}.items() if v != ""}

    def _remember_worker_settings(self) -> None:
        """Keep `_worker_settings()` in <home>/stack/worker-env.json, so a later bare `evaldag up` (another shell,
        without the Makefile's exports) keeps the workers as they were instead of restarting them without the data
        mirror."""
        merged = self._worker_settings()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.env_path.write_text(json.dumps(merged, indent=2, sort_keys=True))

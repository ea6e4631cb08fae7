"""Settings of the local stack (`StackSettings`, from arguments and EVALDAG_* variables), its component names, and
the rows `Stack.status()` and `Stack.up()` report."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from evaldag import paths

from evaldag.runtime import cluster
from evaldag.errors import EvalDagError, StackError, warn_deprecated
from evaldag.request.gpus import GPU_LIMIT, assign_gpus, detect_gpu_ids, parse_gpu_ids
from evaldag.request.rules import describe_errors

PREFECT_SERVER = "prefect-server"
MLFLOW_SERVER = "mlflow-server"
POSTGRES = "postgres"
CPU_WORKER = "cpu-worker"
SERVERS = (PREFECT_SERVER, MLFLOW_SERVER)
STACK_ID_ENV = "EVALDAG_STACK_ID"
STATE_VERSION = 1

# EVALDAG_* variables that configure the stack itself; every other EVALDAG_* variable is passed to the workers and,
# when it changes, restarts them (a flow must see the data/models/results folders the user asked for).
_STACK_ENV = {
    "EVALDAG_HOME", "EVALDAG_HOST", "EVALDAG_PREFECT_PORT", "EVALDAG_MLFLOW_PORT", "EVALDAG_NUM_GPUS",
    "EVALDAG_GPU_WORKERS", "EVALDAG_GPUS", "EVALDAG_TP", "EVALDAG_WORKER_QUERY_SECONDS", "EVALDAG_REPO", STACK_ID_ENV,
    "EVALDAG_ADVERTISE_HOST", "EVALDAG_DATABASE_URL", "EVALDAG_POSTGRES", "EVALDAG_POSTGRES_PORT",
    "EVALDAG_POSTGRES_DIR", "EVALDAG_PG_BIN", "EVALDAG_HEARTBEAT_S", "EVALDAG_NODE_NAME", "EVALDAG_MLFLOW_TIMEOUT_S",
    "EVALDAG_API_AUTH",
}
_WILDCARD = ("0.0.0.0", "::", "")
MIN_AUTH_PASSWORD = 12
# The number of GPUs of the `gpu` pool had a second name, from before --tp, when it was also the number of gpu
# workers; the old names still work and say that they are deprecated.
_OLD_NUM_GPUS_KEY = "gpu_workers"                     # settings key / from_env keyword (now num_gpus)
_OLD_NUM_GPUS_ENV = "EVALDAG_GPU_WORKERS"             # environment variable (now EVALDAG_NUM_GPUS)


class StackSettings(BaseModel):
    """Where and how the local stack runs. `from_env()` reads the EVALDAG_* overrides."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home: Path = Field(default_factory=paths.home, description="State directory (EVALDAG_HOME, default ~/.evaldag).")
    host: str = Field("127.0.0.1", description="Interface both servers bind to (EVALDAG_HOST).")
    prefect_port: int = Field(4200, ge=1, le=65535, description="Prefect server port (EVALDAG_PREFECT_PORT).")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="MLflow server port (EVALDAG_MLFLOW_PORT).")
    num_gpus: int = Field(
        1, ge=0, le=64,
        description="GPUs (on a CPU box: shard slots) of the `gpu` pool; `--gpus`, EVALDAG_NUM_GPUS. Also the "
                    f"limit of the Prefect global concurrency limit {GPU_LIMIT!r}.")
    tp: int = Field(1, ge=1, le=64, description="GPUs per gpu worker (`--tp`, EVALDAG_TP): num_gpus // tp workers, "
                                                "one shard at a time each.")
    gpus: tuple[str, ...] | None = Field(
        None, description="GPU ids, tp per worker via CUDA_VISIBLE_DEVICES (EVALDAG_GPUS=0,1). "
        "None: nothing to pin (CPU box); workers inherit the caller's CUDA_VISIBLE_DEVICES.")
    cpu_worker_limit: int = Field(4, ge=1, description="Concurrent parent flow runs of the `cpu` worker.")
    worker_query_seconds: float = Field(
        10, gt=0, description="Worker poll interval (PREFECT_WORKER_QUERY_SECONDS, EVALDAG_WORKER_QUERY_SECONDS), "
                              "Prefect's default. The workers start a flow run when the server's event says it is "
                              "scheduled (evaldag.runtime.wake_worker), so the poll only covers what the event "
                              "stream misses (a restarting server, a run scheduled for later); each poll costs the "
                              "Prefect server CPU (docs/performance.md). The tests' stack polls every second.")
    mlflow_timeout_s: int = Field(
        30, ge=1, description="MLflow client request timeout of the workers' flow runs (MLFLOW_HTTP_REQUEST_TIMEOUT, "
                              "EVALDAG_MLFLOW_TIMEOUT_S; 2 retries each): a hung tracking server costs a track "
                              "attempt about 3 times this before the task's own backoff retries it. MLflow's default "
                              "(120 s, 7 retries) would hold a parent flow run for about 16 minutes per attempt.")
    start_timeout_s: float = Field(180, gt=0, description="How long a server or worker may take to become healthy.")
    stop_timeout_s: float = Field(10, gt=0, description="Grace period per signal (SIGINT, SIGTERM) before SIGKILL.")
    advertise_host: str | None = Field(
        None, description="Address worker nodes reach this head by (EVALDAG_ADVERTISE_HOST); default: `host`, or "
                          "this machine's address when `host` is 0.0.0.0.")
    heartbeat_s: int = Field(
        cluster.MIN_HEARTBEAT_S, ge=cluster.MIN_HEARTBEAT_S,
        description="Seconds between flow-run heartbeats of the workers (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, "
                    "EVALDAG_HEARTBEAT_S); a run silent for `missed_heartbeats` periods is set Crashed by the head's "
                    "automation.")
    missed_heartbeats: int = Field(
        cluster.MISSED_HEARTBEATS, ge=cluster.MIN_MISSED_HEARTBEATS,
        description="Heartbeat periods of silence after which the head's automation sets a flow run Crashed "
                    "(EVALDAG_MISSED_HEARTBEATS): 3 x 30 s = 90 s, so a lost node's shard is relaunched 60-90 s "
                    "after the loss. Fewer relaunch sooner but crash a run whose heartbeats are late (a loaded "
                    "server, a clock step: evaldag.runtime.liveness undoes such a crash). The tests use 2.")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL of the Prefect server's database (EVALDAG_DATABASE_URL), e.g. "
                          "postgresql+asyncpg://user:pw@db:5432/prefect; default: SQLite in <home>/prefect.")
    postgres: bool = Field(False, description="Run the Prefect server on a private PostgreSQL cluster that the "
                                              "stack starts (EVALDAG_POSTGRES=1, `--postgres`).")
    postgres_port: int = Field(5433, ge=1, le=65535, description="Port of that cluster on 127.0.0.1.")
    postgres_dir: Path | None = Field(None, description="Folder of that cluster (EVALDAG_POSTGRES_DIR); default "
                                                        "evaldag.runtime.postgres.default_dir(home).")
    server: str | None = Field(
        None, description="Set on a worker node: the head's Prefect URL (http://head:4200). The node runs only "
                          "gpu workers, configured from the head (evaldag.runtime.cluster) and `worker_env`.")
    node_name: str = Field(default_factory=socket.gethostname, min_length=1,
                           description="Name of a worker node (EVALDAG_NODE_NAME): prefix of its workers' names.")
    worker_env: dict[str, str] = Field(default_factory=dict, description="Variables a worker node's workers get "
                                       "over the head's (`evaldag worker --env K=V`, --mlflow-url, --results-url).")
    tracking_uri: str | None = Field(
        None, description="MLflow server the head's workers log to instead of the stack's own: a team's tracking "
        "server (`evaldag up` takes MLFLOW_TRACKING_URI from its environment); its credentials "
        "(MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN) come from the environment too.")
    api_auth: str | None = Field(
        None, repr=False, description="USER:PASSWORD both servers of a head require (`--auth`, EVALDAG_API_AUTH): "
        "Prefect's PREFECT_SERVER_API_AUTH_STRING, MLflow's basic-auth admin. Required on a head started for "
        "nodes (listening beyond loopback, or with advertise_host); a worker node gives the head's.")

    @model_validator(mode="before")
    @classmethod
    def _old_num_gpus_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and _OLD_NUM_GPUS_KEY in data:
            data = dict(data)
            old = data.pop(_OLD_NUM_GPUS_KEY)
            warn_deprecated(_OLD_NUM_GPUS_KEY, "num_gpus")
            if data.get("num_gpus") is None:
                data["num_gpus"] = old
        return data

    @model_validator(mode="after")
    def _database_choice(self) -> StackSettings:
        if self.postgres and self.database_url:
            raise ValueError("--postgres starts a private PostgreSQL cluster and --database-url names another "
                             "database; give one of them")
        url = self.database_url
        if url and not url.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            # Neither the URL nor its password goes in the message: a password may hold / ? # (SQLAlchemy takes
            # them) and the URL may lack a scheme, which no pattern that masks userinfo catches. Its scheme and,
            # for a PostgreSQL URL, what follows its last @ (the host and database: a host has no @) say enough.
            scheme = url.split("://", 1)[0] + "://" if "://" in url else "no scheme"
            hint = ("postgresql+asyncpg://USER:PASSWORD@" + url.rsplit("@", 1)[-1].split("://", 1)[-1]
                    if url.startswith(("postgres://", "postgresql://")) else None)
            raise ValueError(f"database_url ({scheme}...) is not one the Prefect server can use: it needs "
                             "postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB (or sqlite+aiosqlite:///PATH)"
                             + (f"; did you mean {hint}?" if hint else ""))
        return self

    @field_validator("api_auth")
    @classmethod
    def _auth_form(cls, value: str | None) -> str | None:
        if not value:
            return None
        user, sep, password = value.partition(":")
        # MLflow's basic-auth app refuses an admin password under 12 characters (mlflow.utils.validation)
        if not sep or not user or len(password) < MIN_AUTH_PASSWORD:
            raise ValueError(f"the API auth (--auth, EVALDAG_API_AUTH) must be USER:PASSWORD with a password of at "
                             f"least {MIN_AUTH_PASSWORD} characters, e.g. evaldag:$(openssl rand -hex 16)")
        return value

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
    def num_gpu_workers(self) -> int:
        """Workers on the `gpu` pool: one per `tp` GPUs."""
        return self.num_gpus // self.tp

    @property
    def gpu_assignment(self) -> list[tuple[str, ...] | None]:
        """CUDA_VISIBLE_DEVICES ids of each gpu worker (None: not pinned); see evaldag.request.gpus.assign_gpus."""
        return assign_gpus(self.num_gpus, self.tp, self.gpus)

    @classmethod
    def from_env(cls, **overrides: Any) -> StackSettings:
        """Settings from EVALDAG_* variables; keyword overrides (e.g. from CLI options, None = unset) win.

        When the number of GPUs is asked for (`--gpus`/EVALDAG_NUM_GPUS) without naming them (EVALDAG_GPUS),
        the workers are pinned to the GPUs this machine shows (the caller's CUDA_VISIBLE_DEVICES, else
        `nvidia-smi -L`), the first tp to the first worker and so on; on a machine without GPUs nothing is pinned
        and each worker is just a slot. Without either, one unpinned worker, as before.
        """
        if overrides.get(_OLD_NUM_GPUS_KEY) is not None:
            warn_deprecated(_OLD_NUM_GPUS_KEY, "num_gpus")
            if overrides.get("num_gpus") is None:
                overrides["num_gpus"] = overrides[_OLD_NUM_GPUS_KEY]
        overrides.pop(_OLD_NUM_GPUS_KEY, None)
        values = _env_values(os.environ)
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
        except ValidationError as e:
            # pydantic's own text quotes the input (the --auth password, a database URL's): describe_errors without it
            raise StackError(f"invalid stack settings: {describe_errors(e.errors(), show_input=False)}") from None
        except ValueError as e:
            raise StackError(f"invalid stack settings: {e}") from None

    @property
    def loopback_only(self) -> bool:
        """Whether the servers listen on a loopback address only (nobody on another host reaches them)."""
        return _is_loopback(self.host)

    @property
    def for_nodes(self) -> bool:
        """Whether this head is started for worker nodes: it listens beyond loopback, or advertises an address (a
        proxy or tunnel in front of it). Only such a head publishes the cluster block."""
        return not self.loopback_only or bool(self.advertise_host)

    def check_exposure(self) -> None:
        """Refuse a head started for worker nodes (`for_nodes`: it listens beyond loopback, or advertises an address
        a proxy or tunnel forwards) that has no API auth: it publishes the cluster block, which the Prefect API hands
        with its credentials to whoever asks, and anyone who reaches the API could create a deployment whose pull
        step runs commands on the workers; MLflow would be open too. Behind a tunnel to a loopback head, whoever
        reaches the tunnel (and every local user) is such a client. Runs before anything starts."""
        if self.server is not None or not self.for_nodes or self.api_auth:
            return
        where = (f"would listen on {self.host!r}, reachable from other hosts," if not self.loopback_only else
                 f"listen on {self.host!r} but are advertised to worker nodes as {self.advertise_host!r} (a proxy or "
                 "tunnel forwards to them), so they publish the cluster block,")
        raise StackError(
            f"the Prefect and MLflow servers {where} without authentication: anyone who reaches them could read the "
            "result store's, MLflow's and the hub's credentials and run commands on the workers. Give both servers "
            "a password with `evaldag up --auth USER:PASSWORD` (or EVALDAG_API_AUTH) and the same to each node's "
            "`evaldag worker --auth`, or, for a stack without nodes, listen on 127.0.0.1 without --advertise-host")

    @property
    def local_host(self) -> str:
        """The address clients on this machine use: `host`, or 127.0.0.1 when the servers listen everywhere."""
        return "127.0.0.1" if self.host in _WILDCARD else self.host

    @property
    def public_host(self) -> str:
        """The address other hosts use (advertise_host, else evaldag.runtime.cluster.public_host(host))."""
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


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings the EVALDAG_* variables of `env` give (unset or empty ones give nothing)."""
    values: dict[str, Any] = {}
    if env.get(_OLD_NUM_GPUS_ENV):
        warn_deprecated(_OLD_NUM_GPUS_ENV, "EVALDAG_NUM_GPUS")
        values["num_gpus"] = env[_OLD_NUM_GPUS_ENV]       # EVALDAG_NUM_GPUS, when set too, wins below
    for key, var in (("host", "EVALDAG_HOST"), ("prefect_port", "EVALDAG_PREFECT_PORT"),
                     ("mlflow_port", "EVALDAG_MLFLOW_PORT"), ("num_gpus", "EVALDAG_NUM_GPUS"),
                     ("tp", "EVALDAG_TP"), ("worker_query_seconds", "EVALDAG_WORKER_QUERY_SECONDS"),
                     ("advertise_host", "EVALDAG_ADVERTISE_HOST"), ("heartbeat_s", "EVALDAG_HEARTBEAT_S"),
                     ("missed_heartbeats", "EVALDAG_MISSED_HEARTBEATS"),
                     ("database_url", "EVALDAG_DATABASE_URL"), ("postgres_port", "EVALDAG_POSTGRES_PORT"),
                     ("postgres_dir", "EVALDAG_POSTGRES_DIR"), ("node_name", "EVALDAG_NODE_NAME"),
                     ("api_auth", "EVALDAG_API_AUTH"), ("mlflow_timeout_s", "EVALDAG_MLFLOW_TIMEOUT_S")):
        if env.get(var):
            values[key] = env[var]
    if env.get("EVALDAG_POSTGRES", "").strip().lower() in ("1", "true", "yes", "on"):
        values["postgres"] = True
    if env.get("EVALDAG_GPUS"):
        values["gpus"] = parse_gpu_ids(env["EVALDAG_GPUS"])
        values.setdefault("num_gpus", len(values["gpus"]))
    return values


def _is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or `localhost` (a wildcard, another address or a name is not)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _detected_gpus(num_gpus: int) -> tuple[str, ...] | None:
    """The first `num_gpus` GPU ids of this machine (evaldag.request.gpus.detect_gpu_ids), None on a machine without GPUs."""
    ids = detect_gpu_ids()
    if ids is None:
        return None
    if len(ids) < num_gpus:
        raise StackError(f"--gpus {num_gpus} asks for more GPUs than this machine shows: {len(ids)} "
                         f"({','.join(ids)}); use --gpus {len(ids)} or name the GPUs with EVALDAG_GPUS")
    return ids[:num_gpus]

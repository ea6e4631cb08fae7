"""A stack over several hosts: what a worker node takes from the head, and the guard against lost nodes.

The head (`evaldag up`) publishes, in a Prefect Secret block `evaldag-cluster`, everything a worker node needs beyond
the Prefect API it is pointed at: the MLflow URL, the result store URL and the credentials and settings its workers
must share (`AWS_*` for an S3 store, `MLFLOW_TRACKING_*`, the `EVALDAG_*` settings the head's workers run with).
A node (`evaldag worker --server http://head:4200`) reads it; options given on the node's command line win.
The Prefect API hands that block to any client that asks: protect the API (a reverse proxy, or
`PREFECT_SERVER_API_AUTH_STRING`) on a network others can reach, or give nodes their credentials on the command line.

Lost nodes: a flow run whose process dies together with its worker (node lost, kill -9 of both) stays Running
forever, because nothing is left to report it. Every flow run of evaldag's workers sends a heartbeat event every
`heartbeat_s` seconds (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, minimum 30), and the head's server gets a proactive
automation (`crash_automation`) that sets a run Crashed when `missed_heartbeats * heartbeat_s` seconds (3 x 30 s by
default) pass after a heartbeat, or after the run went Running (a run lost before its first heartbeat reached the
server), without another heartbeat or a final state. The parent's launch task then relaunches the shard on a live worker.
Only flow runs tagged `evaldag` are watched: a flow run of anything else on the same server, with Prefect's default
180 s heartbeat, must never be crashed by a 90 s window. The window is judged on the head's wall clock: after a clock
step, a pause of the head or a partition, runs that still live can be crashed too; evaldag.runtime.liveness undoes that
(an evaluation sets itself Running again, a shard stops and is relaunched).
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import Mapping
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

from evaldag.errors import StackError

log = logging.getLogger(__name__)

CLUSTER_BLOCK = "evaldag-cluster"
CRASH_AUTOMATION = "evaldag-crash-lost-flow-runs"
WATCHED_TAG = "evaldag"
MIN_HEARTBEAT_S = 30  # Prefect's minimum for PREFECT_FLOWS_HEARTBEAT_FREQUENCY
MISSED_HEARTBEATS = 3  # a run is lost after this many heartbeat periods of silence (StackSettings.missed_heartbeats)
MIN_MISSED_HEARTBEATS = 2  # with 1, a single late heartbeat would crash a live run

# The only variables a node takes from the head's block, and so the only ones the head publishes, by exact name: the
# workers' EVALDAG_* tuning and data folders, and the result store's, MLflow's and the model hub's credentials.
# Whoever can write the block (anyone with access to the Prefect API) must neither change what code a node's workers
# load or run (LD_PRELOAD, PYTHONPATH, PATH, a configs folder whose model configs turn on trust_remote_code) nor
# where their requests and secrets go: no variable that names an endpoint or URI (AWS_ENDPOINT_URL_S3,
# AWS_CONTAINER_CREDENTIALS_FULL_URI, a connection string's BlobEndpoint, MLFLOW_TRACKING_URI: ClusterInfo carries
# the MLflow and result store URLs), a file to read (AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE, AWS_CONFIG_FILE,
# EVALDAG_FAULTS_FILE), a proxy (HTTPS_PROXY, or NO_PROXY around the node's own) or a CA (AWS_CA_BUNDLE,
# SSL_CERT_FILE, SSL_CERT_DIR, REQUESTS_CA_BUNDLE: a CA lets a proxy pass as any server). Everything else is
# dropped on the node with a warning naming it; a node that needs one (a MinIO endpoint, its own proxy) gets it on
# its own command line, `evaldag worker --env KEY=VALUE`.
NODE_ENV_ALLOWED = frozenset({
    # the workers' settings; folders are read as data and must be the same path on every host
    "EVALDAG_DATA_DIR", "EVALDAG_MODELS_DIR", "EVALDAG_CHECKPOINT_ROOTS", "EVALDAG_CHECKPOINT_MARKER",
    "EVALDAG_DEFAULT_ENGINE", "EVALDAG_DEFAULT_DTYPE", "EVALDAG_CHUNK_S", "EVALDAG_CHUNK_REQUESTS",
    "EVALDAG_PROGRESS_EVERY_S", "EVALDAG_DECIDE_POLL_S", "EVALDAG_DECIDE_IN_FLIGHT", "EVALDAG_TRACK_LEASE_S",
    "EVALDAG_VERDICT_MARGIN", "EVALDAG_VERDICT_ALPHA", "EVALDAG_MAX_CLOCK_SKEW_S",
    # credentials (and the region, which only picks among AWS's own endpoints)
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CLIENT_ID", "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_TENANT_ID",
    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN",
    "GOOGLE_CLOUD_PROJECT"})
_LOOPBACK = {"0.0.0.0", "::", "", "127.0.0.1", "localhost", "::1"}


class ClusterInfo(BaseModel):
    """What the head publishes for its worker nodes (the Secret block `evaldag-cluster`)."""

    model_config = ConfigDict(extra="ignore")

    prefect_url: str = Field(description="The head's Prefect server as other hosts reach it (no /api).")
    mlflow_url: str = Field(description="The head's MLflow server as other hosts reach it.")
    results_url: str = Field(description="The result store every worker must share (EVALDAG_RESULTS_URL).")
    heartbeat_s: int = Field(MIN_HEARTBEAT_S, ge=MIN_HEARTBEAT_S,
                             description="Flow-run heartbeat period the head's crash automation expects.")
    env: dict[str, str] = Field(default_factory=dict, description="Settings and credentials for the workers.")
    head: str = Field("", description="Host name of the head, for messages.")


def allowed_from_head(key: str) -> bool:
    """Whether a node takes variable `key` from the head: it is one of NODE_ENV_ALLOWED, by exact name."""
    return key in NODE_ENV_ALLOWED


def accepted_env(head_env: Mapping[str, str]) -> dict[str, str]:
    """The variables of the head's block that a node applies (`allowed_from_head`); each one dropped is logged
    as a warning, by name only (its value may be a secret)."""
    dropped = sorted(k for k in head_env if not allowed_from_head(k))
    if dropped:
        log.warning("ignoring variables the head published that a node never takes from it: %s (a node takes "
                    "only the settings and credentials evaldag.runtime.cluster.NODE_ENV_ALLOWED names, never an "
                    "endpoint, URI, file, proxy or CA; give anything else with `evaldag worker --env KEY=VALUE`)",
                    ", ".join(dropped))
    return {k: v for k, v in head_env.items() if allowed_from_head(k)}


def shared_env(worker_env: Mapping[str, str], caller_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the head's worker environment that nodes get: the EVALDAG_* settings and, from the caller's
    environment, the credentials that nodes accept (`allowed_from_head`); the MLflow and result store URLs are
    published apart (ClusterInfo)."""
    env = {k: v for k, v in worker_env.items() if k.startswith("EVALDAG_") and allowed_from_head(k)}
    env.update({k: v for k, v in caller_env.items() if allowed_from_head(k) and not k.startswith("EVALDAG_")})
    return env


def publish(api_url: str, info: ClusterInfo) -> None:
    """Save `info` as the Secret block CLUSTER_BLOCK on the Prefect server at `api_url` (overwriting it).

    Only for a head started for worker nodes, behind API auth: whoever reads the Prefect API reads the block."""
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        Secret(value=info.model_dump(mode="json")).save(CLUSTER_BLOCK, overwrite=True, _sync=True)


def unpublish(api_url: str) -> bool:
    """Delete the block CLUSTER_BLOCK from the Prefect server at `api_url`, if an earlier head left it there (a
    stack with no nodes publishes no credentials); returns whether there was one."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        try:
            doc = client.read_block_document_by_name(CLUSTER_BLOCK, block_type_slug="secret")
        except ObjectNotFound:
            return False
        client.delete_block_document(doc.id)
        return True


def fetch(api_url: str, auth: str | None = None) -> ClusterInfo:
    """Read the head's ClusterInfo from its Prefect server, with the head's API auth USER:PASSWORD (`auth`, when
    it has one); a clear error when the head is unreachable, refuses the auth, or has no block."""
    import httpx
    from prefect.blocks.system import Secret
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    try:
        r = httpx.get(f"{api_url}/health", timeout=10)
        ok = r.status_code == 200
    except httpx.HTTPError as e:
        ok, r = False, e
    if not ok:
        raise StackError(f"cannot reach the head's Prefect API at {api_url} ({r}); is `evaldag up --host 0.0.0.0` "
                         "running there, and can this host reach that address and port?")
    with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}):
        try:
            value = Secret.load(CLUSTER_BLOCK, _sync=True).get()
        except PrefectHTTPStatusError as e:
            if e.response.status_code != 401:
                raise
            raise StackError(f"the head's Prefect API at {api_url} refused {'the' if auth else 'a request without'} "
                             "auth (HTTP 401): give the USER:PASSWORD the head was started with (`evaldag up --auth`) "
                             "as `evaldag worker --auth USER:PASSWORD` or EVALDAG_API_AUTH") from None
        except (ValueError, ObjectNotFound):
            raise StackError(f"the Prefect server at {api_url} has no block {CLUSTER_BLOCK!r}: it was not started "
                             "with `evaldag up` (or an older evaldag). Run `evaldag up` on the head, or give "
                             "--mlflow-url and --results-url on this command line") from None
    return ClusterInfo.model_validate(value)


def reachable(url: str, server_url: str) -> str:
    """`url` as this host reaches it: a wildcard or loopback host (a head that published its own local address)
    is replaced by the host of `server_url`, the address this node already reaches the head by."""
    parts, server = urlsplit(url), urlsplit(server_url)
    if parts.hostname in _LOOPBACK and server.hostname not in _LOOPBACK:
        netloc = server.hostname + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def server_url(text: str) -> str:
    """The head's Prefect URL without a trailing `/api`; an error naming the expected form for anything else."""
    url = text.strip().rstrip("/")
    url = url[: -len("/api")] if url.endswith("/api") else url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StackError(f"--server {text!r} is not a URL of a Prefect server; give it as http://HEAD:4200")
    return url


def public_host(bind_host: str) -> str:
    """The address other hosts reach a server bound to `bind_host` by: the host itself when it is a real address,
    else this machine's address on its default route (or its host name's)."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # a documentation address: nothing is sent, the kernel picks the route
            return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def crash_automation(heartbeat_s: int, missed_heartbeats: int = MISSED_HEARTBEATS):
    """The proactive automation that crashes a watched flow run `missed_heartbeats * heartbeat_s` seconds after its
    last heartbeat (or its Running state, when no heartbeat came), unless a final state came first (Prefect's documented zombie-flow pattern, limited to
    flow runs tagged WATCHED_TAG)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    within = missed_heartbeats * heartbeat_s
    final = [f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")]
    return AutomationCore(
        name=CRASH_AUTOMATION,
        description=f"evaldag: a flow run tagged {WATCHED_TAG!r} that sent no heartbeat for {within} s (its process "
                    "and worker are gone, e.g. a lost node) is set Crashed, so its parent relaunches it. Workers "
                    f"send heartbeats every {heartbeat_s} s (PREFECT_FLOWS_HEARTBEAT_FREQUENCY).",
        trigger=EventTrigger(
            posture=Posture.Proactive,
            # Running too: a run lost before its first heartbeat event reaches the server (buffered in the client,
            # then SIGKILL) has sent nothing else, and would stay Running forever
            after={"prefect.flow-run.heartbeat", "prefect.flow-run.Running"},
            expect={"prefect.flow-run.heartbeat", *final},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification({"prefect.resource.role": "tag",
                                                 "prefect.resource.id": f"prefect.tag.{WATCHED_TAG}"}),
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=within),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED, name="Crashed",
            message=f"no heartbeat for {within} s: the flow run's process and its worker were lost (evaldag "
                    f"automation {CRASH_AUTOMATION!r})")],
    )


def ensure_crash_automation(api_url: str, heartbeat_s: int, missed_heartbeats: int = MISSED_HEARTBEATS) -> str:
    """Create or update the crash automation on the server at `api_url`, exactly one by its name. Idempotent;
    returns what it did: "created", "updated" or "kept"."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    want = crash_automation(heartbeat_s, missed_heartbeats)
    body = want.model_dump(mode="json")
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(CRASH_AUTOMATION)
        for extra in existing[1:]:  # two `up`s that raced: keep one
            client.delete_automation(extra.id)
        if not existing:
            client.create_automation(want)
            return "created"
        have = existing[0].model_dump(mode="json")
        if all(_canonical(have.get(k)) == _canonical(v) for k, v in body.items()):
            return "kept"
        client.update_automation(existing[0].id, want)
        return "updated"


def _canonical(value):
    """A JSON value with its lists of strings sorted: sets (after, expect, for_each) come back in any order."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_canonical(v) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    return value


__all__ = ["CLUSTER_BLOCK", "CRASH_AUTOMATION", "ClusterInfo", "MIN_HEARTBEAT_S", "MIN_MISSED_HEARTBEATS", "MISSED_HEARTBEATS",
           "NODE_ENV_ALLOWED", "WATCHED_TAG", "accepted_env", "allowed_from_head",
           "crash_automation", "ensure_crash_automation", "fetch", "public_host", "publish",
           "reachable", "server_url", "shared_env", "unpublish"]

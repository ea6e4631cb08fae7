"""`evaldag deploy`: register evaldag on a team's own Prefect server, the one PREFECT_API_URL names.

What it registers is what `evaldag up` registers on the stack's server (evaldag.runtime.stack.prefect_setup): the
`cpu` and `gpu` process pools, the `evaldag-gpus` concurrency limit, the crash automation for lost runs, and the
deployments of deployments/prefect.yaml through `prefect deploy`. The Prefect client authenticates as Prefect's own
CLI does (PREFECT_API_KEY or PREFECT_API_AUTH_STRING). Nothing is written to the embedded stack's state folder, and
the server's default result storage is left alone (on a shared server it is everybody's). docs/own-servers.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx

from evaldag.client.delivery import auth_headers, check_api_url
from evaldag.errors import StackError, redact_url
from evaldag.runtime import cluster
from evaldag.runtime.stack.prefect_setup import deploy_manifest, register
from evaldag.runtime.stack.processes import _repo


@dataclass(frozen=True)
class Deployed:
    """What `deploy` registered, for the command's report."""

    api_url: str
    num_gpus: int
    repo: str


def api_url_from_env() -> str:
    """PREFECT_API_URL of this environment, checked; a clear error when it is missing or not an http(s) URL."""
    try:
        url = check_api_url(os.environ.get("PREFECT_API_URL"))
    except ValueError as e:
        raise StackError(f"PREFECT_API_URL: {e}") from None
    if url is None:
        raise StackError("`evaldag deploy` registers evaldag on the Prefect server PREFECT_API_URL names, and it is "
                         "not set: export PREFECT_API_URL=http://HOST:4200/api (and PREFECT_API_AUTH_STRING or "
                         "PREFECT_API_KEY if it needs them); for the local stack, `evaldag up` deploys")
    return url


def deploy(num_gpus: int = 1, heartbeat_s: int = cluster.MIN_HEARTBEAT_S,
           missed_heartbeats: int = cluster.MISSED_HEARTBEATS) -> Deployed:
    """Register the pools, the gpu limit (`num_gpus` slots, 0 = unlimited), the crash automation and the
    deployments on the server of PREFECT_API_URL. Idempotent: run it again after pulling a new evaldag.

    `heartbeat_s` must be the PREFECT_FLOWS_HEARTBEAT_FREQUENCY the workers run with (`evaldag worker` sets it);
    a run silent for `missed_heartbeats` periods is set Crashed and relaunched by its parent."""
    api_url = api_url_from_env()
    repo = _repo()
    try:
        register(api_url, auth_headers(), num_gpus, heartbeat_s, missed_heartbeats)
    except httpx.HTTPError as e:
        raise StackError(f"cannot reach the Prefect server at {redact_url(api_url)}: {e}") from None
    # the manifest's pull step starts flow runs in {{ $EVALDAG_REPO }}: this checkout unless the caller names the
    # one the workers share
    deploy_manifest({**os.environ, "EVALDAG_REPO": repo})
    return Deployed(api_url, num_gpus, repo)


__all__ = ["Deployed", "api_url_from_env", "deploy"]

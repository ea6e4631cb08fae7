"""`evaldag worker`: join this machine to a head as a GPU node, or run one worker attached (a cluster job)."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from evaldag.errors import redact_url
from evaldag.runtime.node_clock import MAX_CLOCK_SKEW_ENV, MAX_CLOCK_SKEW_S


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--env")
        env[key.strip()] = value
    return env


def worker(
    server: Annotated[Optional[str], typer.Option(
        "--server", help="The head's Prefect server, e.g. http://head:4200 (started there with `evaldag up --host "
        "0.0.0.0`); with --foreground, default the PREFECT_API_URL of the environment.", show_default=False)] = None,
    foreground: Annotated[bool, typer.Option(
        "--foreground", help="Run one worker in this process, attached, until it is stopped (SIGTERM or SIGINT: "
        "as `prefect worker start`, it kills its runs' processes and exits 0; the lost-run automation sets those "
        "runs Crashed and their evaluations start them again): for an sbatch job, a Kubernetes pod or a "
        "systemd unit. It uses the GPUs this process sees (CUDA_VISIBLE_DEVICES); nothing is recorded for "
        "`evaldag down`.")] = False,
    pool: Annotated[str, typer.Option(
        "--pool", help="The work pool of the --foreground worker: gpu (shards) or cpu (parent flows).")] = "gpu",
    gpus: Annotated[Optional[int], typer.Option(
        "--gpus", min=1, help="GPUs of this node for the `gpu` pool: --gpus/--tp workers, each pinned to --tp GPUs "
        "(EVALDAG_GPUS, else the GPUs this node shows); on a node without GPUs, shard slots (default 1).",
        show_default=False)] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, help="GPUs per gpu worker (default 1).",
                                              show_default=False)] = None,
    name: Annotated[Optional[str], typer.Option(
        "--name", help="Node name, the prefix of its workers' names (env EVALDAG_NODE_NAME; default the host "
        "name); must be unique among the nodes of the head.", show_default=False)] = None,
    mlflow_url: Annotated[Optional[str], typer.Option(
        "--mlflow-url", help="MLflow server for this node's workers (default: the one the head publishes).",
        show_default=False)] = None,
    results_url: Annotated[Optional[str], typer.Option(
        "--results-url", help="Result store for this node's workers (default: the head's; it must be the same "
        "store, e.g. s3://bucket/prefix).", show_default=False)] = None,
    env: Annotated[Optional[list[str]], typer.Option(
        "--env", help="KEY=VALUE for this node's workers, over what the head publishes (credentials, paths); "
        "repeatable.", show_default=False)] = None,
    max_clock_skew_s: Annotated[float, typer.Option(
        "--max-clock-skew-s", min=0, envvar=MAX_CLOCK_SKEW_ENV,
        help="Refuse to join when this host's clock is further than this from the head's (its live runs would be "
        "crashed as lost); 0 skips the check.")] = MAX_CLOCK_SKEW_S,
    auth: Annotated[Optional[str], typer.Option(
        "--auth", help="USER:PASSWORD the head was started with (`evaldag up --auth`); env EVALDAG_API_AUTH.",
        show_default=False)] = None,
) -> None:
    """Join this machine to a head as a GPU node: start its `gpu` pool workers, pinned to its GPUs, pointed at the
    head's Prefect API, MLflow and result store (published by the head's `evaldag up`). State lives in this node's
    EVALDAG_HOME; `evaldag down` stops them. With --foreground, run one worker of --pool in this process instead
    (docs/slurm.md)."""
    from rich.console import Console

    from evaldag.runtime.cluster import server_url
    from evaldag.runtime.deployments import CPU_POOL, GPU_POOL
    from evaldag.runtime.node_clock import check_clock
    from evaldag.runtime.stack import Stack, StackSettings
    from evaldag.runtime.stack_report import print_joined

    if pool not in (CPU_POOL, GPU_POOL):
        raise typer.BadParameter(f"{pool!r} is not one of evaldag's pools: {GPU_POOL} or {CPU_POOL}",
                                 param_hint="--pool")
    overrides = _env_pairs(env or [])
    if foreground and server is None:
        # a team's own servers (no evaldag head, no published settings): the environment names them
        server = os.environ.get("PREFECT_API_URL")
        overrides = {k: os.environ[k] for k in ("MLFLOW_TRACKING_URI", "EVALDAG_RESULTS_URL") if os.environ.get(k)
                     } | overrides
    if server is None:
        raise typer.BadParameter("give the head's Prefect server, e.g. --server http://head:4200 (with "
                                 "--foreground, PREFECT_API_URL in the environment will do)", param_hint="--server")
    if not foreground and pool != GPU_POOL:
        raise typer.BadParameter("a node runs gpu workers; a cpu worker runs with --foreground", param_hint="--pool")
    if foreground and (gpus is not None or tp is not None):
        raise typer.BadParameter("--foreground runs one worker on the GPUs this process sees (CUDA_VISIBLE_DEVICES); "
                                 "for several, run one process per GPU slot (srun --ntasks=N --gpus-per-task=K)",
                                 param_hint="--gpus/--tp")
    # before anything starts: a node whose clock lags the head's has every live shard crashed as lost
    check_clock(server_url(server) + "/api", max_clock_skew_s)
    if mlflow_url:
        overrides["MLFLOW_TRACKING_URI"] = mlflow_url
    if results_url:
        overrides["EVALDAG_RESULTS_URL"] = results_url
    if foreground:
        from evaldag.runtime.stack.processes import exec_foreground

        stack = Stack(StackSettings.from_env(server=server, node_name=name, worker_env=overrides, api_auth=auth))
        # unique per process, as Prefect's own default worker names are: two jobs on one node never share a name
        spec = stack.foreground_worker(pool, name or f"{stack.settings.node_name}-{pool}-{os.getpid()}")
        where = {k: redact_url(spec.env[k]) for k in ("MLFLOW_TRACKING_URI", "EVALDAG_RESULTS_URL")}
        typer.echo(f"evaldag worker {spec.name!r} of pool {pool!r} on {stack.settings.server} (MLflow "
                   f"{where['MLFLOW_TRACKING_URI']}, results {where['EVALDAG_RESULTS_URL']}, EVALDAG_HOME "
                   f"{stack.home}); stops on SIGTERM or SIGINT", err=True)
        exec_foreground(spec)
    console = Console(highlight=False)
    stack = Stack(StackSettings.from_env(server=server, num_gpus=gpus, tp=tp, node_name=name,
                                         worker_env=overrides, api_auth=auth))
    with console.status(f"joining {stack.settings.server} from {stack.home} ..."):
        report = stack.up(deploy=False)
    print_joined(console, stack, report)

"""`evaldag select JOB BENCHMARK`: the best checkpoint of a training job, with a guarantee (the eval-select flow,
flows/select_flow.py, run on the stack as `evaldag run` runs eval), followed and printed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from evaldag.errors import EvalDagError


def select(  # noqa: PLR0913 - one typer option per parameter
    job: Annotated[str, typer.Argument(help="training job (its evaluations' train_run; its folder's name under "
                                       "EVALDAG_CHECKPOINT_ROOTS)")],
    benchmark: Annotated[str, typer.Argument(help="benchmark config name (math500, gsm8k, ...)")] = "math500",
    checkpoint: Annotated[Optional[list[str]], typer.Option(help="a checkpoint folder to compare (repeat it; its "
                                                            "step is read from its name); default: every "
                                                            "checkpoint the job is known by")] = None,
    steps: Annotated[Optional[str], typer.Option(help="only the job's checkpoints at steps A:B (inclusive; `A:` "
                                                 "or `:B` leave an end open)")] = None,
    alpha: Annotated[float, typer.Option(min=0.0001, max=0.5, help="error rate: the truly best checkpoint is in "
                                         "the returned set with probability at least 1 - alpha")] = 0.05,
    margin: Annotated[float, typer.Option(min=0, max=0.99, help="accuracy difference within which checkpoints "
                                          "are `equivalent` (0.02 = 2 points)")] = 0.02,
    rounds: Annotated[Optional[int], typer.Option(
        min=1, max=1000, help="planned looks at N equal steps of the problems (fewer rounds of shard launches, more "
        "tokens); default: select's own looks, every 50th of the problems up to a fifth of them, then every 20th")
    ] = None,
    limit: Annotated[Optional[int], typer.Option(help="only the first N problems")] = None,
    n: Annotated[Optional[int], typer.Option("--n", "-n", min=1, max=1024, help="samples per problem (with "
                                             "--temperature above 0)")] = None,
    temperature: Annotated[Optional[float], typer.Option(min=0, max=5, help="sampling temperature")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(min=1, max=131072, help="token cap per answer")] = None,
    seed: Annotated[Optional[int], typer.Option(min=0, help="sampling seed (also the shared problem order's)")]
    = None,
    num_shards: Annotated[Optional[int], typer.Option(help="shard flow runs per checkpoint")] = None,
    engine: Annotated[Optional[str], typer.Option(help="inference engine: vllm, hf or openai (default: the "
                                                  "model's)")] = None,
) -> None:
    """Find JOB's best checkpoint on BENCHMARK, or the set within --margin of the best when they cannot be told
    apart (with probability at least 1 - alpha the truly best is in it), evaluating each surviving checkpoint on
    the next slice of one shared problem order and dropping those shown worse (docs/select.md). Rows already
    generated count; the result goes to the job's MLflow parent run and the flow run's artifacts."""
    from evaldag.runtime import runner
    from evaldag.runtime.deployments import SELECT_DEPLOYMENT
    from evaldag.runtime.stack import Stack

    if engine is not None and engine not in ("vllm", "hf", "openai"):
        raise typer.BadParameter(f"--engine {engine!r}: use vllm, hf or openai")
    from evaldag.tracking.selection import parse_steps

    [benchmark] = runner.benchmark_names(benchmark, typer.BadParameter)   # a config file: its absolute path
    try:
        parse_steps(steps)              # refused here, before anything starts
    except EvalDagError as e:
        raise typer.BadParameter(str(e)) from None
    sampling = {k: v for k, v in dict(n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                      seed=seed).items() if v is not None} or None
    folders = [str(Path(c).expanduser().resolve()) if Path(c).expanduser().exists() else c
               for c in checkpoint or []] or None
    params = {k: v for k, v in dict(train_run=job, benchmark=benchmark, checkpoints=folders, steps=steps,
                                    alpha=alpha, margin=margin, rounds=rounds, limit=limit, num_shards=num_shards,
                                    sampling=sampling, engine=engine).items() if v is not None}
    servers = runner.point_clients_at_stack(Stack())
    summary, url = _run(SELECT_DEPLOYMENT, params)
    show(summary, url, servers.mlflow_url)


def _run(deployment: str, params: dict) -> tuple[dict, str]:
    """Start the deployment, follow it to its end, and return its result (the selection) and its UI link."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from rich.console import Console

    from evaldag.runtime import liveness, prefect_results
    from evaldag.runtime.run_events import state_changes

    console = Console(highlight=False, soft_wrap=True)
    try:
        fr = run_deployment(deployment, parameters=params, timeout=0)
    except Exception as e:  # prefect raises ObjectNotFound for a deployment that is not there
        raise EvalDagError(f"cannot start {deployment}: {e}. Run `evaldag up` (or `evaldag deploy` on your own "
                           "servers) to deploy it") from None
    from prefect.settings import get_current_settings

    ui = (get_current_settings().ui_url or "").rstrip("/")
    url = f"{ui}/runs/flow-run/{fr.id}"
    console.print(f"started {deployment} as flow run [bold]{fr.name}[/] ({url})")
    t0 = time.monotonic()
    with get_client(sync_client=True) as client, state_changes(fr.id) as changed, console.status("") as status:
        while True:
            changed.clear()
            fr = client.read_flow_run(fr.id)
            status.update(f"{fr.state.name if fr.state else 'Pending'}, {time.monotonic() - t0:.0f} s")
            if fr.state and fr.state.is_final():
                run_id = fr.id
                fr = liveness.settled(lambda: client.read_flow_run(run_id))
                if fr.state.is_final():
                    break
            changed.wait(2)
    if not fr.state.is_completed():
        raise EvalDagError(f"{deployment} ended {fr.state.name}: {fr.state.message} (logs: {url})")
    summary = prefect_results.read_result(fr.state)
    if not isinstance(summary, dict) or "checkpoints" not in summary:
        summary = _from_mlflow(params["train_run"])
    return summary, url


def _from_mlflow(job: str) -> dict:
    """The selection as logged on the job's parent run, the latest (when the flow's result store is out of
    reach)."""
    import json

    import mlflow
    from mlflow import MlflowClient

    from evaldag.tracking.names import JOBS_EXPERIMENT
    from evaldag.tracking.selection import LATEST

    client = MlflowClient()
    exp = client.get_experiment_by_name(JOBS_EXPERIMENT)
    runs = [] if exp is None else client.search_runs([exp.experiment_id], filter_string=(
        f"tags.train_run = '{job}' and tags.kind = 'train_job'"))
    if not runs:
        raise EvalDagError(f"the selection completed, but job {job!r} has no parent run in MLflow to read it from")
    return json.loads(mlflow.artifacts.load_text(f"runs:/{runs[0].info.run_id}/{LATEST}"))


def render(summary: dict):
    """The selection as a rich table: each checkpoint's elimination round and interval."""
    from rich.table import Table

    def pts(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:+.1f}"

    table = Table(title=f"{summary['train_run']} on {summary['benchmark']}: {summary['status']}")
    for col in ("step", "in set", "problems read", "accuracy", "dropped at", "vs", "difference, points [interval]"):
        table.add_column(col, justify="left" if col in ("vs", "in set") else "right")
    for c in summary["checkpoints"]:
        dropped = ("-" if c.get("settled_at") is None else f"settled after {c['settled_at']}") \
            if c["dropped_round"] is None else f"round {c['dropped_round']} ({c['dropped_at']})"
        table.add_row(str(c["step"]), "[green]yes[/]" if c["in_set"] else "no", str(c["problems"]),
                      "-" if c["mean"] is None else f"{c['mean']:.3f}", dropped, c["vs"] or "-",
                      f"{pts(c['diff'])} [{pts(c['ci_low'])}, {pts(c['ci_high'])}]")
    return table


def show(summary: dict, url: str, mlflow_url: str) -> None:
    """Print the selection: the table, the outcome in words, the tokens, and where it is logged."""
    from mlflow import MlflowClient
    from rich.console import Console

    from evaldag.tracking.names import JOBS_EXPERIMENT, run_url
    from evaldag.tracking.selection import describe

    console = Console(highlight=False, soft_wrap=True)
    console.print(render(summary))
    if summary.get("warning"):
        console.print(f"[yellow]{summary['warning']}[/]")
    console.print(describe(summary))
    console.print(f"completed in {summary['wall_s']:.0f} s; Prefect UI: {url}")
    run_id = summary.get("mlflow_parent_run_id")
    exp = MlflowClient().get_experiment_by_name(JOBS_EXPERIMENT) if run_id else None
    if exp is not None:
        console.print(f"MLflow (the job's parent run, tags evaldag.select.{summary['benchmark']}.*): "
                      f"{run_url(mlflow_url, exp.experiment_id, run_id) or run_id}")

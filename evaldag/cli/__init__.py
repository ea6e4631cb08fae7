"""`evaldag` command line: the app and most commands here; `worker` and the `benchmarks` group in modules of their
own. Commands import their heavy modules inside the function, so `--help` stays fast.

Every `EvalDagError` raised by any command is printed as one red line (plus any detail lines of its message) and
exits with code 1, without a traceback: see `_Group.invoke`, the one place that handles it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from typer.core import TyperGroup

from evaldag.errors import EvalDagError, redact_url, warn_deprecated
from evaldag.cli.benchmarks import benchmarks_app
from evaldag.cli.selection import select
from evaldag.cli.worker import worker


class _Group(TyperGroup):
    """Runs every subcommand; turns an `EvalDagError` into a clear message and exit code 1."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except EvalDagError as e:
            _error(str(e))
            raise typer.Exit(1) from None


def _error(message: str) -> None:
    from rich.console import Console
    from rich.text import Text

    first, _, rest = message.partition("\n")
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(Text(f"error: {first}", style="bold red"))
    if rest:
        console.print(Text(rest, style="dim"))


app = typer.Typer(
    cls=_Group,
    name="evaldag",
    help="Evaluate training checkpoints on math benchmarks as Prefect DAGs, tracked in MLflow.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# ------------------------------------------------------------------------ local stack


@app.command()
def up(
    gpus: Annotated[Optional[int], typer.Option(
        "--gpus", min=0, help="GPUs of the `gpu` pool: --gpus/--tp workers, each pinned to --tp "
        "GPUs (CUDA_VISIBLE_DEVICES from EVALDAG_GPUS, else the GPUs this machine shows); on a machine without GPUs, "
        "shard slots. Also the limit of the `evaldag-gpus` concurrency limit (env EVALDAG_NUM_GPUS; default 1).",
        show_default=False)] = None,
    gpu_workers: Annotated[Optional[int], typer.Option(
        "--gpu-workers", min=0, help="Deprecated old name of --gpus.", show_default=False)] = None,
    tp: Annotated[Optional[int], typer.Option(
        "--tp", min=1, help="GPUs per gpu worker, for tensor-parallel models (vllm tensor_parallel_size); --gpus "
        "must be a multiple of it (env EVALDAG_TP; default 1).", show_default=False)] = None,
    no_deploy: Annotated[bool, typer.Option(
        "--no-deploy", help="Start the stack without running `prefect deploy` of deployments/prefect.yaml.")] = False,
    host: Annotated[Optional[str], typer.Option(
        "--host", help="Interface the Prefect and MLflow servers listen on: 0.0.0.0 (all) or an address, so that "
        "worker nodes (`evaldag worker --server`) can reach them (env EVALDAG_HOST; default 127.0.0.1).",
        show_default=False)] = None,
    advertise_host: Annotated[Optional[str], typer.Option(
        "--advertise-host", help="Address or name worker nodes reach this machine by, published to them (env "
        "EVALDAG_ADVERTISE_HOST; default: --host, or this machine's address when --host is 0.0.0.0).",
        show_default=False)] = None,
    database_url: Annotated[Optional[str], typer.Option(
        "--database-url", help="Database of the Prefect server, e.g. postgresql+asyncpg://user:pw@db:5432/prefect "
        "(env EVALDAG_DATABASE_URL; default SQLite in the state folder).", show_default=False)] = None,
    postgres: Annotated[Optional[bool], typer.Option(
        "--postgres/--sqlite", help="Run the Prefect server on a private PostgreSQL cluster the stack starts "
        "(Debian's postgresql package; env EVALDAG_POSTGRES=1, port EVALDAG_POSTGRES_PORT, default 5433).",
        show_default=False)] = None,
    heartbeat_s: Annotated[Optional[int], typer.Option(
        "--heartbeat-s", min=30, help="Seconds between flow-run heartbeats; a run silent for 3 periods (its node "
        "lost; env EVALDAG_MISSED_HEARTBEATS) is set Crashed and relaunched (env EVALDAG_HEARTBEAT_S; default 30).",
        show_default=False)] = None,
    auth: Annotated[Optional[str], typer.Option(
        "--auth", help="USER:PASSWORD (password of 12 characters or more) that the Prefect API and MLflow require; "
        "needed when --host is not a loopback address; give the same to each node's `evaldag worker --auth` (env "
        "EVALDAG_API_AUTH, which keeps it out of the shell history).", show_default=False)] = None,
) -> None:
    """Start the local stack (Prefect server, work pools and workers, MLflow server) and deploy the flows."""
    from rich.console import Console

    from evaldag.runtime.stack import Stack, StackSettings
    from evaldag.runtime.stack_report import print_up

    if gpu_workers is not None:
        warn_deprecated("--gpu-workers", "--gpus")
        gpus = gpu_workers if gpus is None else gpus
    console = Console(highlight=False)
    stack = Stack(StackSettings.from_env(num_gpus=gpus, tp=tp, host=host, advertise_host=advertise_host,
                                         database_url=database_url, postgres=postgres, heartbeat_s=heartbeat_s,
                                         api_auth=auth,
                                         # a team's MLflow set in this shell gets the evaluations (docs/own-servers.md)
                                         tracking_uri=os.environ.get("MLFLOW_TRACKING_URI")))
    with console.status(f"starting the local stack in {stack.home} ..."):
        report = stack.up(deploy=not no_deploy)
    print_up(console, stack, report)


app.command()(worker)


@app.command()
def down() -> None:
    """Stop the local stack: workers first, then the servers (their data stays in the state directory)."""
    from evaldag.runtime.stack import Stack

    stack = Stack()
    stopped = stack.down()
    if stopped:
        typer.echo(f"stopped: {', '.join(stopped)}")
    else:
        typer.echo(f"nothing running (no live stack recorded in {stack.home})")


@app.command()
def status() -> None:
    """Show the components of the local stack: pid, alive, healthy, URL."""
    from rich.console import Console
    from rich.table import Table

    from evaldag.runtime.stack import Stack

    stack = Stack()
    rows = stack.status()
    console = Console(highlight=False)
    if not rows:
        console.print(f"nothing running (no stack recorded in {stack.home}); start it with `evaldag up`")
        return
    table = Table(title=f"evaldag stack in {stack.home}")
    for col in ("component", "pid", "alive", "healthy", "url"):
        table.add_column(col)
    yes, no = "[green]yes[/]", "[red]no[/]"
    for r in rows:
        table.add_row(r.component, str(r.pid or "-"), yes if r.alive else no, yes if r.healthy else no,
                      redact_url(r.url or ""))
    console.print(table)
    if not all(r.healthy for r in rows):
        console.print("[yellow]some components are not healthy: `evaldag up` restarts dead ones; logs are in "
                      f"{stack.logs_dir}[/]")
        raise typer.Exit(1)


@app.command()
def env() -> None:
    """Print `export` lines for the stack's URLs: eval "$(evaldag env)"."""
    from evaldag.runtime.stack import Stack

    for line in Stack().env_lines():
        typer.echo(line)


@app.command()
def deploy(
    gpus: Annotated[int, typer.Option(
        "--gpus", min=0, envvar="EVALDAG_NUM_GPUS", help="GPUs of the `gpu` pool over all its workers: the slots of "
        "the `evaldag-gpus` concurrency limit (0: unlimited).")] = 1,
    heartbeat_s: Annotated[int, typer.Option(
        "--heartbeat-s", min=30, envvar="EVALDAG_HEARTBEAT_S", help="The workers' flow-run heartbeat period: a run "
        "silent for 3 periods is set Crashed and relaunched.")] = 30,
) -> None:
    """Register evaldag on your own Prefect server (PREFECT_API_URL, with PREFECT_API_AUTH_STRING or PREFECT_API_KEY):
    the cpu and gpu pools, the gpu concurrency limit, the lost-run automation, and `prefect deploy` of
    deployments/prefect.yaml. For the local stack, `evaldag up` does this (docs/own-servers.md)."""
    from evaldag.runtime.own_servers import deploy as register_all

    done = register_all(num_gpus=gpus, heartbeat_s=heartbeat_s)
    typer.echo(f"registered on {redact_url(done.api_url)}: pools cpu and gpu, concurrency limit evaldag-gpus "
               f"({done.num_gpus or 'unlimited'}), the lost-run automation and the deployments of "
               f"deployments/prefect.yaml (flow runs start in {done.repo}); start workers with `evaldag worker "
               "--foreground --pool cpu` and `--pool gpu`, or `prefect worker start --pool ...`")


# ------------------------------------------------------------------------ evaluations


@app.command("prepare-model")
def prepare_model(
    alias: Annotated[str, typer.Argument(help="model alias from configs/models, or a hub model id "
                                         "org/name[@revision]")] = "smollm2-135m-instruct",
) -> None:
    """Make a model alias ready to load (the default model is exported once from its GGUF), or download a hub
    model into huggingface_hub's cache; prints its folder."""
    from evaldag.request.checkpoint import resolve_model

    model = resolve_model(alias)
    typer.echo(f"{model.name}: {model.path} (fingerprint {model.fingerprint[:16]})")


def _check_run_options(ctx: typer.Context, benchmark: str, benchmarks: str | None, decide: bool,
                       decide_settings: bool, both_adaptive_sizes: bool) -> None:
    """Refuse `evaldag run` options that contradict each other (before anything is started)."""
    if not decide and decide_settings:
        raise typer.BadParameter("--decide-margin and --decide-alpha set how --decide decides; add --decide")
    if both_adaptive_sizes:
        raise typer.BadParameter("--adaptive-budget and --adaptive-width are two ways to size adaptive samples; "
                                 "give one")
    if benchmarks is not None and getattr(ctx.get_parameter_source("benchmark"), "name", None) == "COMMANDLINE":
        raise typer.BadParameter(f"give BENCHMARK ({benchmark}) or --benchmarks, not both")


def _check_job_settings(sampling: dict | None, engine_settings: dict | None) -> None:
    """Refuse sampling and engine settings out of their bounds before anything starts, with the models the
    evaluation validates them with (evaldag.request.config)."""
    from pydantic import ValidationError

    from evaldag.request.config import EngineSettings, SamplingOverrides
    from evaldag.request.rules import describe_errors

    for model, given in ((SamplingOverrides, sampling), (EngineSettings, engine_settings)):
        try:
            model.model_validate(given or {})
        except ValidationError as e:
            raise typer.BadParameter(describe_errors(e.errors()).replace("_", "-")) from None


@app.command()
def run(
    ctx: typer.Context,
    benchmark: Annotated[str, typer.Argument(help="benchmark: a config name (math500, aime24, ..., or one in "
                                             "$EVALDAG_CONFIGS_DIR) or a config file (./mybench.yaml)")]
    = "math500",
    checkpoint: Annotated[Optional[str], typer.Option(help="model alias, checkpoint folder, or hub model id "
                                                      "org/name[@revision] (docs/hub-models.md)")] = None,
    step: Annotated[Optional[int], typer.Option(help="training step of the checkpoint")] = None,
    limit: Annotated[Optional[int], typer.Option(help="evaluate only the first N problems")] = None,
    num_shards: Annotated[Optional[int], typer.Option(help="shard flow runs (default from the benchmark)")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(min=1, max=131072, help="override the benchmark's "
                                                          "token cap (up to the model's window)")] = None,
    n: Annotated[Optional[int], typer.Option("--n", "-n", min=1, max=1024, help="samples per problem (with "
                                             "--temperature above 0)")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="override the benchmark's nucleus sampling mass, in "
                                                   "(0, 1]")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(min=1, max=64, help="GPUs one shard's model is "
                                                                "split over (vllm; gpu workers started with "
                                                                "`evaldag up --tp` that many)")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=1, help="context window, prompt + completion, in "
                                                         "tokens (vllm; default: fitted to the work)")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="share of GPU memory vllm takes, in "
                                                                    "(0, 1] (vllm)")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="weights and compute dtype: bfloat16, float16 or float32 "
                                                 "(default: the model config's, else the deployment's)")] = None,
    train_run: Annotated[Optional[str], typer.Option(help="training job (default: the checkpoint's parent "
                                                     "folder)")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="also give a paired verdict against this evaluation: a "
                                                    "run id, checkpoint path, model name or JOB@STEP")] = None,
    final_step: Annotated[Optional[int], typer.Option(min=1, help="the training job's planned last step: its "
                                                      "parent run gets a forecast of the accuracy there")] = None,
    decide: Annotated[bool, typer.Option(help="stop generating as soon as the paired verdict against the job's "
                                         "best checkpoint so far is decided (docs/stop-early.md)")] = False,
    decide_margin: Annotated[Optional[float], typer.Option(min=0, max=0.99, help="with --decide: the accuracy "
                                                           "difference within which it is `equivalent`")] = None,
    decide_alpha: Annotated[Optional[float], typer.Option(min=0.0001, max=0.5, help="with --decide: its error "
                                                          "rate")] = None,
    temperature: Annotated[Optional[float], typer.Option(min=0, max=5, help="override the benchmark's sampling "
                                                         "temperature (adaptive samples need one above 0)")] = None,
    adaptive_budget: Annotated[Optional[int], typer.Option(min=1, help="adaptive samples: n0 samples of every "
                                                           "problem, then more where the outcome is uncertain, "
                                                           "this many samples in all (docs/stop-early.md)")]
    = None,
    adaptive_width: Annotated[Optional[float], typer.Option(min=0.001, max=0.99, help="adaptive samples until the "
                                                            "accuracy's interval is about this wide (0.05 = 5 "
                                                            "points), instead of a budget")] = None,
    benchmarks: Annotated[Optional[str], typer.Option(help="math500,aime24: one eval/suite run (one engine load "
                                                      "per gpu slot) instead of BENCHMARK")] = None,
    seed: Annotated[Optional[int], typer.Option(min=0, help="sampling seed (another seed: a fresh generation)")] = None,
    eval_loss: Annotated[Optional[bool], typer.Option(help="score the benchmark's reference solutions and log "
                                                      "eval_loss (default: the benchmark's setting; "
                                                      "docs/metrics.md)")] = None,
) -> None:
    """Run `eval/<benchmark>` (eval/suite for --benchmarks) on the local stack, or on your own servers when
    PREFECT_API_URL and MLFLOW_TRACKING_URI are set (what `prefect deployment run` does),
    follow it, print the result and the paired verdicts against the job's previous and best checkpoints (and
    --baseline), and with --decide whether it stopped early."""
    from evaldag.runtime import runner
    from evaldag.runtime.deployments import SUITE, SUITE_DEPLOYMENT, evaluation_deployment
    from evaldag.runtime.stack import Stack

    _check_run_options(ctx, benchmark, benchmarks, decide, decide_margin is not None or decide_alpha is not None,
                       adaptive_budget is not None and adaptive_width is not None)
    names = runner.benchmark_names(benchmarks if benchmarks is not None else benchmark, typer.BadParameter)
    stack = Stack()
    sampling = {k: v for k, v in dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                      seed=seed).items() if v is not None} or None
    engine_settings = {k: v for k, v in dict(tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                                             gpu_memory_utilization=gpu_memory_utilization, dtype=dtype).items()
                       if v is not None} or None
    _check_job_settings(sampling, engine_settings)
    adaptive = ({"budget": adaptive_budget} if adaptive_budget is not None
                else {"target_ci_width": adaptive_width} if adaptive_width is not None else None)
    params = {k: v for k, v in dict(checkpoint=checkpoint, step=step, limit=limit, num_shards=num_shards,
                                    sampling=sampling, engine_settings=engine_settings, train_run=train_run,
                                    baseline=baseline,
                                    final_step=final_step, decide="vs_best" if decide else None,
                                    decide_margin=decide_margin, decide_alpha=decide_alpha,
                                    adaptive=adaptive, eval_loss=eval_loss).items()
              if v is not None}
    # a built-in benchmark runs as its own eval/<name>; several, and any other (a user's config), as eval/suite
    own = evaluation_deployment(names) != SUITE_DEPLOYMENT
    deployment, params = (names[0], params) if own else (SUITE, {**params, "benchmarks": names})
    runner.run_and_report(stack, deployment, params)


app.add_typer(benchmarks_app, name="benchmarks")
app.command()(select)


@app.command("flush-events")
def flush_events(
    train_run: Annotated[Optional[str], typer.Argument(help="training run whose spool to flush (default: all)")] = None,
) -> None:
    """Send checkpoint events a trainer spooled while the Prefect server was unreachable."""
    from evaldag import paths
    from evaldag.runtime import runner
    from evaldag.request.rules import check_train_run
    from evaldag.runtime.stack import Stack
    from evaldag.client.notifier import flush_spool

    if train_run is not None:
        check_train_run(train_run, typer.BadParameter)   # it names a folder under the spool root
    if not os.environ.get("PREFECT_API_URL"):
        runner.point_clients_at_stack(Stack())
    root = paths.home() / "spool"
    spools = [root / train_run] if train_run else sorted(p for p in root.glob("*") if p.is_dir())
    total = 0
    for spool in spools:
        sent = flush_spool(spool, os.environ["PREFECT_API_URL"])
        left = len(list(spool.glob("*.json")))
        typer.echo(f"{spool.name}: delivered {sent}, {left} still pending")
        total += sent
    if not spools:
        typer.echo(f"no spooled events under {root}")


@app.command()
def sync() -> None:
    """Log to MLflow every finished evaluation of the result store that MLflow lacks (after a tracking outage)."""
    from evaldag.runtime import runner
    from evaldag.runtime.stack import Stack
    from evaldag.storage import store
    from evaldag.tracking.sync import sync as sync_runs

    runner.point_clients_at_stack(Stack(), need_prefect=False)
    failed: list[tuple[str, str]] = []
    created = sync_runs(store.root(), failed)
    for run in created:
        typer.echo(f"logged {run.url or run.run_id}")
    typer.echo(f"{len(created)} evaluation(s) logged; everything else was already in MLflow"
               + (f", except {len(failed)} that could not be logged:" if failed else ""))
    for plan_file, why in failed:
        typer.secho(f"  {plan_file}: {why}", fg="red")
    if failed:
        raise typer.Exit(1)


@app.command()
def compare(
    benchmark: Annotated[Optional[list[str]], typer.Option("--benchmark", "-b", help="only these benchmarks")] = None,
    train_run: Annotated[Optional[list[str]], typer.Option(help="only this training job (repeat for several)")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="also draw accuracy (with intervals) and reward against "
                                                 "step, one line per training job, to this PNG")] = None,
    verdicts: Annotated[bool, typer.Option(help="also pair each evaluation with the job's previous and best "
                                           "checkpoint (and --baseline) on the same problems: paired difference, "
                                           "interval, p-value, verdict")] = False,
    margin: Annotated[float, typer.Option(help="equivalence margin of --verdicts (accuracy, 0.02 = 2 points)")] = 0.02,
    alpha: Annotated[float, typer.Option(help="level of --verdicts' intervals and tests")] = 0.05,
    baseline: Annotated[Optional[str], typer.Option(help="--verdicts also against this evaluation: a run id, "
                                                    "checkpoint path, model name or JOB@STEP")] = None,
    final_step: Annotated[Optional[int], typer.Option(min=1, help="forecast every job's accuracy at this step "
                                                      "(default: the final step its evaluations were given, if "
                                                      "any)")] = None,
) -> None:
    """Checkpoints x benchmarks from MLflow: accuracy, interval, delta to the previous and the best checkpoint;
    each job's forecast at its final step and the jobs falling behind another at the same step
    (evaldag/decisions/forecast.py); with --verdicts, paired verdicts per evaluation (evaldag/decisions/verdicts.py)."""
    from rich.console import Console

    from evaldag.runtime import runner
    from evaldag.tracking.compare import collect, falling_behind, forecasts, render
    from evaldag.runtime.stack import Stack

    runner.point_clients_at_stack(Stack(), need_prefect=False)
    df = collect(benchmark, train_run)
    console = Console(highlight=False)
    if df.is_empty():
        console.print("no finished evaluations in MLflow yet; run one with `evaldag run math500 --limit 20`")
        return
    console.print(render(df))
    predicted = forecasts(df, final_step)
    for f in predicted.iter_rows(named=True):
        console.print(f"{f['train_run']} on {f['benchmark']}: {f['text']}")
    for bench, d in falling_behind(df):
        if d.fired:
            console.print(f"[red]falling behind[/] on {bench}: {d.explanation}")
    if verdicts:
        from evaldag.decisions import verdicts as paired
        from evaldag.tracking.samples import load_samples

        pairs = paired.pair_job_evaluations(paired.evaluations(benchmark, train_run), load_samples, margin, alpha,
                                            baseline)
        console.print(paired.render(pairs) if pairs.height else
                      "no verdicts: each job needs two evaluations with the same comparison key (or a --baseline)")
    if plot is not None:
        from evaldag.tracking.compare import plot as draw

        console.print(f"plot written to {draw(df, plot, predicted)}")


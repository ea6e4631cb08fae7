"""Start a deployment run on the local stack or a team's own servers, follow it with a live status line, and print
its result."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from evaldag.pipeline import progress

from evaldag.runtime import liveness, prefect_results
from evaldag.runtime.deployments import benchmark_deployments, eval_deployment
from evaldag.runtime.run_events import state_changes
from evaldag.errors import EvalDagError, StackError, redact_url
from evaldag.runtime.stack import Stack


class Servers(NamedTuple):
    """Where this process's clients point: the Prefect UI (None when only MLflow is needed) and MLflow."""

    prefect_ui: str | None
    mlflow_url: str


def point_clients_at_stack(stack: Stack, need_prefect: bool = True) -> Servers:
    """Point this process's Prefect and MLflow clients at the servers to use (before prefect is imported): a team's
    own, when PREFECT_API_URL names another server than the local stack's (MLFLOW_TRACKING_URI must be set too;
    their auth variables are the clients' own), else the local stack, which must be up.

    An MLFLOW_TRACKING_URI already set by the user wins for read-only commands (need_prefect=False).
    """
    api_url, mlflow_url = os.environ.get("PREFECT_API_URL"), os.environ.get("MLFLOW_TRACKING_URI")
    if not need_prefect and mlflow_url:
        return Servers(None, redact_url(mlflow_url))
    state = stack._load_state()
    stack_api = state["urls"]["prefect"] + "/api" if state else None
    if api_url and api_url.rstrip("/") != stack_api:
        if not mlflow_url:
            raise StackError(f"PREFECT_API_URL is set ({redact_url(api_url)}), so evaldag uses that Prefect server, "
                             "but MLFLOW_TRACKING_URI is not: set it to the MLflow server the workers log to "
                             "(docs/own-servers.md), or unset PREFECT_API_URL to use the local stack")
        return Servers(redact_url(_prefect_ui(api_url)), redact_url(mlflow_url))   # shown, never used to connect
    status = stack.status()
    unhealthy = [r.component for r in status if not r.healthy]
    if not status or unhealthy:
        raise StackError(f"the local stack in {stack.home} is not up"
                         f"{' (unhealthy: ' + ', '.join(unhealthy) + ')' if unhealthy else ''}; "
                         "start it with `evaldag up`, or set PREFECT_API_URL and MLFLOW_TRACKING_URI to use your "
                         "own servers (docs/own-servers.md)")
    os.environ["PREFECT_API_URL"] = stack.prefect_url + "/api"
    os.environ["MLFLOW_TRACKING_URI"] = stack.mlflow_url
    os.environ.update(stack.client_auth_env())   # a stack with API auth (`evaldag up --auth`) lets nobody in without
    return Servers(stack.prefect_url, stack.mlflow_url)


def _prefect_ui(api_url: str) -> str:
    """The Prefect UI of an API URL: a self-hosted server's is the API's address without /api (Prefect Cloud's
    is another host; prefect's own ui_url setting knows it once prefect is imported, see `_ui_url`)."""
    url = api_url.rstrip("/")
    return url[:-len("/api")] if url.endswith("/api") else url


def _ui_url(servers: Servers) -> str:
    """The UI links are built on: prefect's ui_url setting (PREFECT_UI_URL, or what it infers for Prefect Cloud)."""
    from prefect.settings import get_current_settings

    return (get_current_settings().ui_url or servers.prefect_ui or "").rstrip("/")


# Off a terminal (a log file, CI, nohup) `evaldag run` prints a progress line this often.
PROGRESS_EVERY_ENV, PROGRESS_EVERY_S = "EVALDAG_PROGRESS_EVERY_S", 60.0


def progress_every_s() -> float:
    """Seconds between progress lines off a terminal ($EVALDAG_PROGRESS_EVERY_S, default PROGRESS_EVERY_S)."""
    raw = os.environ.get(PROGRESS_EVERY_ENV) or PROGRESS_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise EvalDagError(f"{PROGRESS_EVERY_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def benchmark_names(text: str, error: type[Exception] = ValueError) -> list[str]:
    """The benchmarks of a comma-separated list (`evaldag run --benchmarks math500,./mine.yaml`), each once, in
    order, a config file as its absolute path (the evaluation reads it in the worker's folder); `error` naming the
    problem for an empty list, a malformed name, one without a config or a config file that is not there."""
    from evaldag.request.config import available, config_origins, is_config_file
    from evaldag.request.rules import check_benchmark_names
    from evaldag.runtime.deployments import builtin_benchmarks

    refs = [b.strip() for b in text.split(",") if b.strip()]
    refs = [str(Path(b).expanduser().resolve()) if is_config_file(b) else b for b in refs]
    # a benchmark only the user's folder has goes as its file: the workers may run without EVALDAG_CONFIGS_DIR
    origins, builtin = config_origins("benchmarks"), set(builtin_benchmarks())
    refs = [str(origins[b]) if b in origins and b not in builtin else b for b in refs]
    names = check_benchmark_names(list(dict.fromkeys(refs)), error)
    missing = [n for n in names if is_config_file(n) and not Path(n).is_file()]
    if missing:
        raise error(f"no benchmark config file {', '.join(missing)}")
    unknown = [n for n in names if not is_config_file(n) and n not in available("benchmarks")]
    if unknown:
        raise error(f"no benchmark config for {', '.join(unknown)} (known: {', '.join(available('benchmarks'))}); "
                    "give a config file's path (./mybench.yaml) or put <name>.yaml in EVALDAG_CONFIGS_DIR")
    return names


def run_and_report(stack: Stack, benchmark: str, params: dict) -> None:
    """Run eval/<benchmark> with `params` (eval/suite with `benchmarks` in params: one engine load per gpu slot for
    all of them), wait for it, and print each benchmark's metrics and where to look."""
    servers = point_clients_at_stack(stack)
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)   # URLs must stay on one line to be clickable/greppable
    name = eval_deployment(benchmark)
    try:
        fr = run_deployment(name, parameters=params, timeout=0)
    except Exception as e:  # prefect raises ObjectNotFound for an unknown deployment
        raise EvalDagError(f"cannot start {name}: {e}. Deployed benchmarks are "
                           f"{', '.join(benchmark_deployments())} (run `evaldag up`, or `evaldag deploy` on your "
                           "own servers, to redeploy)") from None
    ui = _ui_url(servers)
    url = f"{ui}/runs/flow-run/{fr.id}"
    console.print(f"started {name} as flow run [bold]{fr.name}[/] ({url})")
    t0 = time.monotonic()
    try:
        with (get_client(sync_client=True) as client, state_changes(fr.id) as changed,
              progress.Display(console, name, every_s=progress_every_s()) as display):
            while True:
                changed.clear()
                fr = client.read_flow_run(fr.id)
                snap = progress.snapshot(client, fr.id)
                display.update(fr.state.name if fr.state else "Pending", snap)
                if fr.state and fr.state.is_final():
                    run_id = fr.id   # a false crash that the evaluation undoes is not its end (evaldag.runtime.liveness)
                    fr = liveness.settled(lambda: client.read_flow_run(run_id))
                    if fr.state.is_final():
                        break
                changed.wait(1)       # the display's pace, or at once when the run changes state
    except KeyboardInterrupt:
        _interrupted(console, fr, url, ask=console.is_terminal)
        return
    if not fr.state.is_completed():
        raise EvalDagError(f"{name} ended {fr.state.name}: {fr.state.message} (logs: {url})")
    _report_each(console, fr, benchmark, time.monotonic() - t0, servers._replace(prefect_ui=ui))


def _report_each(console, fr, benchmark: str, wall_s: float, servers: Servers) -> None:
    """The result of each benchmark the flow run evaluated: eval/suite's are its `benchmarks` parameter (the
    deployment's default unless the run named them), any other deployment's is its own."""
    for each in fr.parameters.get("benchmarks") or [benchmark]:
        _print_result(console, benchmark_label(each), str(fr.id), _flow_summary(fr, each), wall_s, servers)


def benchmark_label(ref: str) -> str:
    """The name a benchmark's results go by (its MLflow experiment, its folder in the result store): a config
    file's declared name, a config name itself."""
    from evaldag.request.config import is_config_file, load_benchmark

    if not is_config_file(ref):
        return ref
    try:
        return load_benchmark(ref).name
    except EvalDagError:   # changed since the run started: its own results still carry the old name
        return Path(ref).stem


def _flow_summary(fr, benchmark: str) -> dict | None:
    """The evaluation's own summary (its persisted result: the figures this flow run measured), or None when the
    result store cannot be read from here (the MLflow run's figures are shown then). Read as plain JSON, never by
    Prefect's reader, which decodes with whatever serializer the file names (evaldag.runtime.prefect_results)."""
    summary = prefect_results.read_result(fr.state)
    summary = summary.get("benchmarks", {}).get(benchmark, summary) if isinstance(summary, dict) else None
    return summary if isinstance(summary, dict) and isinstance(summary.get("metrics"), dict) else None


def provenance(flow_run_id: str, logged_by: str | None, computed: dict | None, logged: dict) -> list[str]:
    """What the printed figures are, when the MLflow run shown was logged by another flow run than `flow_run_id`:
    the evaluation was reused whole, or recomputed here (its stored outputs were gone) while MLflow keeps the
    first computation; and any result that differs between the two. Nothing to say for a run this flow logged.

    `computed` is None when this flow run's summary cannot be read from here (_flow_summary): whether it recomputed
    anything is then unknown, and said so, rather than guessed."""
    if logged_by == flow_run_id:
        return []
    if computed is None or "cache_hit_rate" not in computed:
        why = ("the summary is not readable from this machine (its result store is out of reach)" if computed is None
               else "the summary has no cache_hit_rate")
        return [f"this evaluation was logged before by flow run {logged_by}; whether anything was recomputed is "
                f"unknown here: {why}. The figures below are the MLflow run's; this flow run's own are in its "
                "Prefect result (see the Prefect UI link below)"]
    if computed["cache_hit_rate"] >= 1.0:
        return ["this evaluation was computed and logged before: nothing was recomputed"]
    from evaldag.tracking.names import mlflow_key
    from evaldag.tracking.write import differing_results

    lines = [f"recomputed by this flow run ({computed['cache_hit_rate']:.0%} of its stages reused): the "
             f"figures below are this run's; the MLflow run keeps those logged first by flow run {logged_by}"]
    for key in differing_results(computed, logged):
        lines.append(f"warning: {key} differs from the logged run: {computed[key]:.6g} here, "
                     f"{logged.get(mlflow_key(key), float('nan')):.6g} logged")
    return lines


def verdict_lines(tags: dict[str, str], metrics: dict[str, float]) -> list[str]:
    """What `evaldag run` prints after the metrics about the run's paired verdicts (logged at track time): one line
    each against the job's previous and best checkpoints and the baseline, or why there are none."""
    from evaldag.decisions.verdicts import logged_verdict_lines

    lines = logged_verdict_lines(tags, metrics)
    if not lines:
        return [("paired verdicts: none logged (no earlier checkpoint of this job evaluated alike and no baseline, "
                 "or they could not be computed: see the track task's log)")]
    return ["paired verdicts (accuracy difference [interval], sign-flip p-value):"] + [f"  {x}" for x in lines]


def _interrupted(console, fr, url: str, ask: bool) -> None:
    """Ctrl-C while following: cancel the flow run (and its shard flow runs) or leave it running, as asked.

    Off a terminal nobody can answer, so the run is left running and the line says how to cancel it."""
    cancel = False
    if ask:
        from rich.prompt import Prompt

        try:
            answer = Prompt.ask(f"\nstopped following {fr.name}: cancel the flow run, or leave it running?",
                                choices=["cancel", "leave"], default="leave", console=console)
        except (KeyboardInterrupt, EOFError):   # a second Ctrl-C: leave it, the safe choice
            answer = "leave"
        cancel = answer == "cancel"
    if not cancel:
        console.print(f"left {fr.name} running: {url} (cancel it with `prefect flow-run cancel {fr.id}`)")
        return
    cancelled = cancel_flow_run(fr.id)
    console.print(f"cancelling {fr.name} and {cancelled - 1} shard flow run(s): {url}")


def cancel_flow_run(flow_run_id) -> int:
    """Move a flow run and its unfinished child flow runs to Cancelling (their workers stop them); returns how many
    flow runs were asked to cancel."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        targets = [flow_run_id] + [c.id for c in children if c.state is None or not c.state.is_final()]
        for target in targets:
            client.set_flow_run_state(target, Cancelling(message="cancelled from `evaldag run` (Ctrl-C)"),
                                      force=True)
    return len(targets)


def _print_result(console, benchmark: str, flow_run_id: str, summary: dict | None, wall_s: float,
                  servers: Servers) -> None:
    from mlflow import MlflowClient
    from rich.table import Table

    from evaldag.tracking.names import JOBS_EXPERIMENT, charts_url, experiment_name, mlflow_key, run_url

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name(benchmark))
    runs = [r for tag in ("prefect.flow_run_id", "prefect.last_flow_run_id")
            for r in client.search_runs([exp.experiment_id], filter_string=f"tags.`{tag}` = '{flow_run_id}'")]
    if not runs:
        console.print(f"completed in {wall_s:.0f} s, but no MLflow run names this flow run; see "
                      f"{redact_url(servers.mlflow_url)}")
        return
    run = runs[0]
    computed = summary["metrics"] if summary else None
    for line in provenance(flow_run_id, run.data.tags.get("prefect.flow_run_id"), computed, run.data.metrics):
        console.print(line)
    m = {mlflow_key(k): v for k, v in computed.items()} if computed else run.data.metrics
    table = Table(title=f"{run.data.tags.get('model')} on {benchmark} "
                        f"(step {int(run.data.metrics.get('step', 0))})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, fmt in [("accuracy", "{:.2%}"), ("accuracy_ci_low", "{:.2%}"), ("accuracy_ci_high", "{:.2%}"),
                     ("adaptive_set_ci_width", "{:.2%}"), ("adaptive_samples_per_problem", "{:.1f}"),
                     ("n_samples", "{:.0f}"), ("rate_correct", "{:.2%}"),
                     ("rate_wrong", "{:.2%}"), ("rate_unparseable", "{:.2%}"), ("rate_timeout", "{:.2%}"),
                     ("truncation_rate", "{:.2%}"), ("mean_completion_tokens", "{:.1f}"),
                     ("generation_tokens_per_s", "{:.1f}"), ("generation_s", "{:.1f}"), ("grading_s", "{:.1f}"),
                     ("shard_peak_rss_mb", "{:.0f}")]:
        if key in m:
            table.add_row(key, fmt.format(m[key]))
    console.print(table)
    for line in verdict_lines(run.data.tags, run.data.metrics):
        console.print(line)
    console.print(f"completed in {wall_s:.0f} s")
    console.print(f"Prefect UI: {servers.prefect_ui}/runs/flow-run/{flow_run_id}")
    console.print(f"MLflow UI:  {run_url(servers.mlflow_url, exp.experiment_id, run.info.run_id)}")
    jobs = client.get_experiment_by_name(JOBS_EXPERIMENT)
    if jobs is not None:
        console.print(f"training jobs side by side: {charts_url(servers.mlflow_url, jobs.experiment_id)}")

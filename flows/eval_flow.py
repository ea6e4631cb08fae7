"""eval: resolve -> [generate -> grade] x shards on the gpu pool -> reduce -> track, for one checkpoint on one or
more benchmarks.

Deployed once per benchmark (eval/math500, eval/aime24, ...), so `prefect deployment run eval/math500` evaluates the
default model on MATH-500; `-p checkpoint=/path -p step=1200 -p limit=20` evaluates a checkpoint or a slice.
eval/suite takes `benchmarks` (e.g. the ones a checkpoint event names): their shards share the gpu slots and each
slot loads the checkpoint's engine once for all of them; every benchmark still gets its own reduce, MLflow run
and metrics.
"""

from __future__ import annotations

from typing import Literal

import polars as pl
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import unmapped

from evaldag.storage.schema import GRADED_SCHEMA, read_table
from evaldag.decisions.decide import Decider, Decision, graded_prefix_path
from evaldag.errors import ConfigError
from evaldag.runtime.cancel import KeepingCancel, restore_cancel
from evaldag.runtime.deployments import EVAL_FLOW
from evaldag.runtime.liveness import revive, watch_for_false_crash
from evaldag.request.plan import DEFAULT_CHECKPOINT, EvalPlan, EvalRequest, load_plan
from evaldag.pipeline.progress import evaluation_progress
from evaldag.tracking.report import headline_table, summary_markdown
from flows.shard_flow import shard_flow
from tasks.decide import decide_while_generating, deciders_for, publish
from tasks.gpu_slots import pool_num_gpus
from tasks.launch_shard import launch_shard
from tasks.reduce import reduce_task
from tasks.resolve import resolve_task
from tasks.second_round import second_round_task
from tasks.track import track_task


# persist_result: the summary lands in the result store (the server's default result storage), as JSON data that
# `evaldag run` reads back as data (evaldag.runtime.prefect_results.read_result; no task persists a result)
@flow(name=EVAL_FLOW, task_runner=ThreadPoolTaskRunner(max_workers=64), log_prints=True, persist_result=True,
      result_serializer="json")
def eval_flow(  # noqa: PLR0913 - one flat parameter each, so `-p key=value` works from the CLI
    benchmark: str = "math500",
    checkpoint: str = DEFAULT_CHECKPOINT,
    step: int = 0,
    limit: int | None = None,
    num_shards: int | None = None,
    sampling: dict | None = None,
    engine_settings: dict | None = None,
    pass_k: list[int] | None = None,
    reference: str | None = None,
    train_run: str | None = None,
    mlflow_parent_run_id: str | None = None,
    engine: Literal["hf", "vllm", "openai"] | None = None,
    dispatch: Literal["deployment", "inline"] = "deployment",
    benchmarks: list[str] | None = None,
    baseline: str | None = None,
    final_step: int | None = None,
    decide: Literal["vs_best"] | None = None,
    decide_alpha: float | None = None,
    decide_margin: float | None = None,
    decide_rounds: int | None = None,
    adaptive: dict | None = None,
    eval_loss: bool | None = None,
) -> dict:
    """Evaluate one checkpoint on `benchmark` (or on every one of `benchmarks`) and log each to MLflow; returns the
    headline figures (for several benchmarks: {"benchmarks": {name: figures}}).

    dispatch="deployment" runs every shard as a flow run of eval-shard/gpu (the normal path, needs gpu workers);
    "inline" runs the shards one after another inside this flow run (no workers needed). `baseline` (a run id,
    checkpoint path, model name or JOB@STEP) adds a paired verdict against that evaluation to each MLflow run, next
    to those against the job's previous and best checkpoints. `final_step` (the job's planned last step) gets the
    job's parent run a forecast of its accuracy there (evaldag.decisions.forecast). `decide="vs_best"` stops generating as
    soon as the paired verdict against the job's best checkpoint so far is decided, at level `decide_alpha` with
    equivalence margin `decide_margin`, read `decide_rounds` times (evaldag.decisions.decide; with dispatch="deployment").
    `adaptive` ({"budget": samples} or {"target_ci_width": 0.05}, and optionally n0, floor, max_per_problem) draws
    n0 samples of every problem, then more where the outcome is uncertain (evaldag.decisions.adaptive; engine vllm).
    `eval_loss` scores the benchmark's reference solutions and logs eval_loss (default: the benchmark config's).
    `sampling` ({"n": 8, "temperature": 0.6, "max_new_tokens": 32768, ...}) overrides the benchmark's sampling and
    `engine_settings` ({"tensor_parallel_size": 4, "max_model_len": 34816, "gpu_memory_utilization": 0.9,
    "dtype": "bfloat16"}) the model config's (evaldag.request.config.EngineSettings).
    """
    # a false crash (the lost-run automation after a clock step or a partition) is undone: nobody else would finish
    # this evaluation (evaldag.runtime.liveness)
    # a person's cancel stands: the run checks it before each irreversible step and ends Cancelled, whatever stops
    # its body then (evaldag.runtime.cancel)
    with watch_for_false_crash(flow_run.id, revive), KeepingCancel(flow_run.id) as cancel:
        names = list(dict.fromkeys(benchmarks)) if benchmarks else [benchmark]
        requests = [EvalRequest.parse(benchmark=name, checkpoint=checkpoint, step=step, limit=limit,
                                      num_shards=num_shards, sampling=sampling, engine_settings=engine_settings,
                                      pass_k=pass_k, reference=reference,
                                      train_run=train_run, mlflow_parent_run_id=mlflow_parent_run_id, engine=engine,
                                      baseline=baseline, final_step=final_step, decide=decide,
                                      decide_alpha=decide_alpha, decide_margin=decide_margin,
                                      decide_rounds=decide_rounds, adaptive=adaptive, eval_loss=eval_loss)
                    for name in names]     # every request is checked before anything is resolved
        plan_paths, plans, deciders, decisions, running = _plan(requests, decide, dispatch)
        graded: dict[str, list[str]] = {path: [] for path in plan_paths}
        done, decided = _generate(running, names, dispatch, deciders)
        graded |= done
        decisions |= decided
        _second_rounds(running, graded, dispatch)
        # keyed as the run named them (a config file's path, not only a name), which is how callers look them up
        summaries = {name: _reduce_and_track(path, plan, graded[path], step, cancel, decisions.get(path),
                                             deciders.get(path))
                     for name, path, plan in zip(names, plan_paths, plans)}
        cancel.check("returning Completed")
        return summaries[names[0]] if len(names) == 1 else {"benchmarks": summaries}
    return cancel.state


# a cancel that lands after the body's last check is overwritten by the engine's final state: set again
eval_flow.on_completion(restore_cancel)
eval_flow.on_failure(restore_cancel)


def _plan(requests: list[EvalRequest], decide: str | None, dispatch: str
          ) -> tuple[list[str], list[EvalPlan], dict[str, Decider], dict[str, Decision], list[tuple[str, EvalPlan]]]:
    """Resolve every request (a task each): (plan paths, plans, the deciders and decisions of evaluations that may
    stop early, the (path, plan) of those still to run)."""
    if decide and dispatch == "inline":
        raise ConfigError("decide stops the shards while they generate, which needs them running beside this "
                          "flow run (dispatch='deployment'); inline shards run inside it one after another. "
                          "Drop decide or use dispatch='deployment'")
    # inline shards run one after another: more than one only repeats the engine load
    num_gpus = pool_num_gpus() if dispatch == "deployment" else 1
    plan_paths = [resolve_task(request, num_gpus) for request in requests]
    plans = [load_plan(path) for path in plan_paths]
    deciders, decisions = deciders_for(plan_paths, plans) if dispatch == "deployment" else ({}, {})
    # an evaluation an earlier attempt stopped early needs no shard again
    running = [(path, plan) for path, plan in zip(plan_paths, plans)
               if not (path in decisions and decisions[path].stopped)]
    return plan_paths, plans, deciders, decisions, running


def _second_rounds(running: list[tuple[str, EvalPlan]], graded: dict[str, list[str]], dispatch: str) -> None:
    """Adaptive samples: a second round where the first left problems uncertain (evaldag.request.second_round); its
    graded files join the first round's in `graded`."""
    seconds = {path: second_round_task(path, graded[path]) for path, plan in running if plan.request.adaptive}
    seconds = {path: second for path, second in seconds.items() if second is not None}
    if seconds:
        round2 = [(second, load_plan(second)) for second in seconds.values()]
        more, _ = _generate(round2, [f"{plan.benchmark.name} (second round)" for _, plan in round2], dispatch,
                            {}, round=2)
        for path, second in seconds.items():
            graded[path] += more[second]


def _generate(running: list[tuple[str, EvalPlan]], names: list[str], dispatch: str, deciders: dict[str, Decider],
              round: int = 1) -> tuple[dict[str, list[str]], dict[str, Decision]]:
    """Generate and grade every shard of the plans `running`: slot s runs shard s of every plan that has one, on one
    engine load. Returns each plan's graded files (none for a shard its decider stopped) and the decisions the
    deciders reached while the shards ran. `round`: which round of an adaptive evaluation they are (the progress
    counts that round's shards only)."""
    groups = [[path for path, plan in running if plan.num_shards > s]
              for s in range(max((plan.num_shards for _, plan in running), default=0))]
    decisions: dict[str, Decision] = {}
    if dispatch == "deployment":
        unit = "samples" if any(plan.progress_unit == "samples" for _, plan in running) else "problems"
        with evaluation_progress(flow_run.id, names, sum(plan.progress_total for _, plan in running), unit=unit,
                                 round=round):
            futures = launch_shard.map(groups, range(len(groups)), unmapped(flow_run.id)) if groups else []
            decisions = decide_while_generating(list(futures), deciders)
            results = [future.result() for future in futures]
    else:
        results = [shard_flow(group, s) for s, group in enumerate(groups)]
    graded: dict[str, list[str]] = {path: [] for path, _ in running}
    for group, paths in zip(groups, results):
        for plan_path, path in zip(group, paths):
            if path is not None:
                graded[plan_path].append(path)
    return graded, decisions


def final_decision(decider: Decider, graded: list[str]) -> Decision:
    """The decision of an evaluation that ran to the end undecided, from its shards' graded files: read before the
    reduce, so that metrics.json is written once with the decision's figures in it."""
    return decider.final(pl.concat([read_table(path, GRADED_SCHEMA).select(
        "sample_id", "sample_index", "shard_index", "correct", "completion_tokens") for path in graded]))


def _reduce_and_track(plan_path: str, plan: EvalPlan, graded: list[str], step: int, cancel: KeepingCancel,
                      decision: Decision | None = None, decider: Decider | None = None) -> dict:
    """Reduce one benchmark's shards (an evaluation stopped early: the prefix it was decided on), log them to
    MLflow, and publish the Prefect artifacts; returns the summary. Nothing of it once the run is asked to cancel
    (`cancel`): its shards may have finished inside the server's child-cancel loop, or all been reused."""
    cancel.check(f"reducing {plan.benchmark.name}")
    if decider is not None and decision is None:     # ran to the end undecided: the verdict over every problem
        decision = final_decision(decider, graded)
        publish(plan, decision)
    if decision is not None:
        # before the reduce, which puts its figures in metrics.json with the rest (what `evaldag sync` logs), and
        # track tags the run from it
        decision.save(plan)
    if decision is not None and decision.stopped:
        metrics = reduce_task(plan_path, [str(graded_prefix_path(plan))], decision.prefix)
    else:
        metrics = reduce_task(plan_path, graded)
    cancel.check(f"logging {plan.benchmark.name} to MLflow")
    run = track_task(plan_path, metrics, flow_run.id)    # it reads the cancel again before finishing the MLflow run
    summary = {"eval_key": plan.eval_key, "mlflow_run_id": run.run_id, "mlflow_url": run.url,
               "new_mlflow_run": run.created, "metrics": metrics}
    create_markdown_artifact(summary_markdown(plan, metrics, run.url, run.diagnostics),
                             key=f"eval-{plan.benchmark.name}",
                             description=f"{plan.model.name} on {plan.benchmark.name} at step {step}")
    create_table_artifact(headline_table(plan, metrics, run.url), key=f"eval-{plan.benchmark.name}-mlflow",
                          description="headline metrics and the MLflow run they were logged to")
    get_run_logger().info("%s on %s: accuracy %.4f over %d samples; MLflow run %s", plan.model.name,
                          plan.benchmark.name, metrics["accuracy"], int(metrics["n_samples"]), run.url or run.run_id)
    return summary

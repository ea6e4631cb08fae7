"""The track stage: one MLflow run per (checkpoint, benchmark), found again by its eval_key, and written by one writer.

Logging the same evaluation twice returns the existing finished run instead of creating a second one. Runs carry
the training job (`train_run` tag) and the checkpoint step, so the job's history (earlier checkpoints, read by
evaldag.tracking.history) feeds the cross-checkpoint diagnostics and the accuracy/reward-vs-step plots logged here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from evaldag.pipeline import faults
from evaldag.storage import store
from evaldag.scoring.diagnostics import Diagnostic
from evaldag.request.plan import EvalPlan
from evaldag.tracking.run_claims import (TrackingBusy, claim_run, current_writer, heartbeat, keeping_lease, lease_seconds,
                                still_writer, take_writer)
from evaldag.decisions.series import comparison_key, describe, series_label
from evaldag.tracking import client as tracking_client
from evaldag.tracking.history import (comparable_histories, eval_loss_diagnostics, history_diagnostics, history_row,
                                      job_history, plot_history)
from evaldag.tracking.names import (COMPARISON_TAG, DIFFERS_TAG, FINAL_STEP_TAG, FORECAST_TAG, SETTINGS_TAG,
                                    UNDECIDED_SETTINGS_TAG, experiment_name, mlflow_key, run_url)
from evaldag.events.identity import plan_settings_key
from evaldag.tracking.parent_runs import PARENT_REFUSED_TAG, ensure_experiment, job_parent_run, parent_run

log = logging.getLogger("evaldag")

# The headline metrics of an evaluation that its training job's parent run gets, one curve per kind of evaluation.
HEADLINE = ("accuracy", "pass@1", "reward/mean", "truncation_rate", "mean_completion_tokens", "eval_loss")


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    experiment_id: str
    created: bool           # False when an earlier finished run with the same eval_key was found
    url: str | None         # link into the MLflow UI when the tracking URI is an http server
    diagnostics: list[Diagnostic] = field(default_factory=list)


def differing_results(computed: dict, logged: dict) -> list[str]:
    """The result metrics (not timings or other measurements) of `computed` whose value differs from the MLflow
    metrics `logged` for the same evaluation, or that the logged run lacks."""
    from evaldag.scoring.metrics import MEASUREMENT_KEYS

    def same(a: float, b: float | None) -> bool:
        return b is not None and (a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                                  or (math.isnan(a) and math.isnan(b)))

    return [k for k, v in computed.items()
            if k not in MEASUREMENT_KEYS and not same(float(v), logged.get(mlflow_key(k)))]


def find_run(client, experiment_id: str, eval_key: str):
    """The newest run of the experiment tagged with `eval_key` (a finished one first), or None."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.eval_key = '{eval_key}'",
                              order_by=["attributes.start_time DESC"], max_results=5)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    return (finished or runs or [None])[0]


def track(plan: EvalPlan, metrics: dict, flow_run_id: str | None = None, lease_s: float | None = None,
          wait_s: float | None = None, before_finish: Callable[[], None] | None = None) -> TrackedRun:
    """Log params, tags, metrics at step, diagnostics, plots and the per-sample parquet into the evaluation's one
    MLflow run (evaldag.tracking.run_claims: claimed atomically by eval_key, written by one writer at a time).

    A finished run is returned as it is. An unfinished one is finished by this call when nobody is writing it: it
    was this flow run's own earlier attempt (same `flow_run_id`), or its writer's heartbeat is older than `lease_s`
    (a crash). While another writer is alive this call waits up to `wait_s` (default lease + 30 s) for it to finish,
    then raises TrackingBusy, which the track task retries. `before_finish` is called last before the run is set
    FINISHED: what it raises leaves the run unfinished (a cancelled evaluation's, evaldag.runtime.cancel)."""
    client = tracking_client.mlflow_client()
    exp_id = ensure_experiment(client, experiment_name(plan.benchmark.name))
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    lease_s = lease_seconds() if lease_s is None else lease_s
    owner = flow_run_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    tags = _run_tags(plan, flow_run_id)
    run_id, created, finished = _claim_for_writing(client, exp_id, plan, owner, lease_s,
                                                   lease_s + 30 if wait_s is None else wait_s)
    if finished:
        if flow_run_id:   # so the flow run that found it can find it back (evaldag run prints its metrics)
            _set_tag_best_effort(client, run_id, "prefect.last_flow_run_id", flow_run_id)
        # the settings key as this evaldag computes it: a run tagged by an older definition would otherwise look
        # unevaluated to the sweeper at every sweep
        if client.get_run(run_id).data.tags.get(SETTINGS_TAG) != tags[SETTINGS_TAG]:
            _set_tag_best_effort(client, run_id, SETTINGS_TAG, tags[SETTINGS_TAG])
        _flag_differing_results(client, run_id, metrics, flow_run_id or owner)
        return TrackedRun(run_id, exp_id, False, run_url(uri, exp_id, run_id))
    current = client.get_run(run_id)
    # every metric point is stamped with the run's start: MLflow keeps one point per (key, time, step, value), so a
    # retried or taken-over track writes the same points again instead of a second one at the step
    writing = _Writing(client, run_id, current_writer(current)[0], int(current.info.start_time), plan.request.step)
    with keeping_lease(client, run_id, owner, writing.generation, lease_s):
        _log_results(writing, plan, metrics, tags, None if created else current)
        faults.maybe_fail("track")   # a drill: the run exists half-logged; the retry must finish it, not start another
        diags, history = _log_diagnostics(writing, exp_id, plan, metrics)
        _log_to_parent_run(writing, plan, metrics, history)
        _log_verdicts(writing, exp_id, plan)
        _log_artifacts(writing, plan)
    if still_writer(client, run_id, owner) is None:   # stalled past the lease, taken over: the new writer finishes
        raise TrackingBusy(f"MLflow run {run_id} was taken over by another writer while this one stalled")
    if before_finish is not None:
        before_finish()
    client.set_terminated(run_id, "FINISHED")
    return TrackedRun(run_id, exp_id, True, run_url(uri, exp_id, run_id), diags)


def _flag_differing_results(client, run_id: str, metrics: dict, by: str) -> None:
    """A finished run is kept as logged (one run per evaluation); a recomputation that found other results (stored
    outputs lost, then a non-deterministic engine or another kind of hardware) is flagged on it and in the log."""
    differs = differing_results(metrics, client.get_run(run_id).data.metrics)
    if differs:
        _set_tag_best_effort(client, run_id, DIFFERS_TAG, f"{by}: {', '.join(differs)}"[:5000])
        log.warning("MLflow run %s keeps the results logged first; this computation of the same evaluation found "
                    "other values of %s", run_id, ", ".join(differs))


@dataclass(frozen=True)
class _Writing:
    """The run this call writes, as its writer of `generation`, and the timestamp and step of what it logs."""

    client: Any
    run_id: str
    generation: int
    now_ms: int
    step: int

    def heartbeat(self) -> None:
        heartbeat(self.client, self.run_id, self.generation)


def _run_tags(plan: EvalPlan, flow_run_id: str | None) -> dict[str, str]:
    """The tags that find the run again: eval_key, the job and step, the settings the sweeper and history compare."""
    model = plan.model
    return {
        "eval_key": plan.eval_key,
        "benchmark": plan.benchmark.name,
        "model": model.name,
        "checkpoint": model.path,
        "train_run": plan.train_run,
        "step": f"{plan.request.step:012d}",        # zero-padded: MLflow compares tags as strings
        "dataset_hash": plan.dataset_hash,
        "prefect.flow_run_id": flow_run_id or "",
        "kind": "ckpt_eval",
        SETTINGS_TAG: plan_settings_key(plan),                        # the sweeper's "evaluated with these settings"
        COMPARISON_TAG: comparison_key(plan),                         # the job history's "measured alike"
        **_decision_tags(plan),
        # a decided evaluation stands for the full one: the sweeper (which asks no decide) counts it as done
        **({} if plan.request.decide is None else {UNDECIDED_SETTINGS_TAG: plan_settings_key(plan, decide=False)}),
    }


def _decision_tags(plan: EvalPlan) -> dict[str, str]:
    """decide.status / verdict / vs of an evaluation that asked for a sequential verdict (evaldag.decisions.decide)."""
    from evaldag.decisions.decide import Decision

    decision = Decision.load(plan) if plan.request.decide is not None else None
    return decision.tags() if decision is not None else {}


def _run_params(plan: EvalPlan) -> dict[str, Any]:
    """What the evaluation ran with: model, engine, data, grading and sampling settings."""
    model = plan.model
    return {
        "model": model.name, "checkpoint": model.path, "model_fingerprint": model.fingerprint[:16],
        "engine": model.engine, "dtype": model.dtype, "batch_size": model.batch_size,
        "num_shards": plan.num_shards, "n_problems": plan.n_problems, "limit": plan.request.limit,
        "dataset_source": plan.dataset_source, "gold_format": plan.benchmark.gold_format,
        "pipeline_version": plan.pipeline_version, "grader_version": plan.grader_version,
        "pass_k": ",".join(map(str, plan.pass_k)), "train_run": plan.train_run,
        "rewards": json.dumps([r.model_dump() for r in plan.benchmark.rewards]),
        "reference": plan.reference.path if plan.reference else None,
        **{f"sampling.{k}": v for k, v in plan.sampling.model_dump().items()},
        # a local engine's own settings (the model config's, with the request's engine_settings over them; a
        # server's base_url may hold credentials), and the hub revision a hub model's snapshot is
        **({} if model.engine == "openai" else {f"engine_args.{k}": v for k, v in model.engine_args.items()}),
        **({} if model.hub is None else {"hub": model.hub}),
        **({} if plan.request.adaptive is None
           else {f"adaptive.{k}": v for k, v in plan.request.adaptive.model_dump().items() if v is not None}),
    }


def _claim_for_writing(client, exp_id: str, plan: EvalPlan, owner: str, lease_s: float,
                       wait_s: float) -> tuple[str, bool, bool]:
    """Claim the evaluation's run and become its writer unless it is finished: (run id, whether this call created
    it, whether it is finished). Waits up to `wait_s` for a live writer, then raises TrackingBusy."""
    step = plan.request.step

    def candidate() -> str:
        # none of the evaluation's tags (kind, eval_key...) until it has won the claim (_log_results sets them):
        # a candidate a failed claim leaves behind must not look like the evaluation's run
        return client.create_run(exp_id, run_name=f"{plan.train_run}@{step}",
                                 tags={"kind": "ckpt_eval_candidate", "evaldag.candidate_for": plan.eval_key}
                                 ).info.run_id

    def legacy() -> str | None:       # a run logged before claims existed
        run = find_run(client, exp_id, plan.eval_key)
        return run.info.run_id if run is not None else None

    deadline = time.monotonic() + wait_s
    while True:
        run_id, created = claim_run(client, exp_id, plan.eval_key, candidate, legacy)
        if client.get_run(run_id).info.status == "FINISHED":
            return run_id, created, True
        if take_writer(client, run_id, owner, lease_s):
            return run_id, created, False
        if time.monotonic() > deadline:
            raise TrackingBusy(f"MLflow run {run_id} of eval_key {plan.eval_key[:16]} is being logged by "
                               f"{current_writer(client.get_run(run_id))[1]} (heartbeat younger than {lease_s:.0f} "
                               f"s); waited {wait_s:.0f} s for it to finish. Retry later: a dead writer's run is "
                               "taken over once its lease expires")
        time.sleep(1.0)


def _log_results(w: _Writing, plan: EvalPlan, metrics: dict, tags: dict[str, str], existing) -> None:
    """Metrics at step, params and tags; `existing` is the run an earlier attempt left unfinished, if any."""
    from mlflow.entities import Metric, Param

    # MLflow refuses to overwrite a param, so a resumed run logs only the params it does not have yet.
    logged = set(existing.data.params) if existing is not None else set()
    w.client.log_batch(
        w.run_id,
        metrics=[Metric(mlflow_key(k), float(v), w.now_ms, w.step) for k, v in {**metrics, "step": w.step}.items()],
        params=[Param(k, str(v)) for k, v in _run_params(plan).items() if k not in logged],
        tags=[],
    )
    for k, v in tags.items():
        # A takeover without a flow run of its own (evaldag sync) has no prefect.flow_run_id: the run keeps the one
        # of the flow run that computed it.
        if v == "" and existing is not None and existing.data.tags.get(k):
            continue
        w.client.set_tag(w.run_id, k, v)
    w.heartbeat()


def _log_diagnostics(w: _Writing, exp_id: str, plan: EvalPlan,
                     metrics: dict) -> tuple[list[Diagnostic], pl.DataFrame]:
    """The shard test of this evaluation, the job's history including this checkpoint, and whether the job falls
    behind another job measured alike: tags, a markdown report and the accuracy/reward-against-step plot. Returns
    the diagnostics and the job's history (one row per step, this checkpoint included)."""
    diags: list[Diagnostic] = []
    shard_file = plan.path("diagnostics.json")
    if shard_file.is_file():
        diags.append(Diagnostic(**json.loads(shard_file.read_text())["shard_disagreement"]))
    current = pl.DataFrame([history_row(w.step, metrics)])
    history = job_history(w.client, exp_id, plan.train_run, comparison_key(plan)).filter(pl.col("step") != w.step)
    history = pl.concat([history, current.cast(history.schema)]).sort("step")
    diags += history_diagnostics(history, describe(plan))
    with store.local_copy(plan.path("samples.parquet")) as local:      # the loss's jump from the previous checkpoint
        diags += eval_loss_diagnostics(w.client, exp_id, plan.train_run, comparison_key(plan), w.step, local)
    diags += _falling_behind(w, exp_id, plan, history)
    from evaldag.scoring.diagnostics import to_markdown, to_tags

    for k, v in to_tags(diags).items():
        w.client.set_tag(w.run_id, k, v)
    w.heartbeat()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "diagnostics.md"
        report.write_text(to_markdown(diags))
        w.client.log_artifact(w.run_id, str(report), artifact_path="diagnostics")
        png = plot_history(history, f"{plan.train_run} on {plan.benchmark.name}",
                           Path(tmp) / f"{plan.benchmark.name}_vs_step.png")
        w.client.log_artifact(w.run_id, str(png), artifact_path="plots")
    return diags, history


def _falling_behind(w: _Writing, exp_id: str, plan: EvalPlan, history: pl.DataFrame) -> list[Diagnostic]:
    """evaldag.forecast.falling_behind of this job against the other jobs evaluated alike (same comparison key),
    or nothing when that cannot be read. Best effort: a comparison with other jobs describes this one, it is not
    its result."""
    from evaldag.decisions.forecast import falling_behind

    try:
        others = comparable_histories(w.client, exp_id, comparison_key(plan))
        others.pop(plan.train_run, None)
        return [falling_behind(plan.train_run, history, others)] if others else []
    except Exception as e:  # noqa: BLE001 - the evaluation is tracked whatever other jobs' runs hold
        log.warning("no falling-behind check for %s@%s on %s: %s: %s", plan.train_run, w.step, plan.benchmark.name,
                    type(e).__name__, e)
        return []


def log_to_parent_run(client: Any, run: Any, plan: EvalPlan, metrics: dict, history: pl.DataFrame) -> None:
    """Log the curve point of `run`, an evaluation's finished MLflow run, into the parent run of `plan`'s job: its
    headline `metrics` at the plan's step and, when the plan names the job's final step, the forecast there from
    `history` (the job's evaluations alike, this one included). Stamped with the run's start as `track` stamps its
    points, so a repeated call writes the same point again (evaldag.tracking.adopt: an evaluation moved to the job
    a late event names)."""
    writing = _Writing(client, run.info.run_id, current_writer(run)[0], int(run.info.start_time), plan.request.step)
    _log_to_parent_run(writing, plan, metrics, history)


def _log_to_parent_run(w: _Writing, plan: EvalPlan, metrics: dict, history: pl.DataFrame) -> None:
    """The training job's parent run gets this benchmark's headline figures at this step, and, when the request
    names the job's final step, the forecast of the accuracy there (`_log_forecast`)."""
    from mlflow.entities import Metric

    chosen = job_parent_run(w.client, plan.train_run, plan.request.mlflow_parent_run_id)
    parent = chosen.run_id
    w.client.set_tag(w.run_id, "evaldag.parent_run_id", parent)
    if chosen.refused:   # the run the trainer named (deleted, another job's...) is not written: say so on the run
        w.client.set_tag(w.run_id, PARENT_REFUSED_TAG, chosen.refused[:5000])
    # one curve per kind of evaluation: math500/accuracy for the benchmark's own settings, math500.limit4/accuracy
    # for quick slices, math500.n8.t0.6/accuracy for a sampled variant...
    series = ".".join(filter(None, (plan.benchmark.name, series_label(plan))))
    w.client.log_batch(parent, metrics=[Metric(mlflow_key(f"{series}/{k}"), float(metrics[k]), w.now_ms, w.step)
                                        for k in HEADLINE if k in metrics])
    if plan.request.final_step is not None:
        _log_forecast(w, plan, history, parent, series)
    w.heartbeat()


def _log_forecast(w: _Writing, plan: EvalPlan, history: pl.DataFrame, parent: str, series: str) -> None:
    """The forecast of the job's accuracy at its planned final step (evaldag.decisions.forecast), made from the checkpoints
    evaluated alike so far: on the parent run, metrics `<series>/forecast/final_accuracy` (and `_low`, `_high`: the
    80 % band) at this step, so the chart shows how the forecast moves as the job goes; on both runs, tags with
    the final step and the forecast in words (or why there is none yet).

    Best effort, like the verdicts: a forecast is about the job, not this evaluation's result."""
    from mlflow.entities import Metric

    from evaldag.decisions.forecast import forecast

    final = plan.request.final_step
    try:
        fc = forecast(history, final)
        for run in (parent, w.run_id):   # the parent's tags are set by every evaluation of the job, maybe at once
            _set_tag_best_effort(w.client, run, mlflow_key(f"{FORECAST_TAG}.{series}"), fc.describe()[:5000])
            _set_tag_best_effort(w.client, run, FINAL_STEP_TAG, str(final))
        if fc.made:
            w.client.log_batch(parent, metrics=[
                Metric(mlflow_key(f"{series}/forecast/{k}"), v, w.now_ms, w.step)
                for k, v in (("final_accuracy", fc.value), ("final_accuracy_low", fc.low),
                             ("final_accuracy_high", fc.high))])
    except Exception as e:  # noqa: BLE001 - tracking the evaluation must not fail for its forecast
        log.warning("no forecast for %s at step %s on %s: %s: %s", plan.train_run, final, plan.benchmark.name,
                    type(e).__name__, e)


def _log_verdicts(w: _Writing, exp_id: str, plan: EvalPlan) -> None:
    """Paired verdicts of this evaluation against the job's previous and best-so-far evaluations with the same
    comparison key, and the request's baseline (evaldag.decisions.verdicts.job_verdicts), as tags `verdict.vs_*` and metrics.

    Best effort: the verdicts describe the run, they are not its results, so a failure (a bad margin setting, an
    MLflow hiccup while searching or downloading the earlier samples, an earlier run without samples) is logged as
    a warning and leaves the verdict tags out; the evaluation is still tracked and finished."""
    from evaldag.decisions import verdicts

    try:
        margin, alpha = verdicts.verdict_settings()
        with store.local_copy(plan.path("samples.parquet")) as local:
            samples = verdicts.read_scored_samples(local)
        found = verdicts.job_verdicts(
            w.client, exp_id, run_id=w.run_id, benchmark=plan.benchmark.name, train_run=plan.train_run,
            comparison=comparison_key(plan), step=w.step, samples=samples, margin=margin, alpha=alpha,
            baseline=plan.request.baseline)
        if found:
            verdicts.log_verdicts(w.client, w.run_id, {name: v for name, (v, _) in found.items()}, w.step,
                                  others={name: other for name, (_, other) in found.items()})
    except Exception as e:  # noqa: BLE001 - whatever went wrong, tracking the evaluation must not fail for it
        log.warning("no paired verdicts for MLflow run %s (%s@%s on %s): %s: %s", w.run_id, plan.train_run, w.step,
                    plan.benchmark.name, type(e).__name__, e)
        return
    w.heartbeat()


def _log_artifacts(w: _Writing, plan: EvalPlan) -> None:
    """The per-sample parquet, the plan and the metrics, copied from the result store."""
    for name, folder in (("samples.parquet", "samples"), ("plan.json", "config"), ("metrics.json", "config")):
        with store.local_copy(plan.path(name)) as local:
            w.client.log_artifact(w.run_id, str(local), artifact_path=folder)


def _set_tag_best_effort(client, run_id: str, key: str, value: str) -> None:
    """An informational tag that several evaluations may set at once: the tracking server's SQL store can refuse
    one of two simultaneous first writes of a tag (a unique-key race); the other's value is as good."""
    from mlflow.exceptions import MlflowException

    for _ in range(2):
        try:
            client.set_tag(run_id, key, value)
            return
        except MlflowException as e:
            log.info("tag %s of run %s not set (%s)", key, run_id, e)


__all__ = ["TrackedRun", "differing_results", "ensure_experiment", "find_run", "log_to_parent_run", "parent_run",
           "track"]

"""The track stage: one MLflow run per (checkpoint, benchmark), found again by its eval_key.

Logging the same evaluation twice returns the existing finished run instead of creating a second one. Runs carry
the training job (`train_run` tag) and the checkpoint step, so the job's history (earlier checkpoints) can be read
back for the cross-checkpoint diagnostics and the accuracy/reward-vs-step plots. The tracking server comes from
MLFLOW_TRACKING_URI (the local stack exports it to every worker).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import polars as pl

from evaldag import faults, store
from evaldag.diagnostics import Diagnostic
from evaldag.plan import EvalPlan
from evaldag.run_claims import (HEARTBEAT_TAG, TrackingBusy, TrackingUnavailable, claim_run, current_writer,
                                heartbeat, keeping_lease, lease_seconds, still_writer, take_writer)
from evaldag.series import comparison_key, describe, series_label
from evaldag.triggers import plan_settings_key

log = logging.getLogger("evaldag")

EXPERIMENT_PREFIX = "evaldag"
# One run per training job, holding every benchmark's headline metrics at step = checkpoint step: its chart view
# draws one curve per training job against step. (MLflow nests runs only inside one experiment, so the per-benchmark
# child runs link to it with the tag evaldag.parent_run_id instead.)
JOBS_EXPERIMENT = f"{EXPERIMENT_PREFIX}-train-runs"
COMPARISON_TAG = "evaldag.comparison_key"
SETTINGS_TAG = "evaldag.settings_key"
# MLflow 3's experiment kind (the UI's "Machine learning" type): the UI opens such an experiment on its runs table and
# charts instead of the GenAI traces/evaluation view. The value is the one the MLflow 3.17 UI reads.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
HEADLINE = ("accuracy", "pass@1", "reward/mean", "truncation_rate", "mean_completion_tokens")
# Set on a finished run when a later computation of the same evaluation found other results (which, and by whom).
DIFFERS_TAG = "evaldag.recomputation_differs"


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    experiment_id: str
    created: bool           # False when an earlier finished run with the same eval_key was found
    url: str | None         # link into the MLflow UI when the tracking URI is an http server
    diagnostics: list[Diagnostic] = field(default_factory=list)


def experiment_name(benchmark: str) -> str:
    """One experiment per benchmark family, e.g. evaldag-math500."""
    return f"{EXPERIMENT_PREFIX}-{benchmark}"


def mlflow_key(name: str) -> str:
    """MLflow metric names allow [A-Za-z0-9_-. /:]; pass@4 becomes pass_at_4."""
    return re.sub(r"[^\w.\- /:]", "_", name.replace("@", "_at_"))


def differing_results(computed: dict, logged: dict) -> list[str]:
    """The result metrics (not timings or other measurements) of `computed` whose value differs from the MLflow
    metrics `logged` for the same evaluation, or that the logged run lacks."""
    from evaldag.metrics import MEASUREMENT_KEYS

    def same(a: float, b: float | None) -> bool:
        return b is not None and (a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                                  or (math.isnan(a) and math.isnan(b)))

    return [k for k, v in computed.items()
            if k not in MEASUREMENT_KEYS and not same(float(v), logged.get(mlflow_key(k)))]


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def preload() -> None:
    """Import the MLflow client now. It is imported where it is used, not with this module: 2-3 s of imports that
    an evaluation flow would otherwise pay before its shards start; the flow calls this while they run instead."""
    import mlflow.entities  # noqa: F401
    import mlflow.tracking  # noqa: F401


def find_run(client, experiment_id: str, eval_key: str):
    """The newest run of the experiment tagged with `eval_key` (a finished one first), or None."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.eval_key = '{eval_key}'",
                              order_by=["attributes.start_time DESC"], max_results=5)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    return (finished or runs or [None])[0]


def _experiment_id(client, name: str) -> str:
    """The experiment's id (get-or-create), marked as a model-training experiment whether new or already there."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
        except Exception:  # created meanwhile by a concurrent evaluation
            exp = client.get_experiment_by_name(name)
    if exp.tags.get(EXPERIMENT_KIND_TAG) != TRAINING_KIND:   # made by an older evaldag or the UI
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return exp.experiment_id


def parent_run(client, train_run: str, requested: str | None = None) -> str:
    """The training job's parent run (get-or-create; a run id the trainer created itself wins).

    Claimed atomically (evaldag.run_claims): evaluations of one job finishing at once on different hosts agree on
    one parent. A parent logged before claims existed (the oldest one) is claimed as it is."""
    if requested:
        return requested
    exp_id = _experiment_id(client, JOBS_EXPERIMENT)

    def legacy() -> str | None:
        runs = client.search_runs([exp_id], filter_string=f"tags.train_run = '{train_run}' and tags.kind = "
                                  "'train_job'", order_by=["attributes.start_time ASC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def candidate() -> str:   # not findable as the job's parent (kind) until it has won the claim
        return client.create_run(exp_id, run_name=train_run,
                                 tags={"train_run": train_run, "kind": "train_job_candidate"}).info.run_id

    run_id, _ = claim_run(client, exp_id, f"train_run:{train_run}", candidate, legacy)
    client.set_tag(run_id, "kind", "train_job")
    return run_id


def evaluated_checkpoints(benchmark: str) -> set[tuple[str, int, str]]:
    """(checkpoint folder, step, settings key) of every finished evaluation of `benchmark`: what the sweeper need
    not redo (evaldag.triggers.evaluated_key builds the same triple from its settings). A run logged before
    settings keys existed has an empty one, so the sweeper evaluates its checkpoint again (from the result store's
    cache when the stages are there)."""
    client = _client()
    exp = client.get_experiment_by_name(experiment_name(benchmark))
    if exp is None:
        return set()
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              max_results=50000)
    return {(r.data.tags.get("checkpoint", ""), int(r.data.tags.get("step", "0")),
             r.data.tags.get(SETTINGS_TAG, "")) for r in runs}


def job_history(client, experiment_id: str, train_run: str, comparison: str | None = None) -> pl.DataFrame:
    """One row per checkpoint of a training job (latest finished run per step): step, accuracy, reward figures.

    With `comparison` (evaldag.series.comparison_key), only the evaluations that measured the same thing: a quick
    slice or another sampling setting is another series, never a point of this one."""
    like = f" and tags.`{COMPARISON_TAG}` = '{comparison}'" if comparison else ""
    runs = client.search_runs([experiment_id], filter_string=f"tags.train_run = '{train_run}' and "
                              f"attributes.status = 'FINISHED'{like}", order_by=["attributes.start_time DESC"],
                              max_results=5000)
    rows, seen = [], set()
    for r in runs:
        m = r.data.metrics
        if "step" not in m or m["step"] in seen or "reward/mean" not in m:
            continue
        seen.add(m["step"])
        rows.append({"step": int(m["step"]), "accuracy": m.get("accuracy"), "reward_mean": m["reward/mean"],
                     "reward_std": m.get("reward/std", float("nan")), "n_samples": m.get("n_samples", 1.0)})
    schema = {"step": pl.Int64, "accuracy": pl.Float64, "reward_mean": pl.Float64, "reward_std": pl.Float64,
              "n_samples": pl.Float64}
    return pl.DataFrame(rows, schema=schema).sort("step")


def history_diagnostics(history: pl.DataFrame, compared: str | None = None) -> list[Diagnostic]:
    """reward fluctuation and accuracy/reward divergence over a job's checkpoints (when there are enough);
    `compared` says in each diagnostic which evaluations were set side by side (evaldag.series.describe)."""
    from dataclasses import replace

    from evaldag.diagnostics import accuracy_reward_divergence, reward_fluctuation

    out = []
    for fn, need in ((reward_fluctuation, 2), (accuracy_reward_divergence, 3)):
        if history.height >= need:
            out.append(fn(history))
        else:
            name = fn.__name__
            out.append(Diagnostic(name, False, f"Needs at least {need} checkpoints of this training job evaluated "
                                  f"alike; {history.height} so far.", "None.", {"n_checkpoints": history.height}))
    if compared:
        out = [replace(d, explanation=f"{d.explanation} Compared: checkpoints {history['step'].to_list()}, each "
                                      f"evaluated on {compared}.", details={**d.details, "compared": compared})
               for d in out]
    return out


def plot_history(history: pl.DataFrame, title: str, out: Path) -> Path:
    """PNG of accuracy and mean reward against step for one training job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["accuracy"], "o-", label="accuracy")
    ax.plot(history["step"], history["reward_mean"], "s--", label="mean reward")
    ax.set_xlabel("training step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def track(plan: EvalPlan, metrics: dict, flow_run_id: str | None = None, lease_s: float | None = None,
          wait_s: float | None = None) -> TrackedRun:
    """Log params, tags, metrics at step, diagnostics, plots and the per-sample parquet into the evaluation's one
    MLflow run (evaldag.run_claims: claimed atomically by eval_key, written by one writer at a time).

    A finished run is returned as it is. An unfinished one is finished by this call when nobody is writing it: it
    was this flow run's own earlier attempt (same `flow_run_id`), or its writer's heartbeat is older than `lease_s`
    (a crash). While another writer is alive this call waits up to `wait_s` (default lease + 30 s) for it to finish,
    then raises TrackingBusy, which the track task retries."""
    client = _client()
    exp_id = _experiment_id(client, experiment_name(plan.benchmark.name))
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    lease_s = lease_seconds() if lease_s is None else lease_s
    owner = flow_run_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    tags = _run_tags(plan, flow_run_id)
    run_id, created, finished = _claim_for_writing(client, exp_id, plan, tags, owner, lease_s,
                                                   lease_s + 30 if wait_s is None else wait_s)
    if finished:
        if flow_run_id:   # so the flow run that found it can find it back (evaldag run prints its metrics)
            _set_tag_best_effort(client, run_id, "prefect.last_flow_run_id", flow_run_id)
        # the settings key as this evaldag computes it: a run tagged by an older definition would otherwise look
        # unevaluated to the sweeper at every sweep
        if client.get_run(run_id).data.tags.get(SETTINGS_TAG) != tags[SETTINGS_TAG]:
            _set_tag_best_effort(client, run_id, SETTINGS_TAG, tags[SETTINGS_TAG])
        _flag_differing_results(client, run_id, metrics, flow_run_id or owner)
        return TrackedRun(run_id, exp_id, False, _url(uri, exp_id, run_id))
    current = client.get_run(run_id)
    writing = _Writing(client, run_id, current_writer(current)[0], int(time.time() * 1000), plan.request.step)
    with keeping_lease(client, run_id, owner, writing.generation, lease_s):
        _log_results(writing, plan, metrics, tags, None if created else current)
        faults.maybe_fail("track")   # a drill: the run exists half-logged; the retry must finish it, not start another
        diags = _log_diagnostics(writing, exp_id, plan, metrics)
        _log_to_parent_run(writing, plan, metrics)
        _log_verdicts(writing, exp_id, plan)
        _log_artifacts(writing, plan)
    if still_writer(client, run_id, owner) is None:   # stalled past the lease, taken over: the new writer finishes
        raise TrackingBusy(f"MLflow run {run_id} was taken over by another writer while this one stalled")
    client.set_terminated(run_id, "FINISHED")
    return TrackedRun(run_id, exp_id, True, _url(uri, exp_id, run_id), diags)


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
    }


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
    }


def _claim_for_writing(client, exp_id: str, plan: EvalPlan, tags: dict[str, str], owner: str, lease_s: float,
                       wait_s: float) -> tuple[str, bool, bool]:
    """Claim the evaluation's run and become its writer unless it is finished: (run id, whether this call created
    it, whether it is finished). Waits up to `wait_s` for a live writer, then raises TrackingBusy."""
    step = plan.request.step

    def candidate() -> str:           # findable by eval_key only once it has won the claim (tags set later)
        rest = {k: v for k, v in tags.items() if k != "eval_key"}
        return client.create_run(exp_id, run_name=f"{plan.train_run}@{step}",
                                 tags={**rest, "evaldag.candidate_for": plan.eval_key}).info.run_id

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


def _log_diagnostics(w: _Writing, exp_id: str, plan: EvalPlan, metrics: dict) -> list[Diagnostic]:
    """The shard test of this evaluation and the job's history including this checkpoint: tags, a markdown
    report and the accuracy/reward-against-step plot."""
    diags: list[Diagnostic] = []
    shard_file = plan.path("diagnostics.json")
    if shard_file.is_file():
        diags.append(Diagnostic(**json.loads(shard_file.read_text())["shard_disagreement"]))
    current = pl.DataFrame([{"step": w.step, "accuracy": metrics["accuracy"], "reward_mean": metrics["reward/mean"],
                             # one sample has no std: an unknown spread makes the fluctuation test see no noise
                             "reward_std": metrics.get("reward/std", float("nan")), "n_samples": metrics["n_samples"]}])
    history = job_history(w.client, exp_id, plan.train_run, comparison_key(plan)).filter(pl.col("step") != w.step)
    history = pl.concat([history, current.cast(history.schema)]).sort("step")
    diags += history_diagnostics(history, describe(plan))
    from evaldag.diagnostics import to_markdown, to_tags

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
    return diags


def _log_to_parent_run(w: _Writing, plan: EvalPlan, metrics: dict) -> None:
    """The training job's parent run gets this benchmark's headline figures at this step."""
    from mlflow.entities import Metric

    parent = parent_run(w.client, plan.train_run, plan.request.mlflow_parent_run_id)
    w.client.set_tag(w.run_id, "evaldag.parent_run_id", parent)
    # one curve per kind of evaluation: math500/accuracy for the benchmark's own settings, math500.limit4/accuracy
    # for quick slices, math500.n8.t0.6/accuracy for a sampled variant...
    series = ".".join(filter(None, (plan.benchmark.name, series_label(plan))))
    w.client.log_batch(parent, metrics=[Metric(mlflow_key(f"{series}/{k}"), float(metrics[k]), w.now_ms, w.step)
                                        for k in HEADLINE if k in metrics])
    w.heartbeat()


def _log_verdicts(w: _Writing, exp_id: str, plan: EvalPlan) -> None:
    """Paired verdicts of this evaluation against the job's previous and best-so-far evaluations with the same
    comparison key, and the request's baseline (evaldag.verdicts.job_verdicts), as tags `verdict.vs_*` and metrics.

    Best effort: the verdicts describe the run, they are not its results, so a failure (a bad margin setting, an
    MLflow hiccup while searching or downloading the earlier samples, an earlier run without samples) is logged as
    a warning and leaves the verdict tags out; the evaluation is still tracked and finished."""
    from evaldag import verdicts

    try:
        margin, alpha = verdicts.verdict_settings()
        with store.local_copy(plan.path("samples.parquet")) as local:
            samples = pl.read_parquet(local, columns=["sample_id", "correct"])
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


def sync(results_root: str | PathLike | None = None) -> list[TrackedRun]:
    """Log every finished evaluation in the result store that MLflow does not have yet (e.g. the tracking server
    was down longer than the track task's retries); returns the runs it created."""
    from evaldag.plan import load_plan

    root = store.as_path(results_root) if results_root is not None else store.root()
    created = []
    for metrics_file in sorted(root.glob("*/*/metrics.json"), key=str):
        plan_file = metrics_file.with_name("plan.json")
        if not plan_file.is_file():
            continue
        try:
            run = track(load_plan(plan_file), json.loads(metrics_file.read_text()))
        except TrackingBusy as e:         # being logged right now by its own evaluation
            log.warning("skipping %s: %s", plan_file, e)
            continue
        if run.created:
            created.append(run)
    return created


# The UI's global "GenAI / Model training" switch starts on GenAI in a fresh browser whatever the experiment's kind;
# links evaldag prints carry the training one so they open on runs and charts.
UI_TRAINING = "workflowType=machine_learning"


def _url(uri: str, exp_id: str, run_id: str) -> str | None:
    if uri.startswith("http"):
        return f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}?{UI_TRAINING}"
    return None


def charts_url(uri: str, exp_id: str) -> str:
    """The MLflow UI's chart view of an experiment: every logged metric against step, one series per run."""
    return f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs?{UI_TRAINING}&compareRunsMode=CHART"


def load_samples(run_id: str) -> pl.DataFrame:
    """Download and read a run's per-sample parquet (for tools and tests)."""
    import mlflow

    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples/samples.parquet")
    return pl.read_parquet(local)


__all__ = ["track", "TrackedRun", "TrackingBusy", "TrackingUnavailable", "charts_url", "experiment_name", "find_run",
           "job_history", "load_samples", "mlflow_key", "HEARTBEAT_TAG"]

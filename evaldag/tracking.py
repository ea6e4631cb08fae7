"""The track stage: one MLflow run per (checkpoint, benchmark), found again by its eval_key.

Logging the same evaluation twice returns the existing finished run instead of creating a second one. Runs carry
the training job (`train_run` tag) and the checkpoint step, so the job's history (earlier checkpoints) can be read
back for the cross-checkpoint diagnostics and the accuracy/reward-vs-step plots. The tracking server comes from
MLFLOW_TRACKING_URI (the local stack exports it to every worker).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

import polars as pl
from mlflow.entities import Metric, Param

from evaldag import faults, store
from evaldag.diagnostics import Diagnostic
from evaldag.plan import EvalPlan

EXPERIMENT_PREFIX = "evaldag"
# One run per training job, holding every benchmark's headline metrics at step = checkpoint step: its chart view
# draws one curve per training job against step. (MLflow nests runs only inside one experiment, so the per-benchmark
# child runs link to it with the tag evaldag.parent_run_id instead.)
JOBS_EXPERIMENT = f"{EXPERIMENT_PREFIX}-train-runs"
HEADLINE = ("accuracy", "pass@1", "reward/mean", "truncation_rate", "mean_completion_tokens")


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


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def find_run(client, experiment_id: str, eval_key: str):
    """The newest run of the experiment tagged with `eval_key` (a finished one first), or None."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.eval_key = '{eval_key}'",
                              order_by=["attributes.start_time DESC"], max_results=5)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    return (finished or runs or [None])[0]


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # created meanwhile by a concurrent evaluation
        return client.get_experiment_by_name(name).experiment_id


def parent_run(client, train_run: str, requested: str | None = None) -> str:
    """The training job's parent run (get-or-create; a run id the trainer created itself wins).

    Two evaluations finishing at once may both create one; both then keep the oldest and the newer is deleted, so
    a job ends with exactly one parent.
    """
    if requested:
        return requested
    exp_id = _experiment_id(client, JOBS_EXPERIMENT)
    filt = f"tags.train_run = '{train_run}' and tags.kind = 'train_job'"

    def oldest():
        return client.search_runs([exp_id], filter_string=filt, order_by=["attributes.start_time ASC"],
                                  max_results=10)

    runs = oldest()
    if runs:
        return runs[0].info.run_id
    mine = client.create_run(exp_id, run_name=train_run, tags={"train_run": train_run, "kind": "train_job"})
    runs = oldest()
    if runs and runs[0].info.run_id != mine.info.run_id:
        client.delete_run(mine.info.run_id)
        return runs[0].info.run_id
    return mine.info.run_id


def evaluated_checkpoints(benchmark: str) -> set[tuple[str, int]]:
    """(checkpoint folder, step) of every finished evaluation of `benchmark` (what the sweeper need not redo)."""
    client = _client()
    exp = client.get_experiment_by_name(experiment_name(benchmark))
    if exp is None:
        return set()
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              max_results=50000)
    return {(r.data.tags.get("checkpoint", ""), int(r.data.tags.get("step", "0"))) for r in runs}


def job_history(client, experiment_id: str, train_run: str) -> pl.DataFrame:
    """One row per checkpoint of a training job (latest finished run per step): step, accuracy, reward figures."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.train_run = '{train_run}' and "
                              "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
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


def history_diagnostics(history: pl.DataFrame) -> list[Diagnostic]:
    """reward fluctuation and accuracy/reward divergence over a job's checkpoints (when there are enough)."""
    from evaldag.diagnostics import accuracy_reward_divergence, reward_fluctuation

    out = []
    for fn, need in ((reward_fluctuation, 2), (accuracy_reward_divergence, 3)):
        if history.height >= need:
            out.append(fn(history))
        else:
            name = fn.__name__
            out.append(Diagnostic(name, False, f"Needs at least {need} checkpoints of this training job; "
                                  f"{history.height} so far.", "None.", {"n_checkpoints": history.height}))
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


def track(plan: EvalPlan, metrics: dict, flow_run_id: str | None = None) -> TrackedRun:
    """Log params, tags, metrics at step, diagnostics, plots and the per-sample parquet; get-or-create by eval_key.

    Two identical evaluations finishing at once would both find no run and both create one, so the whole
    get-or-create-and-log holds the evaluation's lock (store.lock): the second waits, then finds the first's
    finished run."""
    with store.lock(plan.path("mlflow-run")):
        return _track(plan, metrics, flow_run_id)


def _track(plan: EvalPlan, metrics: dict, flow_run_id: str | None) -> TrackedRun:
    client = _client()
    name = experiment_name(plan.benchmark.name)
    exp_id = _experiment_id(client, name)
    existing = find_run(client, exp_id, plan.eval_key)
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if existing is not None and existing.info.status == "FINISHED":
        if flow_run_id:   # so the flow run that found it can find it back (evaldag run prints its metrics)
            client.set_tag(existing.info.run_id, "prefect.last_flow_run_id", flow_run_id)
        return TrackedRun(existing.info.run_id, exp_id, False, _url(uri, exp_id, existing.info.run_id))
    model = plan.resolved_model
    step = plan.request.step
    tags = {
        "eval_key": plan.eval_key,
        "benchmark": plan.benchmark.name,
        "model": model.name,
        "checkpoint": model.path,
        "train_run": plan.train_run,
        "step": f"{step:012d}",        # zero-padded: MLflow compares tags as strings
        "dataset_hash": plan.dataset_hash,
        "prefect.flow_run_id": flow_run_id or "",
        "kind": "ckpt_eval",
    }
    if existing is not None:           # an earlier attempt died while logging: finish that run instead
        run_id = existing.info.run_id
    else:
        run_id = client.create_run(exp_id, run_name=f"{plan.train_run}@{step}", tags=tags).info.run_id
    params = {
        "model": model.name, "checkpoint": model.path, "model_fingerprint": model.fingerprint[:16],
        "engine": model.engine, "dtype": model.dtype, "batch_size": model.batch_size,
        "num_shards": plan.num_shards, "n_problems": plan.n_problems, "limit": plan.request.limit,
        "dataset_source": plan.dataset_source, "gold_format": plan.benchmark.gold_format,
        "pipeline_version": plan.pipeline_version, "grader_version": plan.grader_version,
        "pass_k": ",".join(map(str, plan.pass_k)), "train_run": plan.train_run,
        "rewards": json.dumps([r.model_dump() for r in plan.benchmark.rewards]),
        "reference": plan.resolved_reference.path if plan.reference else None,
        **{f"sampling.{k}": v for k, v in plan.sampling.model_dump().items()},
    }
    # MLflow refuses to overwrite a param, so a resumed run logs only the params it does not have yet.
    logged = set(existing.data.params) if existing is not None else set()
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(mlflow_key(k), float(v), now, step) for k, v in {**metrics, "step": step}.items()],
        params=[Param(k, str(v)) for k, v in params.items() if k not in logged],
        tags=[],
    )
    for k, v in tags.items():
        client.set_tag(run_id, k, v)
    faults.maybe_fail("track")   # a drill: the run exists half-logged; the retry must finish it, not start another

    # Diagnostics: the shard test of this evaluation, and the job's history including this checkpoint.
    diags: list[Diagnostic] = []
    shard_file = plan.path("diagnostics.json")
    if shard_file.is_file():
        diags.append(Diagnostic(**json.loads(shard_file.read_text())["shard_disagreement"]))
    current = pl.DataFrame([{"step": step, "accuracy": metrics["accuracy"], "reward_mean": metrics["reward/mean"],
                             # one sample has no std: an unknown spread makes the fluctuation test see no noise
                             "reward_std": metrics.get("reward/std", float("nan")), "n_samples": metrics["n_samples"]}])
    history = job_history(client, exp_id, plan.train_run).filter(pl.col("step") != step)
    history = pl.concat([history, current.cast(history.schema)]).sort("step")
    diags += history_diagnostics(history)
    from evaldag.diagnostics import to_markdown, to_tags

    for k, v in to_tags(diags).items():
        client.set_tag(run_id, k, v)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "diagnostics.md"
        report.write_text(to_markdown(diags))
        client.log_artifact(run_id, str(report), artifact_path="diagnostics")
        png = plot_history(history, f"{plan.train_run} on {plan.benchmark.name}",
                           Path(tmp) / f"{plan.benchmark.name}_vs_step.png")
        client.log_artifact(run_id, str(png), artifact_path="plots")
    # the training job's parent run: this benchmark's headline figures at this step
    parent = parent_run(client, plan.train_run, plan.request.mlflow_parent_run_id)
    client.set_tag(run_id, "evaldag.parent_run_id", parent)
    bench = plan.benchmark.name
    client.log_batch(parent, metrics=[Metric(mlflow_key(f"{bench}/{k}"), float(metrics[k]), now, step)
                                      for k in HEADLINE if k in metrics])
    for name, folder in (("samples.parquet", "samples"), ("plan.json", "config"), ("metrics.json", "config")):
        with store.local_copy(plan.path(name)) as local:
            client.log_artifact(run_id, str(local), artifact_path=folder)
    client.set_terminated(run_id, "FINISHED")
    return TrackedRun(run_id, exp_id, True, _url(uri, exp_id, run_id), diags)


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
        run = track(load_plan(plan_file), json.loads(metrics_file.read_text()))
        if run.created:
            created.append(run)
    return created


def _url(uri: str, exp_id: str, run_id: str) -> str | None:
    if uri.startswith("http"):
        return f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
    return None


def load_samples(run_id: str) -> pl.DataFrame:
    """Download and read a run's per-sample parquet (for tools and tests)."""
    import mlflow

    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples/samples.parquet")
    return pl.read_parquet(local)


__all__ = ["track", "TrackedRun", "experiment_name", "find_run", "job_history", "load_samples", "mlflow_key"]

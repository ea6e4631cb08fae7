"""A training job's history, read back from MLflow: which checkpoints are evaluated already (the sweeper's lookup),
the job's evaluations one row per step, and the cross-checkpoint diagnostics and plot the track stage draws from it.
"""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl

from evaldag.scoring.diagnostics import Diagnostic
from evaldag.tracking import client as tracking_client
from evaldag.tracking.names import (COMPARISON_TAG, SETTINGS_TAG, UNDECIDED_SETTINGS_TAG, experiment_name,
                                    full_first)


def evaluated_checkpoints(benchmark: str, decided_counts: bool = True) -> set[tuple[str, int, str]]:
    """(checkpoint folder, step, settings key) of every finished evaluation of `benchmark`: what the sweeper need
    not redo (evaldag.events.identity.evaluated_key builds the same triple from its settings). A run logged before
    settings keys existed has an empty one, so the sweeper evaluates its checkpoint again (from the result store's
    cache when the stages are there). An evaluation that asked for a sequential verdict (decide, stopped early or
    not) also counts under the key of the same evaluation without it, the full one it stands for, unless
    `decided_counts` is False (a sweep that wants every checkpoint evaluated in full)."""
    client = tracking_client.mlflow_client()
    exp = client.get_experiment_by_name(experiment_name(benchmark))
    if exp is None:
        return set()
    runs = tracking_client.all_runs(client, [exp.experiment_id], filter_string="attributes.status = 'FINISHED'")
    tags = (SETTINGS_TAG, UNDECIDED_SETTINGS_TAG) if decided_counts else (SETTINGS_TAG,)
    return {(r.data.tags.get("checkpoint", ""), int(r.data.tags.get("step", "0")), r.data.tags.get(tag, ""))
            for r in runs for tag in tags if tag == SETTINGS_TAG or tag in r.data.tags}


_HISTORY_SCHEMA = {"step": pl.Int64, "accuracy": pl.Float64, "reward_mean": pl.Float64, "reward_std": pl.Float64,
                   "n_samples": pl.Float64, "accuracy_se": pl.Float64, "reward_se": pl.Float64,
                   "eval_loss": pl.Float64}


def _history_rows(runs) -> dict[str, list[dict]]:
    """Per training job, one row per step from `runs` (newest first: the latest finished run per step wins, and a
    full evaluation wins over one that stopped early, evaldag.decisions.decide)."""
    rows: dict[str, list[dict]] = {}
    seen: set[tuple[str, float]] = set()
    for r in full_first(runs):
        m, job = r.data.metrics, r.data.tags.get("train_run", "")
        if "step" not in m or (job, m["step"]) in seen or "reward/mean" not in m:
            continue
        seen.add((job, m["step"]))
        rows.setdefault(job, []).append(history_row(int(m["step"]), m))
    return rows


def history_row(step: int, m: dict) -> dict:
    """One checkpoint's row of a job's history from its metrics (as logged: "reward/mean", ...). Standard errors
    are the run's own where it logged one (adaptive samples: its estimate's, and the reward's over the first
    round), else those of n_samples independent samples; one sample has no std, and an unknown spread makes the
    fluctuation test see no noise."""
    n, accuracy, std = m.get("n_samples", 1.0), m.get("accuracy"), m.get("reward/std", float("nan"))
    binomial = math.sqrt(accuracy * (1 - accuracy) / n) if accuracy is not None else float("nan")
    return {"step": step, "accuracy": accuracy, "reward_mean": m["reward/mean"], "reward_std": std, "n_samples": n,
            "accuracy_se": m.get("accuracy_se", binomial), "reward_se": m.get("reward/se", std / math.sqrt(n)),
            "eval_loss": m.get("eval_loss")}


def job_history(client, experiment_id: str, train_run: str, comparison: str | None = None) -> pl.DataFrame:
    """One row per checkpoint of a training job (latest finished run per step): step, accuracy, reward figures.

    With `comparison` (evaldag.decisions.series.comparison_key), only the evaluations that measured the same thing: a quick
    slice or another sampling setting is another series, never a point of this one."""
    like = f" and tags.`{COMPARISON_TAG}` = '{comparison}'" if comparison else ""
    runs = tracking_client.all_runs(client, [experiment_id], filter_string=f"tags.train_run = '{train_run}' and "
                                    f"attributes.status = 'FINISHED'{like}", order_by=["attributes.start_time DESC"])
    rows = [row for job_rows in _history_rows(runs).values() for row in job_rows]
    return pl.DataFrame(rows, schema=_HISTORY_SCHEMA).sort("step")


def comparable_histories(client, experiment_id: str, comparison: str) -> dict[str, pl.DataFrame]:
    """`job_history` of every training job with evaluations of comparison key `comparison`, by job: what a job
    can be compared with at the same step (evaldag.forecast.falling_behind)."""
    runs = tracking_client.all_runs(client, [experiment_id], filter_string=f"tags.`{COMPARISON_TAG}` = "
                                    f"'{comparison}' and attributes.status = 'FINISHED'",
                                    order_by=["attributes.start_time DESC"])
    return {job: pl.DataFrame(rows, schema=_HISTORY_SCHEMA).sort("step")
            for job, rows in _history_rows(runs).items() if job}


def history_diagnostics(history: pl.DataFrame, compared: str | None = None) -> list[Diagnostic]:
    """reward fluctuation and accuracy/reward divergence over a job's checkpoints (when there are enough);
    `compared` says in each diagnostic which evaluations were set side by side (evaldag.decisions.series.describe)."""
    from dataclasses import replace

    from evaldag.scoring.diagnostics import accuracy_reward_divergence, reward_fluctuation

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


def _problem_losses(samples: pl.DataFrame) -> pl.DataFrame | None:
    """One row per problem (sample_id, loss) from a samples.parquet table, None when it has no eval_loss."""
    if "eval_loss" not in samples.columns or samples["eval_loss"].null_count() == samples.height:
        return None
    return samples.group_by("sample_id").agg(loss=pl.col("eval_loss").first())


def _run_losses(client, run_id: str) -> pl.DataFrame | None:
    """_problem_losses of another run's samples/samples.parquet artifact."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, "samples/samples.parquet", tmp)
        names = pl.read_parquet_schema(local)
        return _problem_losses(pl.read_parquet(local, columns=[c for c in ("sample_id", "eval_loss") if c in names]))


def eval_loss_diagnostics(client, experiment_id: str, train_run: str, comparison: str, step: int,
                          samples: Path) -> list[Diagnostic]:
    """evaldag.scoring.diagnostics.eval_loss_jump between this evaluation (its samples.parquet, with each problem's
    eval_loss) and the job's previous checkpoint evaluated alike (the latest earlier step, its samples from MLflow);
    nothing when this evaluation has no eval_loss. It tests the jump into this checkpoint only: each run's tag says
    whether its own arrival jumped, at the cost of one download instead of one per checkpoint of the job.

    Best effort: the earlier run's artifact may be unreadable; the diagnostic then says so, unfired."""
    from evaldag.decisions.verdicts import earlier_evaluations
    from evaldag.scoring.diagnostics import eval_loss_jump

    name = "eval_loss_jump"
    mine = _problem_losses(pl.read_parquet(samples, columns=[c for c in ("sample_id", "eval_loss")
                                                              if c in pl.read_parquet_schema(samples)]))
    if mine is None:
        return []
    earlier = earlier_evaluations(client, experiment_id, train_run, comparison, step)
    if not earlier:
        return [Diagnostic(name, False, "Needs an earlier checkpoint of this training job evaluated alike; none so "
                           "far.", "None.", {"n_checkpoints": 1})]
    prev = earlier[-1]
    try:
        theirs = _run_losses(client, prev["run_id"])
    except Exception as e:  # noqa: BLE001 - a diagnostic of the job, not this evaluation's result
        theirs, why = None, f"its samples could not be read ({type(e).__name__}: {e})"
    else:
        why = "it has no eval_loss"
    if theirs is None:
        return [Diagnostic(name, False, f"Not tested: the previous checkpoint (step {prev['step']}) {why}.", "None.",
                           {"step_from": prev["step"]})]
    table = pl.concat([theirs.with_columns(step=pl.lit(prev["step"], pl.Int64)),
                       mine.with_columns(step=pl.lit(step, pl.Int64))]).select("step", "sample_id", "loss")
    return [eval_loss_jump(table)]


def plot_history(history: pl.DataFrame, title: str, out: Path) -> Path:
    """PNG of accuracy and mean reward against step for one training job, and its eval_loss on a right-hand axis
    where checkpoints have one (nats per token: another scale than the rates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["accuracy"], "o-", label="accuracy")
    ax.plot(history["step"], history["reward_mean"], "s--", label="mean reward")
    ax.set_xlabel("training step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    losses = history.filter(pl.col("eval_loss").is_not_null()) if "eval_loss" in history.columns else history.clear()
    if losses.height:
        right = ax.twinx()
        right.plot(losses["step"], losses["eval_loss"], "^:", color="tab:red", label="eval_loss")
        right.set_ylabel("eval_loss (nats/token)")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


__all__ = ["comparable_histories", "eval_loss_diagnostics", "evaluated_checkpoints", "history_diagnostics",
           "job_history", "plot_history"]

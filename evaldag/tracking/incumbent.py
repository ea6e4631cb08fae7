"""The evaluations a sequential verdict compares with (evaldag.decisions.decide): every candidate for the training job's
best checkpoint so far on the same comparison key (the verdict is about the best of them, its selection accounted
for), read from MLflow before the shards start."""

from __future__ import annotations

import polars as pl

from evaldag.request.plan import EvalPlan
from evaldag.decisions.series import comparison_key
from evaldag.tracking import client as tracking_client
from evaldag.tracking.names import experiment_name


def best_so_far(plan: EvalPlan) -> tuple[list[pl.DataFrame], str] | None:
    """(per-problem scores: sample_id, n, score, of every candidate for the job's best at an earlier step with the
    same comparison key (evaldag.decisions.best.candidates); the label JOB@STEP of the best of them
    (evaldag.decisions.best.references)), or None when the job has none yet. All candidates, not the best alone:
    the best was picked on these problems, and a verdict against it alone errs in its favour (docs/statistics.md)."""
    from evaldag.decisions import best as job_best, verdicts

    client = tracking_client.mlflow_client()
    experiment = client.get_experiment_by_name(experiment_name(plan.benchmark.name))
    if experiment is None:
        return None
    earlier = verdicts.earlier_evaluations(client, experiment.experiment_id, plan.train_run, comparison_key(plan),
                                           plan.request.step)
    best = job_best.references(earlier).get("best")
    if best is None:
        return None
    scores = [verdicts.per_problem_scores(verdicts.download_samples(client, e["run_id"]))
              for e in job_best.candidates(earlier)]
    return scores, best["label"]


__all__ = ["best_so_far"]

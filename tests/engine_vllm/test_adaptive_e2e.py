"""Adaptive samples through the real stack on the vLLM engine (evaldag.request.second_round): a first round of n0
samples of every problem, a second round where the parent planned it, one MLflow run with the adaptive
estimate; the same evaluation again launches nothing."""

from __future__ import annotations

import polars as pl
import pytest
from mlflow import MlflowClient
from prefect.deployments import run_deployment

from cluster_helpers import children, progress_artifacts
from evaldag.storage import store
from evaldag.request.plan import load_plan
from evaldag.request.second_round import second_round_path
from evaldag.tracking.samples import load_samples

pytestmark = [pytest.mark.stack, pytest.mark.model]

N0, FLOOR, BUDGET = 4, 2, 60
# one shard per round: the stage tests (tests/test_second_round.py) cover a first round split over shards; each shard
# run here pays a process start and an engine load
PARAMS = {"limit": 6, "num_shards": 1, "step": 3, "train_run": "adaptive-e2e", "engine": "vllm",
          "sampling": {"max_new_tokens": 24, "temperature": 1.0, "seed": 5},
          "adaptive": {"n0": N0, "floor": FLOOR, "budget": BUDGET}}


def _evaluate():
    fr = run_deployment("eval/gsm8k", timeout=900, poll_interval=1, parameters=PARAMS)
    assert fr.state.is_completed(), fr.state.message
    return fr, fr.state.result()


def test_an_adaptive_evaluation_draws_a_second_round_and_logs_its_estimate(live_stack):
    fr, summary = _evaluate()
    plan = load_plan(store.root() / "gsm8k" / summary["eval_key"][:24] / "plan.json")
    second = load_plan(second_round_path(plan))
    assert plan.sampling.n == N0 and plan.num_shards == 1

    samples = load_samples(summary["mlflow_run_id"])
    per_problem = samples.group_by("sample_id").agg(n=pl.len(), top=pl.col("sample_index").max(),
                                                    first=pl.col("correct").filter(pl.col("sample_index") < N0).sum())
    assert per_problem.height == 6 and (per_problem["top"] == per_problem["n"] - 1).all()    # indices 0..n-1
    assert samples.select("sample_id", "sample_index").is_unique().all()
    certain = per_problem.filter((pl.col("first") == 0) | (pl.col("first") == N0))
    assert (certain["n"] == N0 + FLOOR).all(), certain           # all wrong or all right at first: the floor only
    assert (per_problem["n"] >= N0 + FLOOR).all() and samples.height <= BUDGET
    planned = sum(count for runs in second.sample_runs for _, count in runs)
    assert samples.height == 6 * N0 + planned == summary["metrics"]["n_samples"]

    # the first round's shard run, then the second round's; every one completed
    shards = children(fr.id)
    assert len(shards) == 1 + second.num_shards and all(r.state.is_completed() for r in shards)
    texts = [a.description for a in progress_artifacts([fr.id])]
    assert any(t.startswith("evaluation of gsm8k (second round): ") for t in texts), texts
    # each round's shards report under their own name, so `evaldag run` sums both rounds instead of mixing them
    labels = {a.description.split(":")[0] for a in progress_artifacts([r.id for r in shards])}
    assert labels == {"gsm8k shard 0", *(f"gsm8k/round-2 shard {s}" for s in range(second.num_shards))}
    assert sorted("evaldag-round-2" in r.tags for r in shards) == [False] + [True] * second.num_shards

    run = MlflowClient().get_run(summary["mlflow_run_id"])
    assert run.data.params["adaptive.budget"] == str(BUDGET) and run.data.params["sampling.n"] == str(N0)
    m = run.data.metrics
    assert m["accuracy_ci_low"] <= m["accuracy"] <= m["accuracy_ci_high"]
    assert "problem_score" in samples.columns     # what paired verdicts compare per problem
    assert m["adaptive_set_ci_width"] > 0 and m["adaptive_samples"] == samples.height
    # the first round's avg@n0 is its own figure, beside the estimate
    first_round = samples.filter(pl.col("sample_index") < N0)
    assert m[f"avg_at_{N0}"] == pytest.approx(first_round["correct"].cast(pl.Float64).mean())

    # the same evaluation again: every round's shards found in the store, the same MLflow run
    again, again_summary = _evaluate()
    assert not children(again.id)
    assert again_summary["mlflow_run_id"] == summary["mlflow_run_id"]
    assert again_summary["metrics"]["accuracy"] == summary["metrics"]["accuracy"]

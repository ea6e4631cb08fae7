"""Sequential stopping through the real stack on the vLLM engine (evaldag.decisions.decide): a checkpoint as good as the job's
best stops early as `equivalent`, logged as such in MLflow and shown in the Prefect UI; the rows it generated are
reused by the full evaluation that follows, and running the decided evaluation again launches nothing."""

from __future__ import annotations

import json

import polars as pl
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from cluster_helpers import children
from evaldag.storage import store
from evaldag.decisions.decide import decision_order
from evaldag.request.plan import load_plan
from evaldag.tracking.samples import load_samples

pytestmark = [pytest.mark.stack, pytest.mark.model]

JOB = "decide-e2e"
# greedy: the same weights at the next step answer as the best so far, a difference of 0 on every problem. The
# t interval of the round would be +-q/t at t problems (+-0.45 at 8), but `equivalent` also needs the interval for
# rare, one-sided differences (sequential.rare_interval: a bound on E[d^2] valid for bounded data), which with no
# differing problem is within the margin 0.5 only from the round end 16 (a round every 4 of the 60 problems, 15
# looks, Pocock's boundary); with 4 requests in flight (conftest) the shard still has rounds of requests left when
# the decision reaches it. One
SETTINGS = {"limit": 60, "num_shards": 1, "train_run": JOB, "engine": "vllm", "sampling": {"max_new_tokens": 96}}
DECIDE = {"decide": "vs_best", "decide_margin": 0.5, "decide_rounds": 15}
# Step 2 is the same weights, so with the same settings its generations would be step 1's, found in the store and
# not generated at all. Another seed makes them a generation of their own (greedy: the same answers), still
# comparable with step 1 (the seed only moves the noise: evaldag.decisions.series)
STEP2 = {"sampling": {"max_new_tokens": 96, "seed": 1}}


def _evaluate(step: int, **extra):
    fr = run_deployment("eval/gsm8k", timeout=900, poll_interval=1, parameters={**SETTINGS, "step": step, **extra})
    assert fr.state.is_completed(), fr.state.message
    return fr, fr.state.result()


def _plan(summary):
    return load_plan(store.root() / "gsm8k" / summary["eval_key"][:24] / "plan.json")


def test_an_equivalent_checkpoint_stops_early_and_its_rows_serve_the_full_evaluation(live_stack):
    _evaluate(1)                                                       # the job's best so far
    fr, summary = _evaluate(2, **STEP2, **DECIDE)
    plan = _plan(summary)
    order = decision_order(plan.sample_ids(), plan.sampling.seed)

    client = MlflowClient()
    run = client.get_run(summary["mlflow_run_id"])
    tags, metrics = run.data.tags, run.data.metrics
    assert tags["decide.status"] == "stopped" and tags["decide.verdict"] == "equivalent", tags
    assert tags["decide.vs"] == f"{JOB}@1"
    problems = int(metrics["decide.problems"])
    assert problems == 16, metrics          # the round end 16 (4, 8, 12, 16, ...): see the settings' comment
    assert metrics["decide.pairs"] == problems and metrics["decide.n_problems"] == 60
    assert metrics["decide.ci_low"] >= -0.5 and metrics["decide.ci_high"] <= 0.5
    figures = {k: v for k, v in metrics.items() if k.startswith("decide.")}
    assert metrics["decide.tokens_saved_est"] > 0 and metrics["decide.tokens_generated"] > 0, json.dumps(figures)
    # the metrics are those of exactly the prefix of the decision order
    samples = load_samples(run.info.run_id)
    assert metrics["n_samples"] == problems and sorted(samples["sample_id"]) == sorted(order[:problems])

    # the shards stopped before their end: no generations file, their rows kept in chunks
    shards = children(fr.id)
    assert len(shards) == 1 and all(r.state.is_completed() for r in shards)
    kept = {}
    for s in range(plan.num_shards):
        assert not plan.generations_path(s).exists()
        chunks = plan.generations_path(s).with_name(plan.generations_path(s).stem + ".chunks")
        for path in chunks.glob("*.parquet"):
            kept.update(dict(pl.read_parquet(path).select("sample_id", "completion").iter_rows()))
    assert set(order[:problems]) <= set(kept) and len(kept) < 60, len(kept)
    # the Prefect UI shows the stop: an artifact of the evaluation's flow run
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts()
    [shown] = [a for a in artifacts if a.key == "decide-gsm8k" and a.flow_run_id == fr.id]
    assert f"equivalent after {problems} of 60 problems" in shown.data and "stopped early" in shown.data

    # the decided evaluation again: its decision is kept, nothing is launched, the same MLflow run
    again, again_summary = _evaluate(2, **STEP2, **DECIDE)
    assert not children(again.id) and again_summary["mlflow_run_id"] == summary["mlflow_run_id"]

    # the full evaluation of the same checkpoint generates only what the stopped one did not
    _, full = _evaluate(2, **STEP2)
    full_plan = _plan(full)
    assert full_plan.generation_key == plan.generation_key
    resumed = sum(json.loads(full_plan.stats_path("generate", s).read_text())["resumed_problems"]
                  for s in range(full_plan.num_shards))
    assert resumed == len(kept)
    full_samples = load_samples(full["mlflow_run_id"])
    assert full_samples.height == 60
    reused = dict(full_samples.filter(pl.col("sample_id").is_in(list(kept))).select("sample_id", "completion")
                  .iter_rows())
    assert reused == kept

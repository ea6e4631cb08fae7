"""Nothing undoes what stopping early saved (issue 37 item 5): the sweeper counts a decided evaluation as done for its
checkpoint, decide settings with their defaults spelled out are the same request, and metrics.json holds the
decision's figures the MLflow run gets, so `evaldag sync` logs the same run."""

from __future__ import annotations

import json

import polars as pl
import pytest
import test_stages
from test_keys import _keys
from test_plan import KeyWorld

from evaldag.decisions.decide import Decider, Decision, decision_order
from evaldag.events.identity import evaluated_key
from evaldag.pipeline.grade import grade_rows
from evaldag.pipeline.reduce import reduce_results
from evaldag.request.plan import EvalRequest, resolve
from evaldag.storage.schema import GENERATION_SCHEMA, GRADED_SCHEMA, write_table

setup = test_stages.setup      # the stand-in engine's fixture


def test_decide_with_its_defaults_spelled_out_is_the_same_request(tmp_path, monkeypatch):
    """Before: decide="vs_best" and the same request naming alpha 0.05, margin 0.02 and 10 rounds (the documented
    defaults) had two settings keys and eval_keys: two evaluations, two MLflow runs."""
    w = KeyWorld(tmp_path, monkeypatch)
    plain = _keys(w, decide="vs_best")
    assert _keys(w, decide="vs_best", decide_alpha=0.05, decide_margin=0.02, decide_rounds=10) == plain
    assert plain["tracked settings"] == plain["sweeper settings"]
    other = _keys(w, decide="vs_best", decide_alpha=0.1)
    assert other["eval"] != plain["eval"] and other["sweeper settings"] != plain["sweeper settings"]
    assert _keys(w, decide_alpha=0.1) == _keys(w)              # without decide, its settings mean nothing


def test_the_sweeper_counts_a_decided_evaluation_as_done_unless_asked_for_the_full_one(tmp_path, monkeypatch,
                                                                                       mlflow_store):
    from mlflow import MlflowClient

    from evaldag.tracking import history, write
    from evaldag.tracking.parent_runs import ensure_experiment
    from evaldag.tracking.names import experiment_name

    w = KeyWorld(tmp_path, monkeypatch)
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(w.ckpt), step=100, limit=3, num_shards=1,
                               decide="vs_best"), w.results)
    client = MlflowClient()
    exp_id = ensure_experiment(client, experiment_name("aime24"))
    run = client.create_run(exp_id, tags=write._run_tags(plan, None))       # tagged as track() tags it
    client.set_terminated(run.info.run_id, "FINISHED")
    sweeper = evaluated_key(w.ckpt, 100, "aime24", {"limit": 3, "num_shards": 1})   # the sweeper asks no decide
    assert sweeper in history.evaluated_checkpoints("aime24")
    assert sweeper not in history.evaluated_checkpoints("aime24", decided_counts=False)
    decided = evaluated_key(w.ckpt, 100, "aime24", {"limit": 3, "num_shards": 1, "decide": "vs_best"})
    assert decided in history.evaluated_checkpoints("aime24", decided_counts=False)


def _rows(plan, sample_ids, text):
    inputs = plan.inputs().filter(pl.col("sample_id").is_in(sample_ids))
    return pl.DataFrame([{**r, "sample_index": k, "shard_index": 0, "completion": text(r), "completion_ids": [1],
                          "prompt_tokens": 5, "completion_tokens": 10, "finish_reason": "stop", "latency_s": 0.1,
                          "batch_size": 1} for r in inputs.to_dicts() for k in range(plan.sampling.n)],
                        schema=GENERATION_SCHEMA)


def test_metrics_json_holds_the_decisions_figures(setup):
    """Before: decide.* were merged into the metrics in the flow's memory after metrics.json was written, so sync
    logged a stopped evaluation without them."""
    ckpt, _, results = setup
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=30, num_shards=1, decide="vs_best"),
                   results)
    prefix = decision_order(plan.sample_ids(), plan.sampling.seed)[:10]
    graded = grade_rows(plan, _rows(plan, prefix, lambda r: "The answer is \\boxed{-12345}."))
    path = plan.path("decide/graded-prefix.parquet")
    write_table(graded, path, GRADED_SCHEMA)
    decision = Decision("stopped", verdict="worse", vs="job@1", problems=10, n_problems=30, pairs=10, diff=-1.0,
                        ci_low=-1.0, ci_high=-0.5, tokens_generated=100, tokens_full_est=300, prefix=prefix)
    decision.save(plan)           # as the parent saves it when it stops the shards
    reduce_results(plan, [str(path)], prefix)
    written = json.loads(plan.path("metrics.json").read_text())
    expected = decision.metrics()
    assert {"decide.stopped", "decide.problems", "decide.diff", "decide.tokens_saved_est"} <= set(expected)
    assert {k: written.get(k) for k in expected} == pytest.approx(expected)
    assert written["decide.problems"] == 10 and written["decide.tokens_saved_est"] == 200


def test_an_evaluation_that_ran_to_the_end_has_its_decision_in_metrics_json(setup):
    """The flow's path for an evaluation no round decided: the final decision from the shards' graded files, saved
    before the reduce, which writes it into metrics.json."""
    from flows.eval_flow import final_decision

    ckpt, _, results = setup
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=6, num_shards=1, decide="vs_best",
                               decide_rounds=3), results)
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    golds = dict(plan.inputs().select("sample_id", "gold").iter_rows())
    graded = grade_rows(plan, _rows(plan, order, lambda r: f"The answer is \\boxed{{{golds[r['sample_id']]}}}."))
    path = plan.path("graded-0.parquet")
    write_table(graded, path, GRADED_SCHEMA)
    incumbent = pl.DataFrame({"sample_id": order, "n": [1] * 6, "score": [1.0] * 6})
    decision = final_decision(Decider(plan, incumbent, "job@1", lambda rows: grade_rows(plan, rows)),
                              [str(path)])
    # by hand: all six solved by both, d = 0 on six problems: too few to call anything, 6 of 6 problems
    assert (decision.status, decision.verdict, decision.problems, decision.diff) == ("completed", "undecided", 6, 0.0)
    decision.save(plan)
    metrics = reduce_results(plan, [str(path)])
    written = json.loads(plan.path("metrics.json").read_text())
    assert written["decide.problems"] == 6 and written["decide.stopped"] == 0.0 and written["accuracy"] == 1.0
    assert metrics == pytest.approx(written)

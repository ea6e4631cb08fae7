"""Small benchmarks (issue 54 item 5): on AIME24's 30 problems and AMC23's 40, decide's default settings (margin
0.02, ten rounds) cannot reach `equivalent` whatever the answers; decide says so in words before any shard starts
and keeps the statement with its verdict (evaldag.decisions.reach). Simulated error rates: bench/bench_small.py."""

from __future__ import annotations

import logging

import numpy as np
import polars as pl
import pytest

from conftest import complete_checkpoint
from evaldag.decisions import reach as reach_module
from evaldag.decisions.decide import Decider, Decision, decision_order, round_ends
from evaldag.decisions.reach import planned_reach, reach_note
from evaldag.decisions.sequential import sequential_verdict
from evaldag.decisions.verdicts import logged_verdict_lines
from evaldag.pipeline.grade import grade_rows
from evaldag.request.plan import DEFAULT_ROUNDS, EvalRequest, resolve

DEFAULTS = dict(rounds=DEFAULT_ROUNDS, alpha=0.05, margin=0.02)


@pytest.mark.parametrize("name, problems", [("aime24", 30), ("amc23", 40)])
def test_at_decides_defaults_equivalent_is_out_of_reach_and_said_so(name, problems):
    found = planned_reach(problems, **DEFAULTS)
    assert not found.equivalent_reachable and found.equivalent_margin > 0.1
    text = found.statement(name, DEFAULT_ROUNDS)
    # the benchmark's size, the margin asked, the smallest margin it could show, the smallest differences, the fixes
    for part in (f"{name} gives {problems} problems", "margin 0.02", f"{found.equivalent_margin:.3f}",
                 f"{found.worse_difference * 100:.1f} points", "--decide-margin", "decide_rounds 2",
                 "a larger benchmark", "no decide"):
        assert part in text, (part, text)
    # the margin it suggests is one at which `equivalent` is within reach
    suggested = float(text.split("use a margin of ")[1].split(" ")[0])
    assert planned_reach(problems, DEFAULT_ROUNDS, 0.05, suggested).equivalent_reachable


@pytest.mark.parametrize("problems, samples, k", [(30, 1, 1), (40, 1, 1), (30, 4, 1), (40, 1, 5)])
def test_the_figures_are_the_verdict_rules_own(problems, samples, k):
    """At the smallest margin the rule calls agreeing checkpoints equivalent at the last look, just below it not;
    `worse` is decided with `worse_problems` problems one way (greedy) and not with one fewer."""
    looks = round_ends(problems, DEFAULT_ROUNDS)
    found = planned_reach(problems, DEFAULT_ROUNDS, 0.05, 0.02, k, samples)
    agree = [np.zeros(problems)] * k
    assert sequential_verdict(agree, looks, 0.05, found.equivalent_margin + 1e-9).verdict == "equivalent"
    assert sequential_verdict(agree, looks, 0.05, found.equivalent_margin * 0.98).verdict == "undecided"
    if samples == 1:
        p = found.worse_problems
        assert found.worse_difference == pytest.approx(p / problems)
        drop = lambda p: [np.where(np.arange(problems) < p, -1.0, 0.0)] * k       # noqa: E731
        assert sequential_verdict(drop(p), looks, 0.05, 0.0).verdict == "worse"
        assert sequential_verdict(drop(p - 1), looks, 0.05, 0.0).verdict == "undecided"


def test_large_benchmarks_are_within_reach_but_not_against_twenty_candidates():
    """MATH-500 at the defaults: within reach against one earlier checkpoint; against the best of 20 (upper bounds
    at alpha / 20) the smallest margin is above 0.02, which is said too."""
    assert planned_reach(500, **DEFAULTS).statement("math500") is None
    assert planned_reach(1319, DEFAULT_ROUNDS, 0.05, 0.02, k=20).statement("gsm8k") is None
    twenty = planned_reach(500, DEFAULT_ROUNDS, 0.05, 0.02, k=20)
    assert 0.02 < twenty.equivalent_margin < 0.03
    assert "the best of 20 earlier checkpoints" in twenty.statement("math500")
    assert planned_reach(500, DEFAULT_ROUNDS, 0.05, 0.03, k=20).statement("math500") is None


def test_looks_too_small_to_decide_anything_are_named():
    """Ten rounds of AIME24 are looks every 3 problems: at 3 nothing can be decided, whatever the answers."""
    found = planned_reach(30, **DEFAULTS)
    assert found.looks[:2] == (3, 6) and found.dead_looks == 1
    assert "Its first look of 10 (at 3 problems) can decide nothing" in found.statement("aime24")
    assert planned_reach(30, 2, 0.05, 0.02).dead_looks == 0


def _aime_plan(tmp_path, **options):
    ckpt = complete_checkpoint(tmp_path / "ckpt")
    return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), num_shards=1, decide="vs_best", **options),
                   tmp_path / "results")


def test_a_decision_on_aime24_carries_the_statement_to_the_log_tags_and_evaldag_run(configs, tmp_path):
    """Before: the verdict was `undecided` after all 30 problems with nothing saying it could not have been
    `equivalent` (identical answers on every problem)."""
    plan = _aime_plan(tmp_path)
    assert plan.n_problems == 30
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    incumbent = pl.DataFrame({"sample_id": order, "n": [1] * 30, "score": [1.0] * 30})
    decider = Decider(plan, incumbent, "job@1", lambda rows: grade_rows(plan, rows))
    assert "aime24 gives 30 problems" in decider.note and "`equivalent` cannot be reached" in decider.note
    samples = pl.DataFrame({"sample_id": order, "sample_index": [0] * 30, "shard_index": [0] * 30,
                            "correct": [True] * 30, "completion_tokens": [10] * 30})
    decision = decider.final(samples)
    assert (decision.verdict, decision.problems, decision.diff) == ("undecided", 30, 0.0)
    assert decider.note in decision.describe() and decision.tags()["decide.note"] == decider.note
    assert f"decide: {decider.note}" in logged_verdict_lines(decision.tags(), decision.metrics())
    # kept with the decision (decision.json) and read back
    decision.save(plan)
    assert Decision.load(plan).note == decider.note


def test_a_reachable_margin_says_nothing(configs, tmp_path):
    plan = _aime_plan(tmp_path, decide_margin=0.25)
    assert reach_note(plan) == ""
    assert reach_note(_aime_plan(tmp_path / "b")) != ""


def test_the_statement_is_logged_before_any_shard_starts(configs, tmp_path, monkeypatch):
    """deciders_for runs before the shards launch (flows/eval_flow._plan): the first checkpoint of a job (nothing
    to compare with) on AIME24 at the defaults hears it there, in the log and a Prefect artifact."""
    import tasks.decide as decide_tasks

    plan = _aime_plan(tmp_path)
    artifacts = []
    monkeypatch.setattr(decide_tasks, "find_incumbent", lambda path: None)
    monkeypatch.setattr(decide_tasks, "create_markdown_artifact", lambda text, **kw: artifacts.append((text, kw)))
    heard = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = heard.append                   # Prefect's loggers do not propagate to pytest's caplog
    logging.getLogger("tasks.decide").addHandler(handler)
    try:
        deciders, known = decide_tasks.deciders_for([str(plan.path("plan.json"))], [plan])
    finally:
        logging.getLogger("tasks.decide").removeHandler(handler)
    decision = next(iter(known.values()))
    assert deciders == {} and decision.status == "no_incumbent"
    assert "too few for decide at margin 0.02" in decision.note and decision.note in decision.describe()
    assert any(decision.note in r.getMessage() for r in heard)
    assert artifacts and decision.note in artifacts[0][0] and artifacts[0][1]["key"] == "decide-aime24"


def test_the_reach_is_quick_enough_for_the_flow():
    """The parent computes it once per plan; a 1,319-problem benchmark with n = 64 must not search 64 grids."""
    found = reach_module.planned_reach(1319, DEFAULT_ROUNDS, 0.05, 0.02, k=20, samples=64)
    assert found.equivalent_reachable and found.worse_difference < 0.02

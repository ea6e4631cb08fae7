"""Adaptive samples wired into the pipeline (evaldag.request.second_round): the request's checks, the first round
as a plain n0 generation, the second round's plan, and the reduce over both rounds.

The stage tests run the real stages (generate, grade, reduce) on `PatternEngine`, a stand-in for vLLM that answers
right or wrong by a fixed pattern over each problem's sample index, so every expected figure is known in advance; the
real engine runs the same path in tests/engine_vllm/test_adaptive_e2e.py."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from conftest import complete_checkpoint
from index_engine import ByIndexEngine
from evaldag import engines
from evaldag.decisions.series import comparison_key
from evaldag.errors import ConfigError
from evaldag.pipeline import generate
from evaldag.pipeline.generate import generate_shard
from evaldag.pipeline.grade import grade_shard
from evaldag.pipeline.reduce import reduce_results
from evaldag.request.plan import EvalRequest, load_plan, resolve
from evaldag.request.second_round import plan_runs, resolve_second_round, second_round_path

# problem j (in sample-id order) is right at sample index k when PATTERNS[j % 5](k): first rounds of 0, 4, 2, 1
# and 3 right of 4, so every first-round stratum of n0 = 4 has a problem (and its second-round size can be read)
PATTERNS = (lambda k: False, lambda k: True, lambda k: k % 2 == 0, lambda k: k % 4 == 0, lambda k: k % 4 != 0)


class PatternEngine(ByIndexEngine):
    """Right at sample `index` of a prompt when its rule says so (index_engine: the named fake of vLLM's seeding)."""

    rule: dict = {}       # prompt -> PATTERNS entry

    def answer(self, prompt: str, index: int) -> str:
        return type(self).gold[prompt] if type(self).rule[prompt](index) else "-12345"


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    ckpt = complete_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: PatternEngine())
    monkeypatch.setattr(generate, "workload", lambda shard: None)
    PatternEngine.generated = []
    return ckpt, tmp_path / "results"


def _request(ckpt, **adaptive_settings) -> EvalRequest:
    return EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=2, engine="vllm",
                       sampling={"temperature": 0.7, "max_new_tokens": 16},
                       adaptive={"n0": 4, "floor": 2, **adaptive_settings})


def _teach(plan, patterns=PATTERNS) -> None:
    PatternEngine.learn(plan)
    prompts = plan.inputs().sort("sample_id")["prompt"].to_list()
    PatternEngine.rule = {p: patterns[j % len(patterns)] for j, p in enumerate(prompts)}


def _run(plan) -> list[str]:
    paths = []
    for s in range(plan.num_shards):
        generate_shard(plan, s)
        paths.append(str(grade_shard(plan, s, workers=0)))
    return paths


def _rows(paths) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p, columns=["sample_id", "sample_index", "correct"]) for p in paths])


def _two_stage_by_hand(rules, later: list[int], n0: int = 4, floor: int = 2) -> dict[str, float]:
    """accuracy, accuracy_ci_*, adaptive_set_ci_* of problems right at sample index k when rules[j](k), with
    later[j] second-round samples (indices n0..), written out from the design's definition (docs/statistics.md,
    twostage's docstring) without evaldag's code: the prior Beta(alpha, beta) by the method of moments on the first
    round (concentration in [0.2, 50]); weights (a_s, b_s) that minimise the prior-averaged variance of
    T = a_s + b_s x (x the second round's mean) among those with E[T | p] = p, the identity imposed at n0 + 2 solve
    rates and the moments integrated numerically (scipy.integrate.quad), solved as one equality-constrained
    quadratic problem; intervals at 95 %: Student's t over the problems' T, and normal with each problem's
    Var(T | p) averaged over its posterior."""
    from scipy import integrate, stats

    first = np.array([sum(rule(k) for k in range(n0)) for rule in rules])
    x = np.array([np.mean([rule(k) for k in range(n0, n0 + n)]) for rule, n in zip(rules, later)])
    n1 = np.zeros(n0 + 1)
    for s, n in zip(first, later):
        assert n1[s] in (0, n), "one second-round size per first-round stratum"
        n1[s] = n
    assert (n1 > 0).all() and n1[0] == n1[n0] == floor         # every stratum seen, so its size is known
    share = first / n0
    mu, var = share.mean(), share.var(ddof=1)
    kappa = np.clip(mu * (1 - mu) / ((var - mu * (1 - mu) / n0) * n0 / (n0 - 1)) - 1, 0.2, 50)
    prior = stats.beta(mu * kappa, (1 - mu) * kappa)

    def pi(s, p):
        return stats.binom.pmf(s, n0, p)

    def mean_of(f, dist):
        return integrate.quad(lambda p: f(p) * dist.pdf(p), 0, 1, limit=200, epsabs=1e-13, epsrel=1e-11)[0]

    # unknowns (a_0..a_n0, b_0..b_n0); E[T^2] = sum_s E[pi_s (a_s^2 + 2 a_s b_s p + b_s^2 (p^2 + p(1-p)/n1_s))]
    q = np.zeros((2 * n0 + 2, 2 * n0 + 2))
    for s in range(n0 + 1):
        q[s, s] = mean_of(lambda p: pi(s, p), prior)
        q[s, n0 + 1 + s] = q[n0 + 1 + s, s] = mean_of(lambda p: pi(s, p) * p, prior)
        q[n0 + 1 + s, n0 + 1 + s] = mean_of(lambda p: pi(s, p) * (p * p + p * (1 - p) / n1[s]), prior)
    rates = np.linspace(0.05, 0.95, n0 + 2)
    c = np.array([[pi(s, p) for s in range(n0 + 1)] + [pi(s, p) * p for s in range(n0 + 1)] for p in rates])
    kkt = np.block([[2 * q, c.T], [c, np.zeros((n0 + 2, n0 + 2))]])
    w = np.linalg.solve(kkt, np.concatenate([np.zeros(2 * n0 + 2), rates]))
    a, b = w[:n0 + 1], w[n0 + 1:2 * n0 + 2]
    t = a[first] + b[first] * x
    m = t.size
    half = stats.t.ppf(0.975, m - 1) * t.std(ddof=1) / np.sqrt(m)

    def var_t(p):
        return sum(pi(s, p) * ((a[s] + b[s] * p) ** 2 + b[s] ** 2 * p * (1 - p) / n1[s])
                   for s in range(n0 + 1)) - p * p

    correct = first + x * np.array(later)
    posterior_var = [mean_of(var_t, stats.beta(mu * kappa + k, (1 - mu) * kappa + n0 + n - k))
                     for k, n in zip(correct, later)]
    set_half = stats.norm.ppf(0.975) * np.sqrt(np.sum(posterior_var)) / m
    return {"accuracy": t.mean(), "accuracy_ci_low": t.mean() - half, "accuracy_ci_high": t.mean() + half,
            "adaptive_set_ci_low": t.mean() - set_half, "adaptive_set_ci_high": t.mean() + set_half}


def test_the_second_round_draws_more_where_the_first_was_uncertain_and_the_reduce_uses_both(fake_vllm):
    ckpt, results = fake_vllm
    plan = resolve(_request(ckpt, budget=120), results)
    _teach(plan)
    assert plan.sampling.n == 4 and plan.num_shards == 2
    first = _run(plan)
    second = resolve_second_round(plan, _rows(first))
    assert second is not None and load_plan(second_round_path(plan)).generation_key == second.generation_key
    assert resolve_second_round(plan, _rows(first)).generation_key == second.generation_key    # same rows, same plan
    ids = sorted(plan.sample_ids())
    runs = {}
    for shard, shard_runs in zip(second.shards, second.sample_runs):
        for sid, (start, count) in zip(shard, shard_runs):
            runs.setdefault(sid, []).extend(range(start, start + count))
    # all wrong (j % 5 == 0) or all right (j % 5 == 1) in round 1: the floor (2) and no more; the others more
    for j, sid in enumerate(ids):
        assert sorted(runs[sid]) == list(range(4, 4 + len(runs[sid]))), runs[sid]     # indices 4.. once each
        if j % 5 in (0, 1):
            assert len(runs[sid]) == 2, (j, runs[sid])
        else:
            assert len(runs[sid]) > 2, (j, runs[sid])
    total = 8 * 4 + sum(len(r) for r in runs.values())
    assert 8 * 6 < total <= 120

    later = _run(second)
    metrics = reduce_results(plan, first + later)
    samples = pl.read_parquet(plan.path("samples.parquet"))
    assert samples.height == total == metrics["n_samples"] == metrics["adaptive_samples"]
    assert samples.select("sample_id", "sample_index").is_unique().all()
    # each sample was generated once, at the index its round planned
    assert len(PatternEngine.generated) == len(set(PatternEngine.generated)) == total
    # a problem's answer groups span both rounds and every shard: one group per distinct answer, one answer a group
    groups = samples.group_by("sample_id").agg(answers=pl.col("pred").n_unique(),
                                                groups=pl.col("answer_group").n_unique(),
                                                pairs=pl.struct("pred", "answer_group").n_unique())
    assert (groups["answers"] == groups["groups"]).all() and (groups["pairs"] == groups["answers"]).all(), groups
    # the first round's figures are a fixed n = 4 evaluation's: per problem 0, 1, 2/4, 1/4, 3/4, 0, 1, 2/4 -> 0.5
    assert metrics["avg@4"] == pytest.approx((0 + 1 + 0.5 + 0.25 + 0.75 + 0 + 1 + 0.5) / 8)
    # every row is graded as the pattern says
    expected = [PATTERNS[ids.index(s) % 5](k) for s, k in samples.select("sample_id", "sample_index").iter_rows()]
    assert samples["correct"].to_list() == expected
    # the accuracy and both intervals recomputed here from the patterns and the second round's sizes
    want = _two_stage_by_hand([PATTERNS[j % 5] for j in range(len(ids))], [len(runs[sid]) for sid in ids])
    for name, value in want.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name

    with pytest.raises(ValueError, match="second-round shard"):
        reduce_results(plan, first)                   # the second round's rows left out: refused, not reduced


def test_all_or_nothing_problems_are_estimated_exactly(fake_vllm):
    """Problems right every time or never: the estimate is the share of the always-right ones, whatever the round
    each sample came from (an unbiased design must give 0 and 1 for them)."""
    ckpt, results = fake_vllm
    plan = resolve(_request(ckpt, budget=48), results)
    _teach(plan, patterns=(lambda k: False, lambda k: True, lambda k: True, lambda k: False))
    first = _run(plan)
    second = resolve_second_round(plan, _rows(first))
    assert {c for runs in second.sample_runs for _, c in runs} <= {1, 2}
    metrics = reduce_results(plan, first + _run(second))
    assert metrics["accuracy"] == pytest.approx(0.5) and metrics["n_samples"] == 48


@pytest.mark.parametrize("right", [False, True])
def test_a_checkpoint_that_is_always_wrong_or_always_right_is_reduced(fake_vllm, right):
    """The ordinary case of a broken or early checkpoint (or an easy slice): every estimate is the same, the
    interval falls back to Wilson's over problems, and the estimator's rounding must not leave [0, 1]."""
    ckpt, results = fake_vllm
    plan = resolve(_request(ckpt, budget=160, floor=4), results)
    _teach(plan, patterns=(lambda k: right,))
    first = _run(plan)
    metrics = reduce_results(plan, first + _run(resolve_second_round(plan, _rows(first))))
    assert metrics["accuracy"] == pytest.approx(float(right)) and metrics["n_samples"] == 8 * 8
    assert 0.0 <= metrics["accuracy_ci_low"] <= metrics["accuracy"] <= metrics["accuracy_ci_high"] <= 1.0
    assert metrics["accuracy_ci_high"] - metrics["accuracy_ci_low"] > 0.1       # 8 problems bound little
    assert 0.0 <= metrics["adaptive_set_ci_low"] <= metrics["adaptive_set_ci_high"] <= 1.0


def test_paired_verdicts_compare_the_unbiased_per_problem_estimates(fake_vllm):
    """samples.parquet carries each problem's two-stage estimate, and per-problem scores (what verdicts pair) use
    it, so their mean is the reported accuracy; an evaluation without it is scored by its mean correctness."""
    from evaldag.decisions.verdicts import PROBLEM_SCORE, per_problem_scores, read_scored_samples

    ckpt, results = fake_vllm
    plan = resolve(_request(ckpt, budget=120), results)
    _teach(plan)
    first = _run(plan)
    metrics = reduce_results(plan, first + _run(resolve_second_round(plan, _rows(first))))
    samples = read_scored_samples(str(plan.path("samples.parquet")))
    assert PROBLEM_SCORE in samples.columns
    scores = per_problem_scores(samples)
    assert scores["score"].mean() == pytest.approx(metrics["accuracy"])
    pooled = samples.group_by("sample_id").agg(pl.col("correct").cast(pl.Float64).mean()).sort("sample_id")
    assert scores["score"].to_list() != pooled["correct"].to_list()       # not the pooled mean
    assert per_problem_scores(samples.drop(PROBLEM_SCORE))["score"].to_list() == pooled["correct"].to_list()


def test_no_second_round_when_the_design_draws_nothing(fake_vllm):
    ckpt, results = fake_vllm
    plan = resolve(_request(ckpt, budget=32, floor=0), results)
    _teach(plan, patterns=(lambda k: False, lambda k: True))
    first = _run(plan)
    second_round_path(plan).parent.mkdir(parents=True, exist_ok=True)
    second_round_path(plan).write_text("{}")          # one an earlier attempt made from other first-round rows
    assert resolve_second_round(plan, _rows(first)) is None
    assert not second_round_path(plan).exists()
    metrics = reduce_results(plan, first)
    assert metrics["accuracy"] == pytest.approx(0.5) and metrics["n_samples"] == 32


def test_a_first_round_that_is_not_the_plan_is_refused(fake_vllm):
    ckpt, results = fake_vllm
    plan = resolve(_request(ckpt, budget=120), results)
    _teach(plan)
    first = _run(plan)
    with pytest.raises(ValueError, match="first round"):
        resolve_second_round(plan, _rows(first[:1]))          # one shard's file missing


def test_the_first_round_shares_a_fixed_n0_evaluations_rows_but_not_its_result(fake_vllm):
    ckpt, results = fake_vllm
    adaptive_plan = resolve(_request(ckpt, budget=120), results)
    fixed = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=2, engine="vllm",
                                sampling={"temperature": 0.7, "max_new_tokens": 16, "n": 4}), results)
    assert adaptive_plan.generation_key == fixed.generation_key
    assert adaptive_plan.grade_key == fixed.grade_key
    assert adaptive_plan.eval_key != fixed.eval_key
    assert comparison_key(adaptive_plan) != comparison_key(fixed)
    other_budget = resolve(_request(ckpt, budget=100), results)
    assert other_budget.eval_key != adaptive_plan.eval_key
    assert comparison_key(other_budget) != comparison_key(adaptive_plan)


@pytest.mark.parametrize("change, match", [
    ({"engine": "hf"}, "need engine=vllm"),
    ({"sampling": {"temperature": 0.0}}, "temperature > 0"),
    ({"sampling": {"temperature": 0.7, "n": 8}}, "drop sampling.n"),
    ({"decide": "vs_best"}, "cannot be combined yet"),
    ({"adaptive": {"budget": 40}}, "cannot pay for"),
])
def test_adaptive_requests_that_cannot_run_are_refused_naming_the_fix(fake_vllm, change, match):
    ckpt, results = fake_vllm
    base = _request(ckpt, budget=120).model_dump(exclude_none=True)
    with pytest.raises(ConfigError, match=match):
        resolve(EvalRequest.parse(**{**base, **change}), results)


@pytest.mark.parametrize("settings, match", [
    ({"budget": 100, "target_ci_width": 0.1}, "exactly one of budget"),
    ({}, "exactly one of budget"),
    ({"budget": 100, "n0": 1}, "n0"),
    ({"budget": 100, "unknown": 3}, "unknown"),
])
def test_adaptive_settings_are_checked_at_the_request(settings, match):
    with pytest.raises(ConfigError, match=match):
        EvalRequest.parse(benchmark="aime24", adaptive=settings)


def test_second_round_runs_cover_each_problem_once_and_balance_the_shards():
    more = [(f"p{i}", c) for i, c in enumerate([2, 2, 9, 17, 0, 5, 2, 30])]
    shards, runs = plan_runs(more, 4, first=12)
    covered = sorted((sid, start + k) for shard, rs in zip(shards, runs) for sid, (start, n) in zip(shard, rs)
                     for k in range(n))
    assert covered == sorted((sid, 12 + k) for sid, c in more for k in range(c))
    per_shard = [sum(n for _, n in rs) for rs in runs]
    assert sum(per_shard) == 67 and max(per_shard) - min(per_shard) <= 4, per_shard
    assert plan_runs(more, 4, first=12) == (shards, runs)
    assert plan_runs([("a", 3)], 8, first=4) == ([["a"], ["a"], ["a"]], [[(4, 1)], [(5, 1)], [(6, 1)]])


def test_a_jobs_history_takes_an_adaptive_runs_own_standard_errors():
    """An adaptive run's n_samples counts both rounds, while its reward figures are over the first round and its
    accuracy is an estimate with a standard error of its own: the history (what the reward-swing and divergence
    diagnostics read) takes the run's `reward/se` and `accuracy_se` where logged, else those of n_samples draws."""
    import math
    from types import SimpleNamespace

    from evaldag.tracking.history import _history_rows

    def run(step, **metrics):
        return SimpleNamespace(data=SimpleNamespace(tags={"train_run": "job"}, metrics={"step": step, **metrics}))

    fixed = run(1, accuracy=0.25, n_samples=400.0, **{"reward/mean": 0.3, "reward/std": 0.5})
    adaptive_run = run(2, accuracy=0.3, n_samples=960.0, accuracy_se=0.04,
                       **{"reward/mean": 0.3, "reward/std": 0.5, "reward/se": 0.5 / math.sqrt(360)})
    rows = {r["step"]: r for r in _history_rows([adaptive_run, fixed])["job"]}
    assert rows[1]["reward_se"] == pytest.approx(0.5 / 20) and rows[1]["accuracy_se"] == pytest.approx(
        math.sqrt(0.25 * 0.75 / 400))
    assert rows[2]["reward_se"] == pytest.approx(0.5 / math.sqrt(360)) and rows[2]["accuracy_se"] == 0.04


def test_evaldag_run_adaptive_options_become_the_flows_parameters(monkeypatch):
    from typer.testing import CliRunner

    from evaldag.cli import app
    from evaldag.runtime import runner
    from evaldag.runtime import stack as stack_module

    sent = []
    monkeypatch.setattr(stack_module, "Stack", lambda *a, **k: None)
    monkeypatch.setattr(runner, "run_and_report", lambda stack, benchmark, params: sent.append((benchmark, params)))
    result = CliRunner().invoke(app, ["run", "aime24", "--temperature", "0.6", "--adaptive-budget", "960"])
    assert result.exit_code == 0, result.output
    assert sent == [("aime24", {"sampling": {"temperature": 0.6}, "adaptive": {"budget": 960}})]
    result = CliRunner().invoke(app, ["run", "aime24", "--temperature", "0.6", "--adaptive-width", "0.05"])
    assert result.exit_code == 0 and sent[-1][1]["adaptive"] == {"target_ci_width": 0.05}
    result = CliRunner().invoke(app, ["run", "aime24", "--adaptive-budget", "960", "--adaptive-width", "0.05"],
                                env={"COLUMNS": "200"})       # rich wraps the error box at the terminal's width
    assert result.exit_code == 2 and "give one" in result.output and len(sent) == 2

"""The job's best and previous checkpoint, defined once (evaldag.decisions.best), and the verdict against the best
that keeps its error rate although the best was picked on the same problems (issue 37 items 2 and 3). Bounds are
checked against scipy's t intervals, error rates by simulation against alpha, the one definition of "best" through
`evaldag compare --verdicts`' pairing and MLflow's references on the same evaluations."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from scipy import stats

from evaldag.decisions import best, paired, verdicts


def _t_interval(d: np.ndarray, level: float) -> tuple[float, float]:
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(level)
    return float(ci.low), float(ci.high)


def test_the_bounds_are_the_lowest_lower_bound_and_the_lowest_bonferroni_upper_bound():
    rng = np.random.default_rng(1)
    new = rng.binomial(4, 0.55, 300) / 4
    earlier = [rng.binomial(4, p, 300) / 4 for p in (0.4, 0.56, 0.58)]
    ds = [new - e for e in earlier]
    v = best.best_verdict(ds, margin=0.02, alpha=0.05, grids=[4] * 3)
    # by scipy: lower bounds at 95 %, upper bounds at 1 - 0.05 / 3 (three candidates, two-sided)
    lows = [_t_interval(d, 0.95)[0] for d in ds]
    highs = [_t_interval(d, 1 - 0.05 / 3)[1] for d in ds]
    assert v.ci_low == pytest.approx(min(lows)) and v.ci_high == pytest.approx(min(highs))
    assert v.diff == pytest.approx(min(d.mean() for d in ds)) and v.n_problems == 300


def test_one_earlier_checkpoint_is_the_plain_paired_test():
    rng = np.random.default_rng(2)
    d = (rng.binomial(4, 0.6, 200) - rng.binomial(4, 0.5, 200)) / 4
    assert best.best_verdict([d], grids=[4]) == paired.paired_test(d, grid=4)


def test_better_needs_every_earlier_checkpoint_beaten_and_worse_the_bonferroni_p_value():
    # 40 problems at n = 1: the new checkpoint solves 30; A solved 10 of them, B 12 (a superset of A's)
    new = np.r_[np.ones(30), np.zeros(10)]
    a = np.r_[np.ones(10), np.zeros(30)]
    b = np.r_[np.ones(12), np.zeros(28)]
    v = best.best_verdict([new - a, new - b], grids=[1, 1])
    assert v.verdict == "better"
    # intersection-union p-value: the larger of the two exact sign-flip p-values (all d_i >= 0: 2 x 2^-k, k the
    # problems that differ: 20 against A, 18 against B)
    assert v.p_value == pytest.approx(2 * 0.5 ** 18)
    # worse, by hand: 10 problems differ against B only, all against the new one: Bonferroni p = 2 x 2 x 2^-10
    worse = best.best_verdict([np.zeros(40), -np.r_[np.ones(10), np.zeros(30)]], grids=[1, 1], min_problems=10)
    assert worse.p_value == pytest.approx(2 * 2 * 0.5 ** 10) and worse.verdict == "worse"
    with pytest.raises(ValueError, match="no earlier evaluation"):
        best.best_verdict([])


def _equal_skill_jobs(jobs: int, k: int, problems: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-problem scores of a new checkpoint and k earlier ones, all of the same skill (U-shaped solve rates)."""
    rng = np.random.default_rng(seed)
    p = rng.beta(0.6, 0.6, size=(jobs, problems))
    return rng.binomial(n, p) / n, rng.binomial(n, p[:, None, :], size=(jobs, k, problems)) / n


def test_false_worse_and_better_stay_below_alpha_with_many_earlier_checkpoints():
    """Ten earlier checkpoints of the new one's skill: against the best picked by accuracy as if it were fixed,
    `worse` comes far more often than alpha / 2 (the old rule, shown so the simulation can tell); against every
    candidate (the rule) at most alpha / 2 on each side, up to the simulation's noise."""
    alpha, jobs = 0.05, 600
    new, earlier = _equal_skill_jobs(jobs, 10, 150, 4, seed=7)
    old, rule = [], []
    for x, c in zip(new, earlier):
        old.append(paired.paired_test(x - c[np.argmax(c.mean(axis=1))], 0.02, alpha, grid=4).verdict)
        rule.append(best.best_verdict(list(x - c), 0.02, alpha, [4] * 10, p_value=False).verdict)
    old, rule = np.array(old), np.array(rule)
    se = np.sqrt(alpha / 2 * (1 - alpha / 2) / jobs)
    assert (old == "worse").mean() > alpha                      # the selection bias the rule removes
    assert (rule == "worse").mean() <= alpha / 2 + 2 * se
    assert (rule == "better").mean() <= alpha / 2 + 2 * se


def test_a_real_drop_is_still_called_worse():
    new, earlier = _equal_skill_jobs(200, 10, 500, 4, seed=8)
    new = np.clip(new - 0.25 * (np.random.default_rng(9).random(new.shape) < 0.4), 0, 1)   # ~10 points lower
    called = [best.best_verdict(list(x - c), grids=[4] * 10, p_value=False).verdict for x, c in zip(new, earlier)]
    assert np.mean(np.array(called) == "worse") > 0.9


# ---- one definition of the best ----------------------------------------------------------------------------------

def test_references_previous_is_the_last_best_the_first_highest_full_one():
    earlier = [{"run_id": "a", "step": 1, "accuracy": 0.4}, {"run_id": "b", "step": 2, "accuracy": 0.7},
               {"run_id": "c", "step": 3, "accuracy": 0.7}, {"run_id": "d", "step": 4, "accuracy": 0.9,
                                                               "stopped": True}]
    refs = best.references(earlier)
    assert (refs["previous"]["run_id"], refs["best"]["run_id"]) == ("d", "b")
    assert best.references([]) == {}
    assert "best" not in best.references([{"run_id": "s", "step": 1, "accuracy": 0.9, "stopped": True}])


def _scores_for(acc: float, size: int = 200, seed: int = 0) -> pl.DataFrame:
    """A per-sample table (n = 1) of problems p000.. solved with a nested pattern (a higher `acc` solves a superset)."""
    order = np.random.default_rng(seed).permutation(size)
    solved = order < round(acc * size)
    return pl.DataFrame({"sample_id": [f"p{i:03d}" for i in range(size)], "sample_index": 0, "correct": solved})


def test_compare_verdicts_and_mlflow_agree_on_the_best_and_a_stopped_prefix_is_never_it():
    """The issue's case: a 20-problem prefix at 90 % (stopped early) at step 200 was `evaldag compare --verdicts`'
    best, while MLflow's was step 100. The verdict against the best reads both full candidates (100 and 250)."""
    runs = pl.DataFrame({
        "run_id": ["r100", "s200", "r250", "r300"], "stopped": [False, True, False, False], "train_run": ["j"] * 4,
        "step": [100, 200, 250, 300], "benchmark": ["math500"] * 4, "comparison_key": ["K"] * 4,
        "checkpoint": ["c1", "c2", "c2b", "c3"], "model": ["m"] * 4, "start": [1, 2, 3, 4], "asked": [True] * 4})
    tables = {"r100": _scores_for(0.5), "s200": _scores_for(0.9, size=20), "r250": _scores_for(0.52, seed=1),
              "r300": _scores_for(0.55, seed=2)}
    out = verdicts.pair_job_evaluations(runs, tables.__getitem__)
    rows = {(r["step"], r["vs"]): r for r in out.iter_rows(named=True)}
    assert rows[(300, "best")]["other"] == "j@250"
    assert rows[(250, "best")]["other"] == "j@100"
    assert rows[(250, "previous")]["other"] == "j@200"          # the previous checkpoint it still is
    earlier = [{"run_id": r, "step": s, "accuracy": float(tables[r]["correct"].mean()), "stopped": st}
               for r, s, st in (("r100", 100, False), ("s200", 200, True), ("r250", 250, False))]
    assert best.references(earlier)["best"]["run_id"] == "r250"
    # by scipy: the upper bound is the lower of the two candidates' t bounds at 1 - 0.05 / 2 (problems in order)
    mine = tables["r300"]["correct"].cast(float).to_numpy()
    highs = [_t_interval(mine - tables[r]["correct"].cast(float).to_numpy(), 1 - 0.05 / 2)[1]
             for r in ("r100", "r250")]
    assert rows[(300, "best")]["ci_high"] == pytest.approx(min(highs))

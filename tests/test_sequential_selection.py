"""The sequential verdict against a job's best keeps its error with many earlier checkpoints (the selection of the
best accounted for), and `equivalent` holds for rare, one-sided differences (issue 54)."""

from __future__ import annotations

import numpy as np

from evaldag.decisions import paired, sequential
from evaldag.decisions.decide import round_ends


def _equal_checkpoints(rng: np.random.Generator, runs: int, k: int, problems: int) -> tuple[np.ndarray, np.ndarray]:
    """(new (runs, problems), earlier (runs, k, problems)): greedy scores of k + 1 checkpoints of equal skill on
    U-shaped per-problem solve rates."""
    p = rng.beta(0.75, 0.75, size=(runs, problems))
    earlier = rng.binomial(1, p[:, None, :], size=(runs, k, problems)).astype(np.float64)
    return rng.binomial(1, p).astype(np.float64), earlier


def test_twenty_equal_earlier_checkpoints_false_worse_at_most_alpha():
    """With 20 equal earlier checkpoints, testing against the one of highest accuracy as if fixed calls the new one
    worse far above alpha (measured 0.15 here); against all 20 (lower bounds at alpha, upper at alpha / 20) both
    false verdicts stay within alpha."""
    rng = np.random.default_rng(54)
    runs, k, problems, alpha = 150, 20, 300, 0.05
    new, earlier = _equal_checkpoints(rng, runs, k, problems)
    ends = round_ends(problems, 10)
    best = earlier[np.arange(runs), earlier.mean(axis=2).argmax(axis=1)]
    _, alone = sequential.stopping_times(new - best, ends, alpha, 0.02)
    assert (alone == "worse").mean() > alpha + 0.05          # the fault: the selection ignored
    _, verdict = sequential.stopping_times(new[:, None, :] - earlier, ends, alpha, 0.02)
    assert (verdict == "worse").mean() <= alpha + 0.01 and (verdict == "better").mean() <= alpha + 0.01


def test_no_differing_problem_in_150_is_not_equivalent_at_margin_002():
    """The 150-problem look of MATH-500's ten rounds with no differing problem: 2 % broken and none fixed shows
    this with probability 0.05, so it must not be `equivalent` at margin 0.02 (the t interval's half-width there is
    0.017; the exact Clopper-Pearson bound on a one-sided rate 0.035, rare_interval's 0.039)."""
    ends = round_ends(500, 10)
    looks = list(ends)
    v = sequential.sequential_verdict(np.zeros(150), looks, 0.05, 0.02)
    assert v.verdict != "equivalent", v
    low, high = sequential.rare_interval(np.zeros(150), sequential.pocock_boundary(tuple(looks), 0.05))
    assert high[0] > 0.034 and low[0] < -0.034
    # many problems that agree do decide equivalence: the bound is not just wide
    v = sequential.sequential_verdict(np.zeros(500), looks, 0.05, 0.02)
    assert v.verdict == "equivalent", v


def test_one_sided_two_percent_break_is_rarely_equivalent():
    """Greedy, 2 % of problems broken and none fixed, decide's ten rounds of MATH-500: `equivalent` at margin 0.02
    in at most alpha of runs (the t interval alone: about 0.1)."""
    rng = np.random.default_rng(3)
    d = -(rng.random((2000, 500)) < 0.02).astype(np.float64)
    _, verdict = sequential.stopping_times(d, round_ends(500, 10), 0.05, 0.02)
    assert (verdict == "equivalent").mean() <= 0.05


def test_equivalence_between_identical_checkpoints_stays_within_reach():
    """The bound for rare differences costs little where many problems differ: identical checkpoints, n = 4,
    U-shaped solve rates, 2,000 problems in 40 rounds, margin 0.04."""
    rng = np.random.default_rng(8)
    p = rng.beta(0.75, 0.75, size=(100, 2000))
    d = (rng.binomial(4, p) - rng.binomial(4, p)) / 4
    _, verdict = sequential.stopping_times(d, 50, 0.05, 0.04)
    assert (verdict == "equivalent").mean() >= 0.9


def test_chernoff_bound_is_clopper_pearson_at_zero():
    u = paired._chernoff_bound(np.zeros(1), 150, 0.0025, upper=True)[0]
    assert abs(u - (1 - 0.0025 ** (1 / 150))) < 1e-9


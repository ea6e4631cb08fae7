"""Paired verdicts: is a checkpoint better than, worse than, or equivalent to another one on the same problems?

Two evaluations that measured the same thing (same `evaldag.comparison_key`: benchmark, problem set, sampling,
grader, dtype) are compared problem by problem. Each problem's score is its mean correctness over its n samples
(avg@n, whose mean over problems is the run's `accuracy`), and the unit of the analysis is the problem: the n
samples of one problem are not independent observations of the checkpoint's skill, so they are averaged first
(clustering by problem). On the common problem ids, d_i = score_a(i) - score_b(i) and

- the estimate is mean(d), its standard error sd(d) / sqrt(m) (m problems, ddof 1);
- the interval is Student's t interval on the d_i (the paired t test, scipy.stats.ttest_rel's interval). The d_i
  are bounded in [-1, 1], so with the hundreds of problems of MATH-500 or GSM8K the central limit theorem makes it
  accurate; on a 30-problem set (AIME24) it is an approximation, hence the p-value below;
- the p-value is the exact two-sided sign-flip permutation test: under H0 "the two checkpoints are the same model",
  swapping the two scores of a problem changes nothing, so each d_i is +|d_i| or -|d_i| with probability 1/2
  independently. Its null distribution is computed exactly (a convolution on the grid of 1/n, the per-problem
  scores being multiples of 1/n), for any number of problems, with no large-sample assumption; a Monte Carlo
  estimate is used only when the scores are not on a common grid (unequal n);
- the verdict at level alpha with a margin (TOST-style equivalence):
  `equivalent` when the interval lies inside [-margin, margin]; otherwise `better` when the interval lies above 0
  and the exact p-value is below alpha (both, so that a too-narrow t interval on a small set cannot decide alone),
  `worse` likewise below 0; else `undecided`. Equivalence is read on the same (1 - alpha) interval, which is
  conservative (the textbook TOST uses the (1 - 2 alpha) interval) and keeps one interval on screen. Fewer than
  `min_problems` common problems are always `undecided`: a few identical scores would give a zero-width interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

VERDICTS = ("better", "worse", "equivalent", "undecided")
# Exact null distributions are computed on an integer grid of at most this many cells (sum of |d_i| x grid);
# MATH-500 at n = 64 is 2 x 500 x 64 = 64,000.
_MAX_GRID_CELLS = 5_000_000
_MC_DRAWS = 100_000


@dataclass(frozen=True)
class PairedVerdict:
    """The paired comparison of evaluation a against evaluation b (difference a - b of the primary metric)."""

    n_problems: int          # common problem ids
    diff: float              # mean of d_i = score_a - score_b
    se: float                # standard error of the mean difference (problems as the unit)
    ci_low: float
    ci_high: float
    p_value: float           # two-sided sign-flip permutation p-value (exact unless p_method says otherwise)
    p_method: str            # "exact" or "monte-carlo"
    verdict: str             # one of VERDICTS
    margin: float
    alpha: float

    def as_dict(self) -> dict:
        """Plain fields, for tables and JSON."""
        return asdict(self)


# A per-problem score column of samples.parquet, where an evaluation has one other than the mean of its samples:
# adaptive samples' two-stage estimate (evaldag.decisions.adaptive.problem_estimates), the same on each of its rows.
PROBLEM_SCORE = "problem_score"


def per_problem_scores(samples: pl.DataFrame) -> pl.DataFrame:
    """One row per problem of a per-sample table (samples.parquet): sample_id, n, score = mean correctness, or the
    table's PROBLEM_SCORE where it has one (an adaptive evaluation's unbiased estimate)."""
    if "correct" not in samples.columns or "sample_id" not in samples.columns:
        raise ValueError(f"a per-sample table needs sample_id and correct, got columns {samples.columns}")
    score = (pl.col(PROBLEM_SCORE).first() if PROBLEM_SCORE in samples.columns
             else pl.col("correct").cast(pl.Float64).mean())
    return samples.group_by("sample_id").agg(n=pl.len(), score=score.cast(pl.Float64)).sort("sample_id")


def read_scored_samples(path: str) -> pl.DataFrame:
    """What per_problem_scores needs of a samples.parquet file: sample_id, correct, and PROBLEM_SCORE if present."""
    present = pl.read_parquet_schema(path)
    return pl.read_parquet(path, columns=[c for c in ("sample_id", "correct", PROBLEM_SCORE) if c in present])


def paired_differences(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Join two per-problem score tables on their common sample ids: sample_id, score_a, score_b, n_a, n_b, d."""
    return (a.select("sample_id", score_a="score", n_a="n")
            .join(b.select("sample_id", score_b="score", n_b="n"), on="sample_id", how="inner")
            .with_columns(d=pl.col("score_a") - pl.col("score_b"))
            .sort("sample_id"))


def _null_on_grid(units: np.ndarray) -> np.ndarray:
    """Exact distribution of S = sum_i eps_i * units_i (eps_i = +-1 fair coins, units_i >= 0 integers), as
    probabilities on -K..K (K = sum units)."""
    total = int(units.sum())
    probs = np.zeros(2 * total + 1)
    probs[total] = 1.0
    span = 0   # the support so far is total-span .. total+span: only that part is shifted
    for k in units[units > 0]:
        k = int(k)
        lo, hi = total - span, total + span + 1
        new = np.zeros_like(probs)
        new[lo - k:hi - k] += 0.5 * probs[lo:hi]
        new[lo + k:hi + k] += 0.5 * probs[lo:hi]
        probs = new
        span += k
    return probs


def sign_flip_p_value(d: np.ndarray, grid: int | None = None, seed: int = 0) -> tuple[float, str]:
    """Two-sided p-value of H0 "each d_i is symmetric about 0" for the statistic |sum d_i|: (p, method).

    With `grid` (the d_i are multiples of 1/grid, e.g. the common number of samples per problem n, or the lcm of
    the two evaluations' n) the null distribution is exact; otherwise, or when the grid would be too large, it is
    estimated from sign-flips drawn at random (p = (1 + hits) / (1 + draws), never 0)."""
    d = np.asarray(d, dtype=np.float64)
    if d.size == 0 or not np.any(d):
        return 1.0, "exact"
    if grid is not None:
        units = np.rint(np.abs(d) * grid).astype(np.int64)
        on_grid = np.allclose(units, np.abs(d) * grid, atol=1e-6)
        if on_grid and 2 * units.sum() + 1 <= _MAX_GRID_CELLS:
            probs = _null_on_grid(units)
            total = int(units.sum())
            observed = abs(int(np.rint(d.sum() * grid)))
            support = np.abs(np.arange(-total, total + 1))
            return float(min(1.0, probs[support >= observed].sum())), "exact"
    rng = np.random.default_rng(seed)
    observed = abs(d.sum()) - 1e-12 * max(1.0, np.abs(d).sum())   # ties count as at least as extreme
    hits, rows = 0, max(1, 2_000_000 // d.size)
    for start in range(0, _MC_DRAWS, rows):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(rows, _MC_DRAWS - start), d.size))
        hits += int((np.abs(signs @ np.abs(d)) >= observed).sum())
    return (1 + hits) / (1 + _MC_DRAWS), "monte-carlo"


def verdict_from_interval(ci_low: float, ci_high: float, margin: float, p_value: float | None = None,
                          alpha: float = 0.05) -> str:
    """The decision rule: `equivalent` if [ci_low, ci_high] lies inside [-margin, margin]; else `better` if it lies
    above 0 (and p_value, when given, is below alpha), `worse` if below 0 (idem); else `undecided`."""
    if any(map(math.isnan, (ci_low, ci_high))):
        return "undecided"
    significant = p_value is None or p_value < alpha
    if margin > 0 and -margin <= ci_low and ci_high <= margin:
        return "equivalent"
    if ci_low > 0 and significant:
        return "better"
    if ci_high < 0 and significant:
        return "worse"
    return "undecided"


def paired_test(d: Iterable[float], margin: float = 0.02, alpha: float = 0.05, grid: int | None = None,
                min_problems: int = 10) -> PairedVerdict:
    """Mean paired difference with its t interval, the exact sign-flip p-value and the verdict (module docstring).

    `d`: one difference per problem (per-problem mean of a minus that of b), each in [-1, 1]; `grid`: the d_i are
    multiples of 1/grid (the samples per problem n when both evaluations have n), for the exact p-value."""
    from scipy.stats import t as student_t

    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    d = np.asarray(list(d) if not isinstance(d, np.ndarray) else d, dtype=np.float64)
    m = d.size
    if m == 0:
        nan = float("nan")
        return PairedVerdict(0, nan, nan, nan, nan, 1.0, "exact", "undecided", margin, alpha)
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(m)) if m > 1 else float("nan")
    if m > 1:
        half = float(student_t.ppf(1 - alpha / 2, m - 1)) * se
        lo, hi = mean - half, mean + half
    else:
        lo = hi = float("nan")
    p, method = sign_flip_p_value(d, grid)
    verdict = verdict_from_interval(lo, hi, margin, p, alpha) if m >= min_problems else "undecided"
    return PairedVerdict(m, mean, se, lo, hi, p, method, verdict, margin, alpha)


def compare_scores(a: pl.DataFrame, b: pl.DataFrame, margin: float = 0.02, alpha: float = 0.05,
                   min_problems: int = 10) -> PairedVerdict:
    """`paired_test` of two per-problem score tables (per_problem_scores) on their common problem ids."""
    pairs = paired_differences(a, b)
    ns = set(pairs["n_a"].unique().to_list()) | set(pairs["n_b"].unique().to_list())
    grid = math.lcm(*ns) if ns else None
    return paired_test(pairs["d"].to_numpy(), margin, alpha, grid, min_problems)



__all__ = ["PROBLEM_SCORE", "VERDICTS", "PairedVerdict", "compare_scores", "paired_differences", "paired_test",
           "per_problem_scores", "read_scored_samples", "sign_flip_p_value", "verdict_from_interval"]

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
  conservative (the textbook TOST uses the (1 - 2 alpha) interval) and keeps one interval on screen. `equivalent`
  also needs the bound for rare, one-sided differences inside the margin (`rare_within_margin`): problems that all
  agree give the t interval a zero width, which on a 30-problem set called a 2-point regression `equivalent` in
  55 % of runs. Fewer than `min_problems` common problems are always `undecided`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl
# scipy.special, not scipy.stats, at import: every flow run imports this module (docs/performance.md)
from scipy.special import ndtr, ndtri, stdtrit

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
    if verdict == "equivalent" and not rare_within_margin([d], margin, alpha):
        verdict = verdict_from_interval(lo, hi, 0.0, p, alpha)
    return PairedVerdict(m, mean, se, lo, hi, p, method, verdict, margin, alpha)


def look_quantile(z: float, count: int) -> float:
    """The multiplier of a look over `count` problems at boundary z: Student's t with count - 1 degrees of freedom
    at the normal tail of z."""
    return float(-stdtrit(count - 1, ndtr(-z)))


def _kl_bernoulli(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(Bernoulli(p) || Bernoulli(q)), elementwise, 0 log 0 = 0."""
    p = np.clip(p, 0.0, 1.0)
    q = np.clip(q, 1e-300, 1 - 1e-16)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(p > 0, p * np.log(p / q), 0.0)
        b = np.where(p < 1, (1 - p) * np.log((1 - p) / (1 - q)), 0.0)
    return a + b


def _chernoff_bound(mean: np.ndarray, m: int, delta: float, upper: bool) -> np.ndarray:
    """The Chernoff-Hoeffding bound on the mean of m independent values in [0, 1] with sample mean `mean`: the
    mu beyond `mean` (above when `upper`) with m KL(mean || mu) = log(1 / delta); it errs with probability at most
    delta (Hoeffding 1963, Thm 1: the Bernoulli is the worst case for [0, 1] data). With a zero mean the upper bound
    is 1 - delta^(1/m), the Clopper-Pearson bound of zero successes in m."""
    mean = np.clip(np.asarray(mean, dtype=np.float64), 0.0, 1.0)
    lo, hi = (mean.copy(), np.ones_like(mean)) if upper else (np.zeros_like(mean), mean.copy())
    target = math.log(1 / delta) / m
    for _ in range(50):
        mid = (lo + hi) / 2
        inside = _kl_bernoulli(mean, mid) <= target
        if upper:
            lo, hi = np.where(inside, mid, lo), np.where(inside, hi, mid)
        else:
            lo, hi = np.where(inside, lo, mid), np.where(inside, mid, hi)
    return hi if upper else lo


def rare_interval(d: np.ndarray, z: float, d_high: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """An interval for the mean of `d` (shape (T,) or (runs, T); `d_high` as in sequential.look_interval) that holds
    when differences are rare and one-sided, where the t interval does not: with no differing problem among 150 the t
    interval's half-width is 0.017 (the pseudo-observation's spread alone), while 2 % of problems broken and none
    fixed shows no difference in 150 with probability 0.05.

    The bound. The t interval's spread, read from the few problems that differ, underestimates the variance of a
    rare difference; here it is replaced by an upper confidence bound on E[d^2] >= Var(d) (Wilson's idea, the
    variance taken at the bound rather than at the estimate): the Chernoff-Hoeffding bound of the mean of d^2, valid
    for any data in [0, 1] (`_chernoff_bound`; with no differing problem it is 1 - delta^(1/m), Clopper-Pearson's
    bound of zero events), at the look's one-sided nominal level Phi(-z). The half-width is then the look's t
    multiplier times sqrt(U / m): with no differing problem in 150 it is 0.039 (the exact Clopper-Pearson bound on a
    one-sided rate there: 0.035), and where many problems differ it is close to the t interval's, so Pocock's planned
    looks and boundary are kept and `equivalent` stays within reach. Why not exact bounds on the shares of problems
    broken and fixed, each a binomial rate for n = 1: their Bernoulli worst case ignores that with n > 1 samples a
    problem's difference is a fraction, and on MATH-500-like data with n = 4 they never reached `equivalent` at
    margin 0.05 between identical checkpoints (the t interval: 94 %); a betting confidence sequence would pay for
    looks decide never takes (module docstring). Its coverage rests on the normal approximation at a variance that
    is not underestimated; simulated in bench/bench_decide.py, line (e)."""
    lo_d = np.atleast_2d(np.asarray(d, dtype=np.float64))
    hi_d = lo_d if d_high is None else np.atleast_2d(np.asarray(d_high, dtype=np.float64))
    m = lo_d.shape[1]
    if m < 2:
        return np.full(lo_d.shape[0], -1.0), np.full(lo_d.shape[0], 1.0)
    # d^2 at its greatest over the unfinished samples' ranges
    square = np.maximum(lo_d ** 2, hi_d ** 2)
    bound = _chernoff_bound(square.mean(axis=1), m, float(ndtr(-z)), upper=True)
    half = look_quantile(z, m) * np.sqrt(bound / m)
    return np.maximum(lo_d.mean(axis=1) - half, -1.0), np.minimum(hi_d.mean(axis=1) + half, 1.0)


def rare_within_margin(ds: Sequence[np.ndarray], margin: float, alpha: float) -> bool:
    """Whether `equivalent` also holds for a rare, one-sided difference: the t interval's spread, read from the few
    problems that differ, underestimates it (30 agreeing problems give a zero-width interval, yet a checkpoint that
    breaks 2 % of problems and fixes none agrees on all 30 with probability 0.55). The bound for that case,
    evaldag.decisions.sequential.rare_interval at one look, of each candidate's differences `ds[j]` (lower ends at
    alpha, upper at alpha / k, as the t intervals are read), min over candidates, must lie in [-margin, margin]."""
    k = len(ds)
    low = min(float(rare_interval(d, float(-ndtri(alpha / 2)))[0][0]) for d in ds)
    high = min(float(rare_interval(d, float(-ndtri(alpha / (2 * k))))[1][0]) for d in ds)
    return -margin <= low and high <= margin


def compare_scores(a: pl.DataFrame, b: pl.DataFrame, margin: float = 0.02, alpha: float = 0.05,
                   min_problems: int = 10) -> PairedVerdict:
    """`paired_test` of two per-problem score tables (per_problem_scores) on their common problem ids."""
    pairs = paired_differences(a, b)
    ns = set(pairs["n_a"].unique().to_list()) | set(pairs["n_b"].unique().to_list())
    grid = math.lcm(*ns) if ns else None
    return paired_test(pairs["d"].to_numpy(), margin, alpha, grid, min_problems)



__all__ = ["PROBLEM_SCORE", "VERDICTS", "PairedVerdict", "compare_scores", "look_quantile", "paired_differences",
           "paired_test", "per_problem_scores", "rare_interval", "rare_within_margin", "read_scored_samples",
           "sign_flip_p_value", "verdict_from_interval"]

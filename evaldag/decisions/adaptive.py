"""Adaptive samples per problem: a first round of n0 samples everywhere, then more where the outcome is uncertain.

What it estimates: the benchmark's mean accuracy as avg@n does, the mean over problems of each problem's solve rate
(mean of means), with an interval **for this problem set** (the problems' solve rates held fixed, only the sampling
random). That is the part of the uncertainty that more samples can shrink; the uncertainty of which problems were
drawn (what the bootstrap over problems of evaldag.scoring.sampling_metrics also covers) does not shrink with samples at all,
and on a 30-problem set it dominates. Both are reported: `ci_low`/`ci_high` (problem set) and
`population_ci_low`/`population_ci_high` (problems as draws from a population: Student's t on the per-problem
estimates, as evaldag.decisions.verdicts does).

The design (stateless: the parent flow calls `next_round` between rounds with a table of per-problem counts):
1. Round 1: n0 samples per problem (`first_correct` of them correct).
2. A plan made from round 1 alone: a problem at 0/n0 or n0/n0 gets `floor` more samples and no more; a problem with
   s correct (0 < s < n0) gets n1(s) proportional to sqrt(E[p(1-p) | s]) (Neyman's allocation, p the solve rate,
   under a Beta prior fitted to round 1 across problems), at least `floor`, at most `max_per_problem` in all, scaled
   so that the total spends the `budget` or the predicted interval width meets `target_ci_width`. The plan depends on
   round 1 only, so every later call recomputes the same plan from the same table; the flow may draw it in one round
   or several.
3. The estimate: each problem's T = a(s) + b(s) x (mean of its later samples), the least-variance estimator that is
   unbiased for every solve rate under this design (evaldag.decisions.twostage: the pooled mean of all samples is not, it
   under-estimates hard problems seen at 0/n0 by several points). Its variance for each problem is averaged over the
   problem's posterior (prior x all its samples), summed, and the interval is normal.

Defaults (n0 = 12, floor = 4) are the best of a design study (bench/study_adaptive.py,
docs/statistics.md "Adaptive samples"): they match fixed n = 32's interval width with about 0.81x its samples on an
AIME-like set, 0.92x on a MATH-500-like one and 0.95x where no problem is exactly 0 or 1. n0 = 4 (the earlier
default) needed more than fixed n = 32 on every model: a problem that looks certain after 4 samples but is not keeps
a large weight on those 4.

When to turn it on: n > 1 on a set where many problems are all-or-nothing for the checkpoint (a hard set such as
AIME, where a third of the problems are never solved, or an easy one). What it costs: the interval is for the
problem set, and the per-problem estimates are noisier for problems whose first round looked certain (they get
only `floor` more samples): a problem at 0/4 that the model solves 10 % of the time is estimated from 4 + floor
samples. With a continuum of solve rates and no problems at exactly 0 or 1, adaptive samples save little (bench:
bench/bench_adaptive.py prints both cases). The `target_ci_width` is met in prediction from round 1, not guaranteed;
the achieved width is reported.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator
# scipy.special, not scipy.stats: every flow run imports this module with the plan, and scipy.stats would add 0.3 s to
# each start on a 2-core box (docs/performance.md); twostage imports scipy.special already
from scipy.special import betaln, ndtri, stdtrit

from evaldag.decisions.twostage import TwoStageWeights, estimates, expected_variance, optimal_weights

COUNT_COLUMNS = ("sample_id", "n", "correct", "first_correct")
# Bounds on the concentration of the fitted Beta prior: a first round of 30 problems can say "all 0/n0", which
# would otherwise fit a point mass and make every posterior variance zero.
_KAPPA_MIN, _KAPPA_MAX = 0.2, 50.0


class AdaptiveSettings(BaseModel):
    """Settings of adaptive samples; exactly one of `budget` and `target_ci_width`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n0: int = Field(12, ge=2, le=64, description="first-round samples per problem (at least 2 to fit the prior)")
    floor: int = Field(4, ge=0, le=1024, description="later samples for a problem whose first round was all "
                                                      "correct or all wrong (and the least any problem gets)")
    max_per_problem: int = Field(64, ge=2, le=4096, description="most samples of one problem, first round included")
    budget: int | None = Field(None, ge=1, description="total samples over all problems, first round included")
    target_ci_width: float | None = Field(None, gt=0, lt=1, description="full width of the problem-set interval "
                                                                         "to plan for (an accuracy: 0.05 = 5 points)")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="level of the intervals")

    @model_validator(mode="after")
    def _check(self) -> "AdaptiveSettings":
        if (self.budget is None) == (self.target_ci_width is None):
            raise ValueError("give exactly one of budget (total samples) and target_ci_width (interval width), "
                             f"got budget={self.budget}, target_ci_width={self.target_ci_width}")
        if self.max_per_problem < self.n0 + self.floor:
            raise ValueError(f"max_per_problem={self.max_per_problem} is below n0 + floor = {self.n0 + self.floor}:"
                             " raise max_per_problem or lower n0/floor")
        return self

    def check_problems(self, problems: int) -> None:
        """Raise ValueError, naming the fix, when the budget cannot pay for the first round and the floor."""
        if self.budget is not None and self.budget < problems * (self.n0 + self.floor):
            raise ValueError(f"budget={self.budget} samples cannot pay for n0 + floor = {self.n0 + self.floor} "
                             f"samples on each of {problems} problems ({problems * (self.n0 + self.floor)}): raise "
                             "the budget, or lower n0 or floor")


@dataclass(frozen=True)
class Plan:
    """Round 1's plan: later samples by first-round correct count, and what it predicts."""

    weights: TwoStageWeights          # n1 per stratum s = 0..n0 and the estimator's a, b
    alpha: float                      # fitted Beta prior of the solve rates
    beta: float
    total: int                        # samples over all problems, first round included
    predicted_width: float            # problem-set interval width predicted from round 1


@dataclass(frozen=True)
class AdaptiveEstimate:
    """Mean accuracy (mean over problems of per-problem solve rates) and its intervals."""

    mean: float
    se: float                         # problem set held fixed
    ci_low: float
    ci_high: float
    population_se: float              # problems as draws from a population
    population_ci_low: float
    population_ci_high: float
    problems: int
    samples: int
    confidence: float

    def as_dict(self) -> dict:
        """Plain fields, for tables, JSON and MLflow metrics."""
        return asdict(self)


def counts_from_samples(samples: pl.DataFrame, n0: int) -> pl.DataFrame:
    """Per-problem counts (sample_id, n, correct, first_correct) of a per-sample table with sample_id, sample_index
    and correct; the first round is sample_index < n0. Raises ValueError when a problem's indices have gaps."""
    missing = {"sample_id", "sample_index", "correct"} - set(samples.columns)
    if missing:
        raise ValueError(f"a per-sample table needs sample_id, sample_index and correct; missing {sorted(missing)}")
    counts = (samples.group_by("sample_id")
              .agg(n=pl.len(), correct=pl.col("correct").cast(pl.Int64).sum(),
                   first_correct=pl.col("correct").filter(pl.col("sample_index") < n0).cast(pl.Int64).sum(),
                   top=pl.col("sample_index").max(), distinct=pl.col("sample_index").n_unique())
              .sort("sample_id"))
    bad = counts.filter((pl.col("top") != pl.col("n") - 1) | (pl.col("distinct") != pl.col("n")))
    if bad.height:
        raise ValueError(f"{bad.height} problems have sample indices that are not 0..n-1 without repeats, e.g. "
                         f"{bad['sample_id'].head(3).to_list()}: a round was drawn twice or in part")
    return counts.select(COUNT_COLUMNS)


def _checked(counts: pl.DataFrame, settings: AdaptiveSettings) -> pl.DataFrame:
    missing = set(COUNT_COLUMNS) - set(counts.columns)
    if missing:
        raise ValueError(f"the counts table needs {list(COUNT_COLUMNS)}; missing {sorted(missing)}")
    if counts.height == 0:
        raise ValueError("the counts table has no problems")
    if counts["sample_id"].is_duplicated().any():
        raise ValueError("the counts table has a sample_id more than once: one row per problem")
    settings.check_problems(counts.height)
    wrong = counts.filter((pl.col("correct") < pl.col("first_correct")) | (pl.col("correct") > pl.col("n"))
                          | (pl.col("first_correct") < 0) | (pl.col("first_correct") > settings.n0))
    if wrong.height:
        raise ValueError(f"{wrong.height} problems have impossible counts (need 0 <= first_correct <= n0 = "
                         f"{settings.n0}, first_correct <= correct <= n), e.g. {wrong['sample_id'].head(3).to_list()}")
    return counts


def fit_prior(first_correct: np.ndarray, n0: int) -> tuple[float, float]:
    """Beta(alpha, beta) of the solve rates by the method of moments on first-round counts (s of n0 each):
    Var(s / n0) = Var(p) + E[p (1 - p)] / n0. The concentration is kept in [0.2, 50]."""
    x = np.asarray(first_correct, dtype=np.float64) / n0
    m = x.size
    mu = float(np.clip(x.mean(), 0.5 / (m * n0), 1 - 0.5 / (m * n0)))
    var_x = float(x.var(ddof=1)) if m > 1 else 0.0
    var_p = (var_x - mu * (1 - mu) / n0) * n0 / (n0 - 1)
    kappa = mu * (1 - mu) / var_p - 1 if var_p > 0 else _KAPPA_MAX
    kappa = float(np.clip(kappa, _KAPPA_MIN, _KAPPA_MAX))
    return mu * kappa, (1 - mu) * kappa


def _posterior_pq(n0: int, alpha: float, beta: float) -> np.ndarray:
    """E[p (1 - p) | s of n0 correct] under the prior, for s = 0..n0."""
    s = np.arange(n0 + 1)
    return np.exp(betaln(alpha + s + 1, beta + n0 - s + 1) - betaln(alpha + s, beta + n0 - s))


def plan(counts: pl.DataFrame, settings: AdaptiveSettings) -> Plan:
    """The later samples of each first-round stratum (module docstring, step 2), from the first-round counts."""
    counts = _checked(counts, settings)
    n0 = settings.n0
    s = counts["first_correct"].to_numpy().astype(np.int64)
    m = s.size
    alpha, beta = fit_prior(s, n0)
    h = np.bincount(s, minlength=n0 + 1)
    shape = np.sqrt(_posterior_pq(n0, alpha, beta))
    most = settings.max_per_problem - n0
    z = float(ndtri(0.5 + settings.confidence / 2))

    def sizes(scale: float) -> np.ndarray:
        n1 = np.clip(np.floor(scale * shape), settings.floor, most).astype(np.int64)
        n1[0] = n1[n0] = settings.floor         # all wrong or all right: the floor and no more
        return n1

    def width(n1: np.ndarray) -> tuple[float, TwoStageWeights]:
        w = optimal_weights(n0, n1, alpha, beta)
        # expected variance of a problem in stratum s: over the prior's posterior after s of n0
        v = expected_variance(w, alpha + np.arange(n0 + 1), beta + n0 - np.arange(n0 + 1))
        return 2 * z * math.sqrt(max(float(h @ v), 0.0)) / m, w

    def total(n1: np.ndarray) -> int:
        return int(m * n0 + h @ n1)

    # total and predicted width move monotonically with the scale; bisect on it
    lo, hi = 0.0, (most + 1) / max(float(shape[1:n0].min()) if n0 > 1 else 1.0, 1e-9)
    for _ in range(30):
        mid = (lo + hi) / 2
        n1 = sizes(mid)
        ok = total(n1) <= settings.budget if settings.budget is not None else width(n1)[0] > settings.target_ci_width
        lo, hi = (mid, hi) if ok else (lo, mid)
    n1 = sizes(lo if settings.budget is not None else hi)
    predicted, w = width(n1)
    return Plan(weights=w, alpha=alpha, beta=beta, total=total(n1), predicted_width=predicted)


def next_round(counts: pl.DataFrame, settings: AdaptiveSettings) -> pl.DataFrame:
    """How many more samples each problem gets now: sample_id, n (drawn so far), target_n, more (0: done).

    Until every problem has its n0 first-round samples, the round is the rest of the first round (`first_correct`
    is then not read); after it, the rest of the plan. All `more` zero: the evaluation is complete, call `estimate`.
    Raises ValueError when a problem already has more samples than its plan (the table does not belong to these
    settings)."""
    counts = _checked(counts, settings)
    if (counts["n"] < settings.n0).any():
        return counts.select("sample_id", "n", target_n=pl.lit(settings.n0, pl.Int64),
                             more=pl.max_horizontal(pl.lit(settings.n0) - pl.col("n"), pl.lit(0)).cast(pl.Int64))
    return _next_round(counts, settings, plan(counts, settings))


def _next_round(counts: pl.DataFrame, settings: AdaptiveSettings, p: Plan) -> pl.DataFrame:
    out = counts.select("sample_id", "n", target_n=pl.Series(
        settings.n0 + p.weights.n1[counts["first_correct"].to_numpy()], dtype=pl.Int64))
    over = out.filter(pl.col("n") > pl.col("target_n"))
    if over.height:
        raise ValueError(f"{over.height} problems have more samples than their plan, e.g. "
                         f"{over.head(3).rows()} (sample_id, n, planned): these counts were drawn with other settings")
    return out.with_columns(more=(pl.col("target_n") - pl.col("n")).cast(pl.Int64))


def estimate(counts: pl.DataFrame, settings: AdaptiveSettings) -> AdaptiveEstimate:
    """The mean accuracy and its intervals (module docstring, step 3) once `next_round` says nothing is left.
    Raises ValueError, naming the problems, while a plan is not complete."""
    return _estimate(counts, settings)[0]


def _estimate(counts: pl.DataFrame, settings: AdaptiveSettings) -> tuple[AdaptiveEstimate, Plan, np.ndarray]:
    """`estimate`, with the plan it was made under and each problem's estimate T (in the order of `counts`)."""
    counts = _checked(counts, settings)
    if (counts["n"] < settings.n0).any():
        raise ValueError("the first round is not complete: draw next_round's samples first")
    p = plan(counts, settings)
    rest = _next_round(counts, settings, p)
    if rest["more"].sum() > 0:
        left = rest.filter(pl.col("more") > 0)
        raise ValueError(f"{left.height} problems still have samples to draw ({int(left['more'].sum())} in all, "
                         f"e.g. {left['sample_id'].head(3).to_list()}): draw next_round's samples first")
    s = counts["first_correct"].to_numpy()
    total_correct = counts["correct"].to_numpy()
    n = counts["n"].to_numpy()
    t = estimates(p.weights, s, total_correct - s)
    m = t.size
    v = expected_variance(p.weights, p.alpha + total_correct, p.beta + n - total_correct)
    se = math.sqrt(max(float(v.sum()), 0.0)) / m
    z = float(ndtri(0.5 + settings.confidence / 2))
    mean = float(t.mean())
    pop_se = float(t.std(ddof=1) / math.sqrt(m)) if m > 1 else float("nan")
    tq = float(stdtrit(m - 1, 0.5 + settings.confidence / 2)) if m > 1 else float("nan")
    est = AdaptiveEstimate(mean=mean, se=se, ci_low=mean - z * se, ci_high=mean + z * se, population_se=pop_se,
                           population_ci_low=mean - tq * pop_se, population_ci_high=mean + tq * pop_se,
                           problems=m, samples=int(n.sum()), confidence=settings.confidence)
    return est, p, t


def evaluation_metrics(counts: pl.DataFrame, settings: AdaptiveSettings) -> tuple[dict[str, float], pl.DataFrame]:
    """An adaptive evaluation's headline figures from its complete per-problem counts (both rounds; raises
    ValueError, as `estimate`, while a planned sample is missing), and each problem's two-stage estimate
    (sample_id, estimate), whose mean is the accuracy: what paired verdicts compare per problem (a problem's plain
    mean of all its samples leans towards its first round).

    `accuracy` is the estimate, `accuracy_ci_low`/`_high` its interval with problems as draws (what a fixed-n
    evaluation's accuracy interval means; where every problem's estimate is the same, the Wilson interval over
    problems, as for fixed n) and `accuracy_se` its standard error, and `adaptive_*` the interval for this problem
    set, the width round 1 predicted, and the samples spent."""
    from evaldag.scoring.sampling_metrics import wilson_interval

    est, p, t = _estimate(counts, settings)
    # the estimator's sums can land a rounding error outside [0, 1] (every problem always wrong: -3e-16)
    mean = min(max(est.mean, 0.0), 1.0)
    low, high = est.population_ci_low, est.population_ci_high
    if not high > low:
        low, high = wilson_interval(mean * est.problems, est.problems, settings.confidence)
    return {
        "accuracy": mean, "accuracy_ci_low": max(0.0, low), "accuracy_ci_high": min(1.0, high),
        "accuracy_se": est.population_se,
        "adaptive_set_ci_low": max(0.0, est.ci_low), "adaptive_set_ci_high": min(1.0, est.ci_high),
        "adaptive_set_ci_width": est.ci_high - est.ci_low, "adaptive_predicted_width": p.predicted_width,
        "adaptive_samples": float(est.samples), "adaptive_samples_per_problem": est.samples / est.problems,
        "n_samples": float(est.samples),
    }, _checked(counts, settings).select("sample_id").with_columns(estimate=pl.Series(t, dtype=pl.Float64))


__all__ = ["AdaptiveEstimate", "AdaptiveSettings", "Plan", "counts_from_samples", "estimate", "evaluation_metrics",
           "fit_prior", "next_round", "plan"]

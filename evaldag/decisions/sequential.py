"""Anytime-valid verdicts for stopping an evaluation early: a confidence sequence for the mean paired difference.

Looking at a fixed-n paired test after every round of problems and stopping at the first "significant" result
inflates its false-positive rate far above alpha. A confidence sequence (CS) is a sequence of intervals C_1, C_2, ...
that contain the true mean at every time simultaneously with probability >= 1 - alpha, so the verdict may be read
after every round, and the evaluation stopped at any data-dependent time, at level alpha.

This one is the hedged-capital betting CS of Waudby-Smith & Ramdas (2023, "Estimating means of bounded random
variables by betting", JRSS-B, Theorem 3 with the predictable plug-in bets of their eq. (26)), for observations in
[-1, 1] (per-problem differences of mean correctness, d_i = score_a(i) - score_b(i)), rescaled to x = (d + 1) / 2 in
[0, 1]. For each candidate mean m, two gamblers bet for and against x having mean m:
  K+_t(m) = prod_{i<=t} (1 + l+_i(m) (x_i - m)),   K-_t(m) = prod_{i<=t} (1 - l-_i(m) (x_i - m)),
with bets l_i chosen from x_1..x_{i-1} only (predictable) and capped (l+ <= c/m, l- <= c/(1-m)) so the capital stays
positive. If m is the true mean both are nonnegative martingales, so by Ville's inequality the hedged capital
max(K+/2, K-/2) ever reaches 1/alpha with probability <= alpha. The CS is the set of m never rejected so far (the
running intersection, computed on a grid of candidate means and widened by one grid step so it stays conservative);
it adapts to the variance of d (many problems both checkpoints solve or both fail make d = 0 and the CS narrow),
unlike a Hoeffding bound.

Validity needs the d_i to be draws from the population whose mean is the target: problems must be taken in a
random order (a benchmark file is sorted by subject or level), fixed before looking at any result. The target is the
same as the fixed-n paired test's: the mean difference over the distribution the benchmark's problems and the
checkpoints' samples are drawn from. The verdict is the fixed-n rule (evaldag.decisions.verdicts.verdict_from_interval) read on
the CS: `equivalent` inside [-margin, margin], `better` above 0, `worse` below 0, else `undecided` (keep going).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from evaldag.decisions.verdicts import verdict_from_interval


@dataclass(frozen=True)
class SequentialVerdict:
    """The state of a sequential comparison after `n` problems."""

    n: int
    mean: float              # mean of the differences so far
    ci_low: float            # the confidence sequence at time n (running intersection)
    ci_high: float
    verdict: str             # better / worse / equivalent / undecided (undecided: keep evaluating)
    alpha: float
    margin: float


def _observation_ranges(d: np.ndarray, d_high: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """confidence_sequence's observations as ranges of x = (d + 1) / 2 in [0, 1], shape (runs, T) (low, high), and
    whether `d` was a single sequence; refuses observations outside [-1, 1] or a d_high below d."""
    lo_d = np.asarray(d, dtype=np.float64)
    hi_d = lo_d if d_high is None else np.asarray(d_high, dtype=np.float64)
    if hi_d.shape != lo_d.shape or np.any(hi_d < lo_d):
        raise ValueError("d_high must have d's shape and be >= d everywhere")
    single = lo_d.ndim == 1
    lo2, hi2 = (lo_d[None, :], hi_d[None, :]) if single else (lo_d, hi_d)
    if lo2.size and (np.nanmax(np.abs(lo2)) > 1 + 1e-12 or np.nanmax(np.abs(hi2)) > 1 + 1e-12):
        raise ValueError("observations must lie in [-1, 1]")
    return np.clip((lo2 + 1) / 2, 0.0, 1.0), np.clip((hi2 + 1) / 2, 0.0, 1.0), single


def _surviving_bounds(alive: np.ndarray, m: np.ndarray, xs: tuple[np.ndarray, np.ndarray], t: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The lowest and highest surviving candidate means of each run, one grid step wider (a true mean between two
    grid points); where none survives (probability <= alpha), the observations' mean range instead of NaN."""
    step = m[1] - m[0]
    any_alive = alive.any(axis=1)
    first = np.argmax(alive, axis=1)
    last = len(m) - 1 - np.argmax(alive[:, ::-1], axis=1)
    lo_x = np.where(any_alive, m[first] - step, xs[0] / (t + 2))
    hi_x = np.where(any_alive, m[last] + step, xs[1] / (t + 2))
    return lo_x, hi_x


def confidence_sequence(d: np.ndarray, alpha: float = 0.05, grid_size: int = 401, c: float = 0.5,
                        tune_at: int | None = None, d_high: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Betting confidence sequence for the mean of observations in [-1, 1], at every time.

    `d`: shape (T,) or (runs, T), one row per independent sequence (vectorised for simulations). Returns (low,
    high), each of d's shape: the interval after 1, 2, ..., T observations, valid simultaneously over all times with
    probability >= 1 - alpha. `c` caps the bets (WSR suggest 1/2 or 3/4); `tune_at` tunes the bets to be sharpest
    near that many observations (e.g. half the problems, where one hopes to stop), otherwise the bets shrink like
    1 / sqrt(t log t), good at every time.

    `d_high`: where some observations are known only to lie in a range (a problem whose longest samples still
    run: its unfinished samples may still be right or wrong), `d` holds each one's lowest value and `d_high` its
    highest (equal where known). The result then contains the interval the exact observations would give, whatever
    they turn out to be: a candidate mean is dropped only where every value in the ranges rejects it (each bet's
    capital is bounded below over the ranges, and so is the bet size, whose variance estimate is bounded by
    interval arithmetic). So a verdict read on it is one the complete data would give at that time, and it stays
    valid at level alpha at any time it is read."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    x_lo, x_hi, single = _observation_ranges(d, d_high)
    runs, horizon = x_lo.shape
    m = np.linspace(0.0, 1.0, grid_size)                   # candidate means of x
    with np.errstate(divide="ignore"):
        cap_plus = np.where(m > 0, c / m, np.inf)            # keeps 1 + l (x - m) >= 1 - c > 0 for x >= 0
        cap_minus = np.where(m < 1, c / (1 - m), np.inf)     # keeps 1 - l (x - m) >= 1 - c > 0 for x <= 1
    log_kp = np.zeros((runs, grid_size))
    log_km = np.zeros((runs, grid_size))
    alive = np.ones((runs, grid_size), dtype=bool)
    threshold = math.log(1 / alpha) + math.log(2)           # max(K+/2, K-/2) >= 1/alpha
    low = np.empty((runs, horizon))
    high = np.empty((runs, horizon))
    # WSR's predictable plug-ins: mean and variance estimates with a prior pseudo-observation (1/2, 1/4), each as
    # a range [lo, hi] over the observations' ranges (a point where everything is known)
    mu = (np.full(runs, 0.5), np.full(runs, 0.5))
    sq = (np.full(runs, 0.25), np.full(runs, 0.25))
    xs = (np.full(runs, 0.5), np.full(runs, 0.5))
    for t in range(horizon):
        denom = tune_at if tune_at is not None else (t + 1) * math.log(t + 2)
        # a smaller variance estimate makes a larger bet: lam_hi from sq's low end
        lam_lo, lam_hi = (np.sqrt(2 * math.log(2 / alpha) / (v / (t + 1) * denom)) for v in (sq[1], sq[0]))
        xl, xh = x_lo[:, t:t + 1], x_hi[:, t:t + 1]
        # the least capital over the ranges: K+ grows with x, so its lowest x; a winning bet (x >= m) at its
        # smallest size, a losing one at its largest; K- the mirror image
        up = xl >= m[None, :]
        lp = np.minimum(np.where(up, lam_lo[:, None], lam_hi[:, None]), cap_plus[None, :])
        log_kp += np.log1p(lp * (xl - m[None, :]))
        down = xh <= m[None, :]
        lm = np.minimum(np.where(down, lam_lo[:, None], lam_hi[:, None]), cap_minus[None, :])
        log_km += np.log1p(-lm * (xh - m[None, :]))
        alive &= np.maximum(log_kp, log_km) < threshold
        # the observations so far (the mean range where no candidate survives), then the surviving candidates
        xs = (xs[0] + x_lo[:, t], xs[1] + x_hi[:, t])
        lo_x, hi_x = _surviving_bounds(alive, m, xs, t)
        low[:, t] = 2 * np.clip(lo_x, 0, 1) - 1
        high[:, t] = 2 * np.clip(hi_x, 0, 1) - 1
        sq = _square_range(x_lo[:, t], x_hi[:, t], mu, sq)
        mu = (xs[0] / (t + 2), xs[1] / (t + 2))
    return (low[0], high[0]) if single else (low, high)


def _square_range(x_lo: np.ndarray, x_hi: np.ndarray, mu: tuple[np.ndarray, np.ndarray],
                  sq: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The running sum of (x - mu)^2 as a range, given x in [x_lo, x_hi] and mu in `mu`'s range."""
    gap = np.maximum(0.0, np.maximum(x_lo - mu[1], mu[0] - x_hi))          # 0 where the ranges overlap
    far = np.maximum(np.abs(x_lo - mu[1]), np.abs(x_hi - mu[0]))
    return sq[0] + gap ** 2, sq[1] + far ** 2


def sequential_verdict(d: np.ndarray, alpha: float = 0.05, margin: float = 0.02, **cs_options) -> SequentialVerdict:
    """The verdict after the differences observed so far (in the random order they were evaluated): the confidence
    sequence at the last time and the fixed-n decision rule read on it. Reading it after every round is valid."""
    d = np.asarray(d, dtype=np.float64)
    if d.size == 0:
        return SequentialVerdict(0, float("nan"), -1.0, 1.0, "undecided", alpha, margin)
    low, high = confidence_sequence(d, alpha, **cs_options)
    lo, hi = float(low[-1]), float(high[-1])
    return SequentialVerdict(d.size, float(d.mean()), lo, hi, verdict_from_interval(lo, hi, margin), alpha, margin)


def stopping_times(d: np.ndarray, rounds: int | list[int], alpha: float = 0.05, margin: float = 0.02,
                   **cs_options) -> tuple[np.ndarray, np.ndarray]:
    """Run the sequential rule on many sequences at once: for each row of `d` (runs, T), the number of problems
    evaluated when it stopped and its verdict ("undecided" where it never decided within T). `rounds`: a round size
    (the verdict is read after every `rounds` problems and at T) or the explicit list of times to read it."""
    d = np.atleast_2d(np.asarray(d, dtype=np.float64))
    runs, horizon = d.shape
    times = (sorted(set(range(rounds, horizon + 1, rounds)) | {horizon}) if isinstance(rounds, int)
             else sorted(rounds))
    low, high = confidence_sequence(d, alpha, **cs_options)
    stop = np.full(runs, horizon)
    verdict = np.full(runs, "undecided", dtype=object)
    open_ = np.ones(runs, dtype=bool)
    for t in times:
        lo, hi = low[:, t - 1], high[:, t - 1]
        decided = np.array([verdict_from_interval(a, b, margin) for a, b in zip(lo, hi)], dtype=object)
        now = open_ & (decided != "undecided")
        stop[now] = t
        verdict[now] = decided[now]
        open_ &= ~now
    return stop, verdict


__all__ = ["SequentialVerdict", "confidence_sequence", "sequential_verdict", "stopping_times"]

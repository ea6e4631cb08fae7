"""Verdicts that may be read at every round end: repeated confidence intervals of a group-sequential design.

Looking at a fixed-n paired test after every round of problems and stopping at the first "significant" result
inflates its false-positive rate far above alpha. Here the looks are planned: the verdict is read after a fixed list
of problem counts (decide's round ends, known before any result), and every look's interval uses one wider critical
value z, chosen so that the intervals at all the looks contain the true mean together with probability 1 - alpha
(Pocock's constant boundary, as repeated confidence intervals: Jennison & Turnbull, "Group Sequential Methods",
2000, ch. 2 and 9). The evaluation may stop at the first decided look; a verdict read there errs with probability
at most alpha, however the looks' results turn out.

z is exact for the normal approximation of the running mean: the probability that a Brownian motion leaves
+-z sqrt(t) at one of the looks' information fractions is computed by recursive numerical integration (Armitage,
McPherson & Rowe, 1969) and z found by bisection. At each look the interval is the paired mean +- z' s / sqrt(m),
with z' the Student t quantile of the same tail (m - 1 degrees of freedom) and s the sample standard deviation
with one pseudo-observation of the widest spread (1, the width of d's range), so that a look whose problems all
happen to agree cannot claim a zero-width interval. Simulated on MATH-500-like difficulty (bench/bench_decide.py),
the false verdict rate stays below alpha both greedy and with n > 1 samples, at 10 looks and at every problem.

Why not an anytime-valid confidence sequence (evaldag used Waudby-Smith & Ramdas' betting CS before issue 37): it
pays for being valid at every time and every stopping rule, which decide never uses (it reads only round ends), with
intervals so wide that its false verdict rate was 0.3-0.7 % at alpha 5 % and a 6-point difference needed 40 % of
MATH-500 on median; this design decides it at 30 % (bench_decide), which at GPU scale is most of the token saving.

Validity needs the d_i to be draws from the population whose mean is the target: problems in a random order fixed
before any result, and the looks fixed before any result too (decide: the round ends of the problem count). The
verdict is the fixed-n rule (evaldag.decisions.verdicts.verdict_from_interval) read on the look's interval:
`equivalent` inside [-margin, margin], `better` above 0, `worse` below 0, else `undecided` (keep going); `equivalent`
also needs `rare_interval` inside the margin, an interval whose spread is not underestimated when the difference is
rare and one-sided (few problems differ, all one way).

Against a job's best (decide's `vs_best`), the new checkpoint is compared with every candidate for the best at once
(`selection_bounds`, evaldag.decisions.best's rule at each look): lower bounds at alpha, upper bounds at alpha / k,
so that picking the best on the problems it is compared on costs no error (docs/statistics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
# scipy.special, not scipy.stats: every flow run imports this module (the shard's pacing) and scipy.stats would add
# 0.3 s to each start on a 2-core box (docs/performance.md)
from scipy.special import ndtr, ndtri

# the rare-difference bound and the look's t multiplier live with the paired test, which reads them too (a fixed-n
# `equivalent` needs the same bound); verdict_from_interval from paired, not verdicts (which reads best, which reads
# this module)
from evaldag.decisions.paired import look_quantile, rare_interval, verdict_from_interval

# the pseudo-observation's squared distance from the mean: d lies in [-1, 1], so no spread exceeds the range's width
PSEUDO_SQUARE = 1.0
# grid points per standard deviation of the shortest step between looks: the trapezoid rule on Gaussian densities
# is accurate to 1e-5 at this spacing (the boundaries of Jennison & Turnbull's Table 2.1 to 4 decimals)
SPACING_PER_SD = 4


@dataclass(frozen=True)
class SequentialVerdict:
    """The state of a sequential comparison after `n` problems."""

    n: int
    mean: float              # mean of the differences so far
    ci_low: float            # the look's repeated confidence interval
    ci_high: float
    verdict: str             # better / worse / equivalent / undecided (undecided: keep evaluating)
    alpha: float
    margin: float


def _stay_probability(z: float, fractions: np.ndarray) -> float:
    """P(|W(t_k)| < z sqrt(t_k) at every look) for a standard Brownian motion W observed at `fractions` (increasing,
    the last 1): the density of W inside the boundary carried from look to look on a grid (trapezoid rule)."""
    steps = np.diff(np.concatenate([[0.0], fractions]))
    spacing = min(math.sqrt(steps.min()) / SPACING_PER_SD, 2 * z / 400)
    density = weights = points = None
    for t, dt in zip(fractions, steps):
        half = z * math.sqrt(t)
        count = max(3, int(math.ceil(2 * half / spacing)) | 1)
        grid = np.linspace(-half, half, count)
        w = np.full(count, grid[1] - grid[0])
        w[[0, -1]] /= 2
        if density is None:
            density = np.exp(-grid ** 2 / (2 * dt)) / math.sqrt(2 * math.pi * dt)
        else:
            kernel = np.exp(-(grid[:, None] - points[None, :]) ** 2 / (2 * dt)) / math.sqrt(2 * math.pi * dt)
            density = kernel @ (weights * density)
        points, weights = grid, w
    return float(weights @ density)


@lru_cache(maxsize=512)
def pocock_boundary(counts: tuple[int, ...], alpha: float) -> float:
    """The critical value z shared by looks after `counts` observations (increasing) such that a mean's normal
    intervals at all of them cover it together with probability 1 - alpha (two-sided)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not counts or any(b <= a for a, b in zip(counts, counts[1:])) or counts[0] < 1:
        raise ValueError(f"looks must be increasing positive counts, got {counts}")
    fractions = np.asarray(counts, dtype=np.float64) / counts[-1]
    lo, hi = -ndtri(alpha / 2), -ndtri(alpha / (2 * len(counts)))    # 1 look; Bonferroni
    if len(counts) == 1:
        return float(lo)
    for _ in range(26):
        mid = (lo + hi) / 2
        if 1 - _stay_probability(mid, fractions) > alpha:
            lo = mid
        else:
            hi = mid
    return float(hi)


def look_spread(squares: np.ndarray | float, m: int) -> np.ndarray | float:
    """The standard deviation a look reads from m values whose squared distances from its centre sum to `squares`:
    with the pseudo-observation (m + 1 values, m - 1 + 1 degrees of freedom), so that m values that all agree still
    give a spread."""
    return np.sqrt((squares + PSEUDO_SQUARE) / m)


def look_interval(d: np.ndarray, z: float, d_high: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The repeated confidence interval of the mean of `d` (shape (T,) or (runs, T): one look over all T) at
    boundary z. `d_high`: where some observations are only known to lie in a range (a problem whose samples still
    run), `d` holds each one's lowest value and `d_high` its highest; the interval then contains the one any values
    inside the ranges would give (the mean's range, widened by an upper bound of the spread), so a verdict read on it
    is one the complete data will give at this look."""
    lo_d = np.atleast_2d(np.asarray(d, dtype=np.float64))
    hi_d = lo_d if d_high is None else np.atleast_2d(np.asarray(d_high, dtype=np.float64))
    if hi_d.shape != lo_d.shape or np.any(hi_d < lo_d):
        raise ValueError("d_high must have d's shape and be >= d everywhere")
    if lo_d.size and (np.abs(lo_d).max() > 1 + 1e-12 or np.abs(hi_d).max() > 1 + 1e-12):
        raise ValueError("observations must lie in [-1, 1]")
    m = lo_d.shape[1]
    if m < 2:
        shape = lo_d.shape[0]
        return np.full(shape, -1.0), np.full(shape, 1.0)
    mean_lo, mean_hi = lo_d.mean(axis=1), hi_d.mean(axis=1)
    centre = ((mean_lo + mean_hi) / 2)[:, None]
    # the spread about any fixed point bounds the spread about the mean; about the centre, by each range's far end
    spread = np.maximum((lo_d - centre) ** 2, (hi_d - centre) ** 2).sum(axis=1)
    half = look_quantile(z, m) * look_spread(spread, m) / math.sqrt(m)
    return np.maximum(mean_lo - half, -1.0), np.minimum(mean_hi + half, 1.0)


@dataclass(frozen=True)
class SelectionBounds:
    """A look's bounds on delta* = min_j (mu_new - mu_j), the difference to the best of k earlier checkpoints
    (evaldag.decisions.best's rule at one look): `low`/`high` from the t intervals, `rare_low`/`rare_high` from
    `rare_interval`; arrays over runs."""

    low: np.ndarray
    high: np.ndarray
    rare_low: np.ndarray
    rare_high: np.ndarray

    def verdicts(self, margin: float) -> np.ndarray:
        """The verdict of each run: `verdict_from_interval` on [low, high], `equivalent` only where the rare-
        difference bounds lie inside the margin too (else better / worse / undecided as the interval says)."""
        out = []
        for lo, hi, rlo, rhi in zip(self.low, self.high, self.rare_low, self.rare_high):
            equivalent_ok = -margin <= rlo and rhi <= margin
            out.append(verdict_from_interval(float(lo), float(hi), margin if equivalent_ok else 0.0))
        return np.array(out, dtype=object)


def selection_bounds(ds: Sequence[np.ndarray], z: float, z_k: float,
                     d_highs: Sequence[np.ndarray | None] | None = None) -> SelectionBounds:
    """The bounds of one look against k earlier checkpoints: `ds[j]` the differences to checkpoint j (shape (T,) or
    (runs, T), the same T for all), `d_highs[j]` their upper ends (`look_interval`). The lower bound is min_j of
    each interval's lower end at boundary `z` (level alpha: better than the best is better than every one, an
    intersection-union claim); the upper bound min_j of the upper ends at boundary `z_k` (level alpha / k,
    Bonferroni: worse than the best is worse than some one, a union of k claims). With the true best j*, the lower
    bound errs only where j*'s does and the upper only where some j's does, so each side errs with at most the
    probability of one checkpoint's, and the pair covers delta* with probability 1 - alpha at every look."""
    if not ds:
        raise ValueError("no earlier checkpoint to compare with: a verdict against the best needs one or more")
    d_highs = list(d_highs) if d_highs is not None else [None] * len(ds)
    lows, highs, rlows, rhighs = [], [], [], []
    for d, dh in zip(ds, d_highs):
        lows.append(look_interval(d, z, dh)[0])
        highs.append(look_interval(d, z_k, dh)[1])
        rlows.append(rare_interval(d, z, dh)[0])
        rhighs.append(rare_interval(d, z_k, dh)[1])
    return SelectionBounds(np.min(lows, axis=0), np.min(highs, axis=0), np.min(rlows, axis=0),
                           np.min(rhighs, axis=0))


def boundaries(looks: Sequence[int], alpha: float, k: int = 1) -> tuple[float, float]:
    """(z, z_k): the Pocock boundary of the looks at alpha (lower bounds) and at alpha / k (upper bounds)."""
    counts = tuple(looks)
    return pocock_boundary(counts, alpha), pocock_boundary(counts, alpha / k)


def sequential_verdict(d: np.ndarray | Sequence[np.ndarray], looks: Sequence[int], alpha: float = 0.05,
                       margin: float = 0.02, d_high: np.ndarray | None = None) -> SequentialVerdict:
    """The verdict at the look after T paired differences (in the random order they were evaluated), one of the
    planned `looks` (paired counts, increasing). `d`: the differences (T,) to one earlier checkpoint, or a list of
    them to each of k candidates for the job's best (`selection_bounds`); `mean` is then the smallest mean."""
    # a list of arrays is one per candidate; anything else (an array, a list of numbers) the differences to one
    candidates = isinstance(d, (list, tuple)) and len(d) > 0 and np.ndim(d[0]) > 0
    ds = [np.asarray(x, dtype=np.float64) for x in d] if candidates else [np.asarray(d, dtype=np.float64)]
    size = ds[0].size
    if size == 0:
        return SequentialVerdict(0, float("nan"), -1.0, 1.0, "undecided", alpha, margin)
    counts = tuple(sorted(set(int(k) for k in looks if k > 0)))
    if size not in counts:
        raise ValueError(f"{size} differences is not one of the planned looks {counts}: a verdict read "
                         "between them is not covered by the boundary")
    z, z_k = boundaries(counts, alpha, len(ds))
    highs = [d_high] if d_high is not None and len(ds) == 1 else None
    b = selection_bounds(ds, z, z_k, highs)
    lo, hi = float(b.low[0]), float(b.high[0])
    mean = min(float(x.mean()) for x in ds)
    return SequentialVerdict(size, mean, lo, hi, str(b.verdicts(margin)[0]), alpha, margin)


def stopping_times(d: np.ndarray, rounds: int | list[int], alpha: float = 0.05, margin: float = 0.02
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Run the rule on many sequences at once: for each row of `d` (runs, T), the number of problems evaluated when
    it stopped and its verdict ("undecided" where it never decided within T). `d` of shape (runs, k, T): the
    differences to each of k candidates for the job's best, decided as decide does (`selection_bounds`).
    `rounds`: a round size (a look after every `rounds` problems and at T) or the explicit list of looks."""
    d = np.asarray(d, dtype=np.float64)
    if d.ndim < 3:
        d = np.atleast_2d(d)[:, None, :]
    runs, k, horizon = d.shape
    times = (sorted(set(range(rounds, horizon + 1, rounds)) | {horizon}) if isinstance(rounds, int)
             else sorted(rounds))
    z, z_k = boundaries(times, alpha, k)
    stop = np.full(runs, horizon)
    verdict = np.full(runs, "undecided", dtype=object)
    open_ = np.ones(runs, dtype=bool)
    for t in times:
        if not open_.any():
            break
        rows = np.flatnonzero(open_)
        decided = selection_bounds([d[rows, j, :t] for j in range(k)], z, z_k).verdicts(margin)
        now = decided != "undecided"
        stop[rows[now]] = t
        verdict[rows[now]] = decided[now]
        open_[rows[now]] = False
    return stop, verdict


__all__ = ["SelectionBounds", "SequentialVerdict", "boundaries", "look_interval", "look_quantile", "look_spread",
           "pocock_boundary", "rare_interval", "selection_bounds", "sequential_verdict", "stopping_times"]

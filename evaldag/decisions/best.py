"""A training job's best and previous checkpoint, defined once (for the MLflow tags and verdicts, decide's incumbent,
`evaldag compare` and its forecasts), and a paired verdict against the best that keeps its error rate although the
best was picked on the very problems it is compared on.

Which evaluations. A job's evaluations at earlier steps with the same comparison key (evaldag.decisions.series: a
slice or other sampling is another series, never a point of this one), one per step: a full evaluation wins over one
that stopped early at its step (evaldag.decisions.decide), else the latest. The previous is the one of the highest
earlier step. The candidates for the best are the full evaluations only: one stopped early measured a prefix of the
problems, whose accuracy is too noisy to rank against full evaluations (the largest of noisy figures is biased up).
The best is the candidate with the highest accuracy; a tie goes to the earlier step, the first to reach it.

The verdict against the best (docs/statistics.md, "Against the job's best"). With delta_j = mu_new - mu_j for each of
the k candidates, the difference to the truly best earlier checkpoint is delta* = min_j delta_j. From each
candidate's paired t interval on the common problems (evaldag.decisions.paired):
- the lower bound is L = min_j lo_j, each at level alpha: for the truly best j*, lo_j* <= delta_j* = delta* with
  probability 1 - alpha/2 whichever checkpoint j* is, and L <= lo_j*. No correction: "better than the best" is
  "better than every earlier checkpoint", an intersection-union test, valid with each test at level alpha;
- the upper bound is U = min_j hi_j, each at level alpha/k (Bonferroni): U < delta* needs some hi_j < delta* <= delta_j,
  probability at most k x alpha/(2k). "Worse than the best" is "worse than some earlier checkpoint", a union of k
  claims, which needs the correction.
So [L, U] covers delta* with probability at least 1 - alpha for any k and any skills, and the usual rule read on it
(`verdict_from_interval`) keeps the rates of a false `better` and a false `worse` at most alpha/2 each. The sign-flip
p-value backs each side the same way: `better` needs every candidate's p below alpha (the intersection-union p-value,
max_j p_j), `worse` needs k x p of the candidate that sets U below alpha. With one candidate it is `paired_test`.
Testing against the selected best as if it were fixed instead gave 18 % false `worse` with 20 earlier checkpoints
(bench/bench_verdict_best.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

from evaldag.decisions.paired import (PairedVerdict, paired_differences, rare_within_margin, sign_flip_p_value,
                                      verdict_from_interval)


def candidates(earlier: Sequence[Mapping]) -> list[Mapping]:
    """The evaluations among `earlier` (one per step) that may be the job's best: those that ran in full."""
    return [e for e in earlier if not e.get("stopped")]


def references(earlier: Sequence[Mapping]) -> dict[str, Mapping]:
    """{"previous": the evaluation of the highest step, "best": the candidate of highest accuracy (a tie goes to the
    earlier step)} among `earlier`: a job's evaluations before the one at hand, one per step, oldest step first,
    each a mapping with step, accuracy and stopped (an evaluation stopped early). Empty when `earlier` is; no
    "best" when nothing earlier ran in full."""
    if not earlier:
        return {}
    out = {"previous": earlier[-1]}
    full = candidates(earlier)
    if full:
        out["best"] = max(full, key=lambda e: (e["accuracy"], -e["step"]))
    return out


def _interval(d: np.ndarray, alpha_low: float, alpha_high: float) -> tuple[float, float, float, float]:
    """(mean, se, lower bound at two-sided level alpha_low, upper bound at two-sided level alpha_high) of Student's t
    on the paired differences `d` (at least two)."""
    from scipy.stats import t as student_t

    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
    return (mean, se, mean - float(student_t.ppf(1 - alpha_low / 2, d.size - 1)) * se,
            mean + float(student_t.ppf(1 - alpha_high / 2, d.size - 1)) * se)


def best_verdict(differences: Sequence[np.ndarray], margin: float = 0.02, alpha: float = 0.05,
                 grids: Sequence[int | None] | None = None, min_problems: int = 10,
                 p_value: bool = True) -> PairedVerdict:
    """The verdict of a new evaluation against the best of k earlier ones (module docstring). `differences[j]`: per
    problem, the new evaluation's score minus candidate j's, on their common problems; `grids[j]`: the d_i of j are
    multiples of 1/grid (for the exact p-value). Reported: diff = min_j mean_j (against the candidate that looks
    best on these problems) with its se, [L, U], the p-value of the side the point estimate is on, n_problems = the
    fewest common problems of a candidate. `p_value=False` computes a p-value only where the interval alone would
    decide better or worse (it is NaN otherwise; simulations need no more)."""
    if not differences:
        raise ValueError("no earlier evaluation to compare with: a verdict against the best needs one or more")
    if not 0 < alpha < 1 or margin < 0:
        raise ValueError(f"alpha must be in (0, 1) and margin >= 0, got {alpha} and {margin}")
    ds = [np.asarray(d, dtype=np.float64) for d in differences]
    grids = list(grids) if grids is not None else [None] * len(ds)
    k, m = len(ds), min(d.size for d in ds)
    if m < 2:
        nan = float("nan")
        return PairedVerdict(m, nan, nan, nan, nan, 1.0, "exact", "undecided", margin, alpha)
    stats = [_interval(d, alpha, alpha / k) for d in ds]
    low = min(s[2] for s in stats)
    at_high = min(range(k), key=lambda j: stats[j][3])
    high = stats[at_high][3]
    at_diff = min(range(k), key=lambda j: stats[j][0])
    p, methods = float("nan"), set()
    if p_value or verdict_from_interval(low, high, margin) in ("better", "worse"):
        tested = range(k) if low > 0 else [at_high]
        found = [sign_flip_p_value(ds[j], grids[j]) for j in tested]
        methods = {method for _, method in found}
        p = max(q for q, _ in found) if low > 0 else min(1.0, k * found[0][0])
    verdict = verdict_from_interval(low, high, margin, p, alpha) if m >= min_problems else "undecided"
    if verdict == "equivalent" and not rare_within_margin(ds, margin, alpha):
        verdict = verdict_from_interval(low, high, 0.0, p, alpha)
    method = "monte-carlo" if "monte-carlo" in methods else "exact"
    return PairedVerdict(m, stats[at_diff][0], stats[at_diff][1], low, high, p, method, verdict, margin, alpha)


def compare_with_best(mine: pl.DataFrame, earlier: Sequence[pl.DataFrame], margin: float = 0.02,
                      alpha: float = 0.05, min_problems: int = 10) -> PairedVerdict:
    """`best_verdict` of per-problem score tables (evaldag.decisions.paired.per_problem_scores): this evaluation's
    against each candidate for the best (`candidates`), each pair on its common problem ids."""
    ds, grids = [], []
    for other in earlier:
        pairs = paired_differences(mine, other)
        ns = set(pairs["n_a"].unique().to_list()) | set(pairs["n_b"].unique().to_list())
        ds.append(pairs["d"].to_numpy())
        grids.append(math.lcm(*ns) if ns else None)
    return best_verdict(ds, margin, alpha, grids, min_problems)


__all__ = ["best_verdict", "candidates", "compare_with_best", "references"]

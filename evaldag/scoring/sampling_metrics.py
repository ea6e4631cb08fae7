"""Metrics of n samples per problem: avg@n, pass@k, maj@k, their confidence intervals, and answer grouping.

Every reduction is polars over the graded per-sample table (`evaldag.storage.schema.GRADED_SCHEMA`); numpy only does the
arithmetic that needs no table (the pass@k factor table, the bootstrap over a per-problem vector).

- pass@k is the unbiased estimator of Chen et al. 2021, 1 - C(n-c, k) / C(n, k), in its product form
  1 - prod_{i=n-c+1..n} (1 - k/i): no binomial coefficient is ever formed, so n = 2000 neither overflows nor loses
  precision. With the same n for every problem, its value depends only on c, so the n + 1 possible values are
  computed once per k and joined onto the per-problem counts: no Python loop per problem.
- maj@k votes over answer groups (`answer_group`, see `assign_answer_groups`), never over the pred strings:
  "0.5" and "\\frac{1}{2}" are one answer. Samples without a group (unparseable, timeout, truncated) do not vote.
- Confidence intervals resample problems, not samples: the samples of one problem share its difficulty, so
  treating them as independent would give intervals that are far too narrow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from statistics import NormalDist
from typing import Any

import numpy as np
import polars as pl

from evaldag.scoring.metrics import _slug

# Statuses whose pred is a real, complete answer; every other status (unparseable, timeout, truncated) has no vote.
_VOTING_STATUSES = ("correct", "wrong")

# The bootstrap draws index matrices of n_boot x n_problems; above this many cells it works in chunks of rows.
_BOOT_CHUNK_CELLS = 4_000_000


# --------------------------------------------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------------------------------------------

def _check_k(n: int, k: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k={k} is outside 1..n with n={n} samples per problem; pass@k and maj@k need 1 <= k <= n")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct out of `n` samples: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i) (Chen et al. 2021), stable for large n.
    Raises ValueError unless 1 <= k <= n and 0 <= c <= n.
    """
    _check_k(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct samples is outside 0..n with n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _pass_at_k_by_c(n: int, k: int) -> np.ndarray:
    """pass@k for every c in 0..n at once: element c is 1 - prod_{j<c} (1 - k/(n-j)).

    The running product reaches exactly 0 at the factor n - j = k (from then on every k-subset holds a correct
    sample) and stays 0, so c > n - k gives exactly 1.0 with no special case.
    """
    factors = 1.0 - k / np.arange(n, 0, -1, dtype=np.float64)          # j = 0..n-1: 1 - k/(n-j)
    prod = np.concatenate(([1.0], np.cumprod(factors)))
    return np.clip(1.0 - prod, 0.0, 1.0)                                 # clip: the -0.0 / negative tail after the 0


def _problem_counts(graded: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """One row per problem (sorted by sample_id): n, c, and subject/level when present; plus the common n.

    Sorted so that per-problem vectors, and hence bootstrap intervals, do not depend on polars' group order.
    Raises ValueError on an empty table, a null `correct`, or problems with different sample counts.
    """
    if graded.height == 0:
        raise ValueError("no graded samples to reduce")
    nulls = graded["correct"].null_count()
    if nulls:
        raise ValueError(f"{nulls} graded rows have a null `correct`; every sample must be graded before reduce")
    extra = [pl.col(c).first() for c in ("subject", "level") if c in graded.columns]
    counts = (graded.group_by("sample_id")
              .agg(n=pl.len(), c=pl.col("correct").sum(), *extra)
              .sort("sample_id"))
    n_values = counts["n"].unique().sort()
    if n_values.len() != 1:
        odd = counts.filter(pl.col("n") != counts["n"].mode().min()).head(3).select("sample_id", "n").rows()
        raise ValueError(f"problems have different sample counts {n_values.to_list()} (e.g. {odd}); "
                         "pass@k assumes the same n for every problem: a shard is missing or duplicated")
    return counts, int(n_values[0])


def _with_pass(counts: pl.DataFrame, n: int, k: int, name: str = "pass_at_k") -> pl.DataFrame:
    _check_k(n, k)
    lookup = pl.DataFrame({"c": np.arange(n + 1), name: _pass_at_k_by_c(n, k)},
                          schema={"c": counts.schema["c"], name: pl.Float64})
    return counts.join(lookup, on="c", how="left", maintain_order="left")


def per_problem_pass_at_k(graded: pl.DataFrame, k: int) -> pl.DataFrame:
    """One row per problem, sorted by sample_id: sample_id, n, c, [subject, level,] pass_at_k."""
    counts, n = _problem_counts(graded)
    return _with_pass(counts, n, k)


# --------------------------------------------------------------------------------------------------------------
# maj@k
# --------------------------------------------------------------------------------------------------------------

def _with_order(graded: pl.DataFrame) -> pl.DataFrame:
    """Add `_order`: 0-based rank of each sample within its problem by sample_index (the order they were drawn)."""
    return graded.with_columns(
        _order=(pl.col("sample_index").rank("ordinal").over("sample_id") - 1).cast(pl.Int64))


def _maj_from_ordered(ordered: pl.DataFrame, problems: pl.DataFrame, k: int, key: str) -> pl.DataFrame:
    votes = (ordered.filter((pl.col("_order") < k) & pl.col(key).is_not_null())
             .group_by("sample_id", key)
             .agg(votes=pl.len(), first=pl.col("_order").min(), correct=pl.col("correct").all()))
    # Tie rule: most votes, then the group voted for earliest (smallest sample_index) wins; the group keys are
    # unique within a problem, so the winner is always unique and does not depend on polars' group order.
    winners = (votes.group_by("sample_id")
               .agg(maj_at_k=pl.col("correct").sort_by(["votes", "first"], descending=[True, False]).first(),
                    winner=pl.col(key).sort_by(["votes", "first"], descending=[True, False]).first()))
    # A problem where nobody voted (all unparseable, say) is a miss, not a hole in the average.
    return (problems.join(winners, on="sample_id", how="left", maintain_order="left")
            .with_columns(pl.col("maj_at_k").fill_null(False).cast(pl.Float64)))


def _check_key(graded: pl.DataFrame, key: str) -> None:
    if key not in graded.columns:
        raise ValueError(f"maj@k needs the answer-group column {key!r}; add it with assign_answer_groups(graded)")


def per_problem_maj_at_k(graded: pl.DataFrame, k: int, answer_key_col: str = "answer_group") -> pl.DataFrame:
    """One row per problem, sorted by sample_id: sample_id, maj_at_k (1.0 / 0.0), winner (the winning group id).

    The vote is over the first k samples by sample_index; only samples with a non-null group vote; the winner
    has the most votes, ties going to the group whose first vote has the smallest sample_index. The vote is
    correct iff the winning group's samples are all correct. No vote at all counts as incorrect.
    """
    _check_key(graded, answer_key_col)
    counts, n = _problem_counts(graded)
    _check_k(n, k)
    return _maj_from_ordered(_with_order(graded), counts.select("sample_id"), k, answer_key_col)


def maj_at_k(graded: pl.DataFrame, ks: list[int], answer_key_col: str = "answer_group") -> dict[str, float]:
    """Majority-vote accuracy over problems, for each k: {"maj@{k}": value}; see `per_problem_maj_at_k`."""
    _check_key(graded, answer_key_col)
    counts, n = _problem_counts(graded)
    for k in ks:
        _check_k(n, k)
    ordered = _with_order(graded)
    problems = counts.select("sample_id")
    return {f"maj@{k}": float(_maj_from_ordered(ordered, problems, k, answer_key_col)["maj_at_k"].mean())
            for k in dict.fromkeys(ks)}


# --------------------------------------------------------------------------------------------------------------
# Answer groups (grading-time work: math-verify per pair, so never part of the reduce)
# --------------------------------------------------------------------------------------------------------------

@lru_cache(maxsize=8192)
def _parse_latex(text: str) -> list:
    """Parse an extracted answer; cached because a problem's n preds repeat the same few answers."""
    from evaldag.scoring.grading import _math_verify

    parse, _ = _math_verify()
    # Preds are bare LaTeX ("\frac{1}{2}"), which math-verify only reads inside math delimiters; the bare string
    # is the fallback, as for golds in evaldag.scoring.grading._parse_gold.
    return parse("$" + text + "$", parsing_timeout=None) or parse(text, parsing_timeout=None)


def math_equivalent(a: str, b: str) -> bool:
    """Whether two extracted answers are mathematically equal according to math-verify (either direction).

    math-verify's own timeouts are off (they rely on signal.alarm, which fails outside the main thread), so a
    pathological pair is unbounded here; the grade stage runs it through evaldag.scoring.grading.BoundedCalls, under the
    grading timeout.
    verify(gold, pred) is not symmetric (the gold side decides e.g. set versus interval readings), so either
    direction counts.
    """
    if a == b:
        return True
    from evaldag.scoring.grading import _math_verify

    _, verify = _math_verify()
    pa, pb = _parse_latex(a), _parse_latex(b)
    if not pa or not pb:
        return False
    return bool(verify(pa, pb, timeout_seconds=None) or verify(pb, pa, timeout_seconds=None))


def assign_answer_groups(graded: pl.DataFrame,
                         equivalent: Callable[[str, str], bool] | None = None) -> pl.DataFrame:
    """Add `answer_group` (Int64): per problem, samples whose preds are equivalent share an id.

    - status correct: one group per problem, without any comparison (every correct pred equals the gold).
    - status wrong: compared with the representative (first pred) of each earlier wrong group of the same problem,
      in sample_index order; identical strings match without calling `equivalent`, and each pair is compared once.
      Wrong preds are never merged into the correct group, so a group is all correct or all wrong.
    - any other status, or a null pred: null (no vote in maj@k).
    Ids are 0, 1, ... in order of each group's first sample. `equivalent` defaults to `math_equivalent`.
    """
    equivalent = equivalent or math_equivalent
    cache: dict[tuple[str, str], bool] = {}

    def same(a: str, b: str) -> bool:
        if a == b:
            return True
        pair = (a, b) if a <= b else (b, a)  # either direction counts, so one cache entry per unordered pair
        if pair not in cache:
            cache[pair] = bool(equivalent(*pair))
        return cache[pair]

    rows = graded.with_row_index("_row").sort("sample_id", "sample_index")
    groups: list[int | None] = [None] * graded.height
    current, correct_id, reps = None, None, []           # reps: (pred, group id) of the wrong groups of a problem
    next_id = 0
    for row, sid, status, pred in rows.select("_row", "sample_id", "status", "pred").iter_rows():
        if sid != current:
            current, correct_id, reps, next_id = sid, None, [], 0
        if status not in _VOTING_STATUSES or pred is None:
            continue
        if status == "correct":
            if correct_id is None:
                correct_id, next_id = next_id, next_id + 1
            groups[row] = correct_id
            continue
        gid = next((g for rep, g in reps if same(pred, rep)), None)
        if gid is None:
            gid, next_id = next_id, next_id + 1
            reps.append((pred, gid))
        groups[row] = gid
    return graded.with_columns(pl.Series("answer_group", groups, dtype=pl.Int64))


# --------------------------------------------------------------------------------------------------------------
# Confidence intervals
# --------------------------------------------------------------------------------------------------------------

def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: float, total: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (good near 0 and 1, unlike the normal approximation).

    Only valid for independent trials: one sample per problem, or one value per problem (maj@k). `successes` may
    be fractional (a mean of per-problem fractions times the number of problems).
    """
    if total <= 0 or not 0 <= successes <= total:
        raise ValueError(f"need 0 <= successes <= total and total > 0, got successes={successes}, total={total}")
    z = _z(confidence)
    p = successes / total
    denom = 1 + z * z / total
    center = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    # At p = 0 (or 1) the bound is exactly 0 (or 1) in closed form; the subtraction would leave rounding noise.
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == total else min(1.0, center + half)
    return lo, hi


def bootstrap_mean_ci(values: np.ndarray | pl.Series, n_boot: int = 1000, seed: int = 0,
                      confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval for the mean of per-problem values (resampling problems with replacement)."""
    values = np.asarray(values, dtype=np.float64)
    m = values.size
    if m == 0:
        raise ValueError("no per-problem values to bootstrap")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    alpha = 1.0 - confidence
    _z(confidence)  # validates confidence
    rng = np.random.default_rng(seed)
    rows = max(1, _BOOT_CHUNK_CELLS // m)
    means = np.concatenate([values[rng.integers(0, m, size=(min(rows, n_boot - start), m))].mean(axis=1)
                            for start in range(0, n_boot, rows)])
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


# --------------------------------------------------------------------------------------------------------------
# The headline dict
# --------------------------------------------------------------------------------------------------------------

def sampling_metrics(graded: pl.DataFrame, ks: list[int], confidence: float = 0.95,
                     answer_key_col: str = "answer_group", n_boot: int = 1000, seed: int = 0) -> dict[str, float]:
    """avg@n, pass@k and maj@k (for each k in `ks` with k <= n) with `{name}_ci_low` / `{name}_ci_high`, and
    `pass@{k}/subject/<slug>`, `pass@{k}/level/<slug>` where the table has those columns non-null.

    maj@k appears only when the table has `answer_key_col`. Intervals are percentile bootstraps over problems
    (avg@n with one sample per problem uses the Wilson interval, its exact-coverage counterpart; so does any metric
    whose per-problem values are all equal, where the bootstrap would give a zero-width interval).
    Values of k above n are skipped, so one benchmark config can list ks for several n.
    """
    counts, n = _problem_counts(graded)
    ks = [k for k in dict.fromkeys(ks) if k <= n]
    for k in ks:
        _check_k(n, k)
    out: dict[str, float] = {}

    def put(name: str, per_problem: pl.Series) -> None:
        out[name] = mean = float(per_problem.mean())
        low, high = bootstrap_mean_ci(per_problem, n_boot, seed, confidence)
        if high <= low:
            # Every problem has the same value (e.g. all wrong): resampling problems cannot vary it, but m problems
            # only bound the mean as far as m trials do; 0/500 gives [0, 0.0076], not [0, 0].
            low, high = wilson_interval(mean * per_problem.len(), per_problem.len(), confidence)
        out[f"{name}_ci_low"], out[f"{name}_ci_high"] = low, high

    avg = f"avg@{n}"
    if n == 1:
        successes = int(counts["c"].sum())
        out[avg] = successes / counts.height
        out[f"{avg}_ci_low"], out[f"{avg}_ci_high"] = wilson_interval(successes, counts.height, confidence)
    else:
        put(avg, counts["c"] / n)

    breakdowns = [key for key in ("subject", "level")
                  if key in counts.columns and counts[key].null_count() < counts.height]
    for k in ks:
        per = _with_pass(counts, n, k)
        put(f"pass@{k}", per["pass_at_k"])
        for key in breakdowns:
            by = (per.filter(pl.col(key).is_not_null())
                  .group_by(key).agg(pl.col("pass_at_k").mean()).sort(key))
            for value, mean in by.iter_rows():
                out[f"pass@{k}/{key}/{_slug(value)}"] = float(mean)

    if answer_key_col in graded.columns:
        ordered = _with_order(graded)
        problems = counts.select("sample_id")
        for k in ks:
            put(f"maj@{k}", _maj_from_ordered(ordered, problems, k, answer_key_col)["maj_at_k"])
    return out

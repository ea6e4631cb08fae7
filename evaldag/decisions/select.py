"""Which checkpoint of a job is best: paired elimination over one shared problem order, with a guarantee.

Input: for each of k checkpoints, its per-problem scores in one shared random order of the benchmark's problems, as
far as generated (n = 1: 0/1 per problem; n > 1: the mean of its n samples, in [0, 1]). The planned looks are problem
counts (round ends, fixed before any result). At the look after t problems every surviving checkpoint must have at
least t rows (the caller generates what is missing: `Selection.need`); each survivor is then compared with every
other survivor on the first t problems, and a survivor shown worse than another is dropped. A row generated earlier
(by a full evaluation, a stopped one, or an earlier call) is never asked for again, and rows beyond the look are
read at the later looks: nothing generated is thrown away. It stops when one survives (`best`), when every survivor
is shown within `margin` of every other (`equivalent`), or at the last look (`undecided`: the set of those not shown
worse).

The guarantee. Let j* be the truly best checkpoint. With probability at least 1 - alpha, (a) j* is never dropped, so
it is in the returned set, and (b) when the status is `equivalent`, every member of the set is within `margin` of j*.
Both need only the 2 (k - 1) tests that involve j*: "j* is worse than i" (k - 1 of them, one per possible leader i;
the leader is picked from the data, so all k - 1 are counted) and "j is more than `margin` below j*" (k - 1). Each
is run at level alpha / (2 (k - 1)) (Bonferroni), so that a false one among them has probability at most alpha.
Drops and equivalence claims between checkpoints other than j* can be wrong without harming (a) or (b): they are
not part of the claim.

The tests, and why this bound. Each test is a betting e-process on the paired differences d_i = x_a(i) - x_b(i) in
[-1, 1] (Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 2024): to reject
"mean(d) >= c" the wealth is W_t = (1 / G) sum_g prod_{i <= t} (1 - lambda_g (d_i - c) / (1 + |c|)) over a fixed
grid of G bets lambda_g in (0, 1). Under the null each factor has expectation at most 1 and is positive (|d - c| <=
1 + |c|), so W is a nonnegative supermartingale and, by Ville's inequality, it ever reaches 1 / level with
probability at most level. This holds
- for any bounded data: no normal approximation, so it is exact in the sense that matters for a release decision,
  including rare one-sided differences (a checkpoint that breaks 2 % of problems and fixes none: with no differing
  problem among 150 the wealth for "within 0.02" grows to (1 + 0.99 x 0.02 / 1.02)^150 / G = 1.5, far from the 760
  it needs at k = 20, where a t interval's half-width there is 0.017, under the margin; issue 54);
- at every problem count, whatever the stopping rule: so the planned looks cost nothing (no Pocock or spending
  boundary is needed: reading at round ends only is more conservative than Ville allows), and the looks may be
  changed between selections without touching the guarantee.
The price against the t interval with Pocock's boundary (evaldag.decisions.sequential) is small at this k: the
threshold log(2 (k - 1) / alpha) = log(760) = 6.6 nats at k = 20 plus log(G) = 2.5 for the mixture, against
z^2 / 2 = 6.2 for Pocock's z = 3.51 at alpha / (k - 1) over decide's 10 looks; simulated (bench/bench_select.py), the
same elimination on decide's t intervals reads 0.03 fewer of the tokens, and it is not valid for rare one-sided
differences.
The fixed grid of bets (a mixture, not a learned bet) keeps every decision a function of the rows alone.

Every number in the result is re-derived from the rows by `select_step` (a pure function of them: at look t it reads
the first t rows of each survivor, so longer rows give the same result), and the intervals printed are the same
e-processes inverted (the set of c whose nulls are not rejected at the level).
Should be unified with evaldag.decisions.sequential's bounds for rare one-sided differences (sequential.rare_interval,
Chernoff-Hoeffding at a look's level) once both settle: both are valid for bounded data; this one also for any look.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

# the fixed bets of the mixture: geometric from small (a difference of a point or two with n = 1) to large (a
# difference of 20 points with n > 1), so that the best of them is within a factor 1.4 of the growth-optimal bet
LAMBDAS = np.geomspace(0.02, 0.99, 12)
STATUSES = ("best", "equivalent", "undecided", "pending")


def planned_looks(n_problems: int, rounds: int = 10) -> list[int]:
    """Problem counts at which survivors are compared: `rounds` near-equal steps of the problems, the last one all
    (decide's round ends, evaldag.decisions.decide.round_ends)."""
    rounds = max(1, min(rounds, n_problems))
    return sorted({math.ceil(n_problems * r / rounds) for r in range(1, rounds + 1)})


def log_threshold(k: int, alpha: float) -> float:
    """log of the wealth a test must reach: 1 / level with level alpha / (2 (k - 1)) (module docstring)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return math.log(2 * max(k - 1, 1) / alpha)


def log_wealth(d: np.ndarray, c: float, upper: bool) -> float:
    """log W of the bets against "mean(d) >= c" (upper=True: evidence that the mean is below c) or against
    "mean(d) <= c" (upper=False: evidence that it is above c), over all of `d` (values in [-1, 1])."""
    d = np.asarray(d, dtype=np.float64)
    if d.size == 0:
        return 0.0
    scale = 1.0 + abs(c)
    x = (c - d if upper else d - c) / scale                     # in [-1, 1]: the bet wins when x > 0
    logs = np.log1p(LAMBDAS[:, None] * x[None, :]).sum(axis=1)
    top = logs.max()
    return float(top + math.log(np.exp(logs - top).mean()))


def confidence_bounds(d: np.ndarray, log_thr: float) -> tuple[float, float]:
    """The interval of means c not rejected by either test at wealth exp(log_thr): each end errs with probability at
    most exp(-log_thr) at any look (the inversion of `log_wealth`, monotone in c: bisection)."""
    d = np.asarray(d, dtype=np.float64)
    if d.size == 0:
        return -1.0, 1.0
    mean = float(d.mean())

    def solve(upper: bool) -> float:
        inside, outside = mean, (1.0 if upper else -1.0)      # not rejected at the mean; the far end of the range
        if log_wealth(d, outside, upper) < log_thr:
            return outside
        for _ in range(40):
            mid = (inside + outside) / 2
            if log_wealth(d, mid, upper) >= log_thr:
                outside = mid
            else:
                inside = mid
        return outside

    return solve(upper=False), solve(upper=True)


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint's part of a selection: what it read and, if it was dropped, when and against whom."""

    checkpoint: str
    problems: int                 # rows of it the selection read: the look it was dropped at, or the last look done
    mean: float                   # its mean score over those rows
    dropped_at: int | None        # the look (problem count) at which it was shown worse; None: in the set
    dropped_round: int | None     # that look's number, 1-based
    vs: str | None                # who dropped it, or the leader (None: it is the leader, and diff/ci are nan)
    diff: float                   # mean(x_this - x_vs) on their common prefix
    ci_low: float                 # interval of mu_this - mu_vs at level alpha / (2 (k - 1)) per end (any look)
    ci_high: float
    common: int                   # the rows those three were read on (the same prefix of both)


@dataclass(frozen=True)
class Selection:
    """The state of a selection after reading the rows it was given. `status`: `best` (one survives), `equivalent`
    (all survivors shown within margin of each other), `undecided` (the last look reached: the set is those not shown
    worse), `pending` (more rows needed: `need` says how many per checkpoint)."""

    status: str
    best: str                     # the leader: the survivor of highest mean on the survivors' common prefix
    chosen: tuple[str, ...]       # the set: with probability >= 1 - alpha it holds the truly best checkpoint
    alpha: float
    margin: float
    looks: tuple[int, ...]
    look: int                     # the last look completed (0: none)
    records: tuple[CheckpointRecord, ...]
    need: dict[str, int] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status != "pending"


def _validate(rows: Mapping[str, Sequence[float]], looks: Sequence[int], alpha: float, margin: float
              ) -> tuple[dict[str, np.ndarray], tuple[int, ...]]:
    if len(rows) < 2:
        raise ValueError(f"select needs two or more checkpoints, got {len(rows)}: with one there is nothing to choose")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    log_threshold(len(rows), alpha)
    counts = tuple(int(t) for t in looks)
    if not counts or counts[0] < 1 or any(b <= a for a, b in zip(counts, counts[1:])):
        raise ValueError(f"looks must be increasing positive problem counts, got {list(looks)}")
    out = {}
    for name, x in rows.items():
        arr = np.asarray(x, dtype=np.float64).ravel()
        if arr.size and (np.isnan(arr).any() or arr.min() < 0 or arr.max() > 1):
            raise ValueError(f"checkpoint {name}: scores must be per-problem means in [0, 1] (n = 1: 0 or 1), "
                             "in the shared problem order")
        out[str(name)] = arr
    return out, counts


def _pair_counts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The differences d = x_j - x_i of every ordered pair over rows x (a, m), as (values (V,), counts (a, a, V)):
    per-problem scores are multiples of 1/n, so few distinct values carry all the wealth's terms."""
    a = x.shape[0]
    d = np.round(x[:, None, :] - x[None, :, :], 12)
    values, inverse = np.unique(d, return_inverse=True)
    pair = np.arange(a * a).reshape(a, a, 1)
    counts = np.bincount((pair * values.size + inverse.reshape(d.shape)).ravel(), minlength=a * a * values.size)
    return values, counts.reshape(a, a, values.size).astype(np.float64)


def _pair_logs(values: np.ndarray, counts: np.ndarray, c: float, upper: bool) -> np.ndarray:
    """(a, a, G) log wealth increments of every ordered pair (the bets of `log_wealth`) from `_pair_counts`."""
    z = (c - values if upper else values - c) / (1.0 + abs(c))
    return counts @ np.log1p(LAMBDAS[:, None] * z[None, :]).T


def _mixture(logs: np.ndarray) -> np.ndarray:
    """log of the mean over the bets (last axis) of exp(logs)."""
    top = logs.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(logs - top).mean(axis=-1, keepdims=True)))[..., 0]


def select_step(rows: Mapping[str, Sequence[float]], looks: Sequence[int], alpha: float = 0.05,
                margin: float = 0.02, intervals: bool = True) -> Selection:
    """Replay the elimination on the rows as they are and say where it stands: done (status, set, records) or
    `pending` with the rows each surviving checkpoint needs before the next look. At look t every comparison reads
    the first t rows of each survivor, so the result is a pure function of the rows: the same on the rows a live
    selection generated as on longer ones (a full evaluation's), and `rows[name][:problems]` re-derives it. No
    checkpoint is asked for rows it has; rows beyond a look are read at the later looks. `intervals=False` skips
    the records' intervals (nan), for simulations."""
    data, counts = _validate(rows, looks, alpha, margin)
    names = list(data)
    log_thr = log_threshold(len(names), alpha)
    alive = list(names)
    dropped: dict[str, tuple[int, int, str]] = {}           # name -> (look, round, by whom)
    status, look_done = "undecided", 0
    # running log wealth of every ordered pair (j, i): "j worse than i" and "j within margin of i", per bet
    k = len(names)
    worse = np.zeros((k, k, LAMBDAS.size))
    within = np.zeros((k, k, LAMBDAS.size))
    index = {j: n for n, j in enumerate(names)}
    for r, t in enumerate(counts, start=1):
        short = {j: t for j in alive if data[j].size < t}
        if short:
            return _result("pending", data, alive, dropped, alpha, margin, counts, look_done, log_thr, short,
                           intervals)
        ids = np.array([index[j] for j in alive])
        x = np.stack([data[j][look_done:t] for j in alive])
        sub = np.ix_(ids, ids)
        values, counts_ = _pair_counts(x)
        worse[sub] += _pair_logs(values, counts_, 0.0, upper=True)
        within[sub] += _pair_logs(values, counts_, -margin, upper=False)
        evidence = _mixture(worse[sub])
        np.fill_diagonal(evidence, -np.inf)
        for a, j in enumerate(alive):
            if evidence[a].max() >= log_thr:
                # dropped by the survivor it is most clearly worse than
                dropped[j] = (t, r, alive[int(np.argmax(evidence[a]))])
        keep = [a for a, j in enumerate(alive) if j not in dropped]
        alive = [alive[a] for a in keep]
        look_done = t
        if len(alive) == 1:
            status = "best"
            break
        shown_within = _mixture(within[sub])[np.ix_(keep, keep)] >= log_thr
        np.fill_diagonal(shown_within, True)
        if shown_within.all():
            status = "equivalent"
            break
    return _result(status, data, alive, dropped, alpha, margin, counts, look_done, log_thr, {}, intervals)


def _result(status: str, data: dict[str, np.ndarray], alive: list[str], dropped: dict[str, tuple[int, int, str]],
            alpha: float, margin: float, counts: tuple[int, ...], look_done: int, log_thr: float,
            need: dict[str, int], intervals: bool) -> Selection:
    """The Selection of a replay: each checkpoint's interval against who dropped it (on the rows of that look), or
    against the leader (on the rows of the last look done)."""
    leader = max(alive, key=lambda j: (float(data[j][:look_done].mean()) if look_done else 0.0, -alive.index(j)))
    records = []
    for j, x in data.items():
        t, r, vs = dropped.get(j, (None, None, leader if j != leader else None))
        read = min(x.size, t if t is not None else look_done)
        diff = lo = hi = float("nan")
        if vs is not None and read:
            d = x[:read] - data[vs][:read]
            diff = float(d.mean())
            if intervals:
                lo, hi = confidence_bounds(d, log_thr)
        records.append(CheckpointRecord(j, int(read), float(x[:read].mean()) if read else float("nan"), t, r, vs,
                                        diff, lo, hi, int(read)))
    return Selection(status, leader, tuple(alive), alpha, margin, counts, look_done, tuple(records), dict(need))


def run_selection(rows: Mapping[str, Sequence[float]], generate: Callable[[dict[str, int]], Mapping[str, Sequence[float]]],
                  looks: Sequence[int], alpha: float = 0.05, margin: float = 0.02) -> Selection:
    """Drive `select_step` to the end: `rows` names every checkpoint of the selection with the rows it already has
    (possibly none), which are never asked for again; `generate(need)` returns each named checkpoint's rows (all of
    them, in the shared order) once it has at least `need[name]`. The flow's loop, in memory."""
    current = {str(k): np.asarray(v, dtype=np.float64) for k, v in rows.items()}
    while True:
        sel = select_step(current, looks, alpha, margin)
        if sel.done:
            return sel
        for name, x in generate(dict(sel.need)).items():
            current[str(name)] = np.asarray(x, dtype=np.float64)


def smallest_margin(n_problems: int, k: int, alpha: float = 0.05) -> float:
    """The smallest margin an equivalence among `k` checkpoints can be shown at on `n_problems`, in the most
    favourable case: every problem scored the same by all of them (d = 0 throughout), read to the last problem (the
    bets are valid at any count, so the looks do not change it). 1.0 when no margin below 1 can be shown."""
    log_thr = log_threshold(k, alpha)
    zeros = np.zeros(n_problems)
    if log_wealth(zeros, -1.0 + 1e-9, upper=False) < log_thr:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if log_wealth(zeros, -mid, upper=False) >= log_thr:
            hi = mid
        else:
            lo = mid
    return hi


def too_small(n_problems: int, k: int, margin: float, alpha: float = 0.05, benchmark: str = "the benchmark"
              ) -> str | None:
    """Before anything is generated: None when `n_problems` can show `k` checkpoints within `margin` of each other
    (in the most favourable case, `smallest_margin`), else the message to print. It names the benchmark's size, the
    margin asked and the smallest one it could show, the smallest difference at which a checkpoint can be dropped
    at all (another one better on that many problems and worse on none: the most favourable data for a drop), what
    the selection returns instead (`undecided`: every checkpoint not dropped, still holding the best with
    probability 1 - alpha) and the fixes. Pure and quick (milliseconds): call it before spending, then refuse or go
    on as the caller decides."""
    need = smallest_margin(n_problems, k, alpha)
    if need <= margin:
        return None
    log_thr = log_threshold(k, alpha)
    # the wealth of "worse" grows only on the problems that differ: p problems at d = -1, the rest agreeing
    drop = next((p for p in range(1, n_problems + 1) if log_wealth(-np.ones(p), 0.0, upper=True) >= log_thr), None)
    text = (f"{benchmark} has {n_problems} problems: too few to show {k} checkpoints within margin {margin:g} of "
            f"each other (alpha {alpha:g}). Even if two checkpoints agreed on every problem, select could show "
            + ("them no closer than 1." if need >= 1.0 else f"them no closer than {need:.3f}."))
    text += (f" It drops a checkpoint only when another one beats it on at least {drop} of the {n_problems} problems "
             f"(at best: losing none), a difference of {drop / n_problems * 100:.0f} points or more"
             if drop is not None else " It cannot drop any checkpoint either, whatever the answers")
    text += ("; checkpoints closer than that are returned together as `undecided` (the set still holds the best "
             f"with probability {1 - alpha:g}).")
    fix = (f"Use --margin {math.ceil(need * 100) / 100:g} or more, or a larger benchmark" if need < 0.99
           else "Use a larger benchmark")
    return f"{text} {fix}, or fewer checkpoints (fewer comparisons need less evidence each)."


__all__ = ["CheckpointRecord", "LAMBDAS", "STATUSES", "Selection", "confidence_bounds", "log_threshold",
           "log_wealth", "planned_looks", "run_selection", "select_step", "smallest_margin", "too_small"]

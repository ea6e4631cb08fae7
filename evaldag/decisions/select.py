"""Which checkpoint of a job is best: paired elimination over one shared problem order, with a guarantee.

Input: for each of k checkpoints, its per-problem scores in one shared random order of the benchmark's problems, as
far as generated (n = 1: 0/1 per problem; n > 1: the mean of its n samples, in [0, 1]). The looks are problem
counts fixed before any result (`planned_looks`: dense early, where clearly worse checkpoints drop). At the look
after t problems every survivor still asked for rows must have t of them (the caller generates what is missing:
`Selection.need`); each survivor is compared with every other on the rows both have up to t, and one shown worse
than another is dropped. A row generated earlier (a full evaluation, a stopped one, an earlier call) is never asked
for again and is read: nothing generated is thrown away. It stops when one survives (`best`), when every survivor
is shown within `margin` of every other (`equivalent`), or `undecided` (the set of those not shown worse, with
`Selection.reason`) at the last look or when every survivor has settled.

Settling (the futility rule). With n = 1 on 500 problems, checkpoints within about 8 points of each other cannot be
separated at k = 20 (bench/bench_select.py), and reading them to the end buys nothing. After each look a survivor
settles, and is asked for no more rows, when no pair it belongs to could plausibly reach its threshold by the last
look (neither dropped nor dropping, and the set cannot all be shown equivalent): each bet's wealth projected over
the remaining problems at the pair's observed mean moved FUTILITY_Z standard errors to the favourable side
(`_Pairs.reachable`). The rule only chooses what is read; verdicts are the e-processes' alone, so the guarantee
holds whatever it decides. What it can cost is a larger set; the bench prints the set read to the end beside it.

The guarantee. Let j* be the truly best checkpoint. With probability at least 1 - alpha, (a) j* is never dropped, so
it is in the returned set, and (b) when the status is `equivalent`, every member of the set is within `margin` of j*.
Both need only the 2 (k - 1) tests that involve j*: "j* is worse than i" (k - 1, one per possible leader i, as the
leader is picked from the data) and "j is more than `margin` below j*" (k - 1), each at level alpha / (2 (k - 1))
(Bonferroni). Drops and equivalence claims between checkpoints other than j* are not part of the claim.

The tests. Each is a betting e-process on the paired differences d_i = x_a(i) - x_b(i) in [-1, 1] (Waudby-Smith &
Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 2024): to reject "mean(d) >= c" the
wealth is W_t = (1 / G) sum_g prod_{i <= t} (1 - lambda_g (d_i - c) / (1 + |c|)) over a fixed grid of G bets
lambda_g in (0, 1). Under the null each factor is positive with expectation at most 1, so W is a nonnegative
supermartingale and by Ville's inequality it ever reaches 1 / level with probability at most level. This holds
- for any bounded data, with no normal approximation, rare one-sided differences included (a checkpoint that
  breaks 2 % of problems and fixes none: with no differing problem among 150 the wealth for "within 0.02" is
  (1 + 0.99 x 0.02 / 1.02)^150 / G = 1.5, far from the 760 it needs at k = 20; a t interval's half-width there is
  0.017, under the margin; issue 54);
- at every problem count and under any stopping rule: so looks cost no error (only rounds of generation), and each
  pair's test may stop at a different, data-dependent count (settling) without touching the guarantee.
The fixed grid of bets (a mixture, not a learned bet) keeps every decision a function of the rows alone.

Why not sequential.rare_interval (decide's bound for rare one-sided differences). It guards a t interval: the
spread taken at a Chernoff-Hoeffding upper bound of E[d^2] at one look's level, with Pocock's boundary for decide's
fixed looks. Its coverage still rests on the normal approximation, poor at the 10-20 problems where select drops
clearly worse checkpoints, and its boundary must be recomputed, wider, for each schedule of looks; the e-process
needs neither. Conversely the e-process would cost decide tokens on its one comparison (sequential's docstring:
"why not an anytime-valid confidence sequence"). One bound for both would weaken one of them, so both stay; both
are checked on the same rare one-sided regression (bench_decide line (e), tests/test_select.py).

Every number in the result is re-derived from the rows by `select_step` (a pure function of them: the rows in the
store, or each record's `rows[name][:problems]`, give the same result), and the intervals printed are the same
e-processes inverted (the set of c whose nulls are not rejected at the level).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

# the fixed bets of the mixture: geometric from small (a difference of a point or two with n = 1) to large (a
# difference of 20 points with n > 1), so that the best of them is within a factor 1.4 of the growth-optimal bet
LAMBDAS = np.geomspace(0.02, 0.99, 12)
# how optimistic the settling projection is: the pair's mean is taken this many standard errors to the favourable
# side (`_Pairs.reachable`); larger reads more for a smaller set (bench/bench_select.py)
FUTILITY_Z = 1.0
MIN_ROUND = 5
STATUSES = ("best", "equivalent", "undecided", "pending")


def planned_looks(n_problems: int, rounds: int | None = None) -> list[int]:
    """Problem counts at which survivors are compared. Default: every fiftieth of the problems up to a fifth of them,
    where the clearly worse checkpoints drop, then every twentieth, and at least MIN_ROUND problems apart (500
    problems: 10, 20, ..., 100, then 125, 150, ..., 500; 30 problems: 5, 10, ..., 30). The bets are valid at every
    count, so looks cost no error, only rounds of generation. `rounds`: that many near-equal steps instead (decide's
    round ends, evaldag.decisions.decide.round_ends)."""
    if rounds is not None:
        rounds = max(1, min(rounds, n_problems))
        return sorted({math.ceil(n_problems * r / rounds) for r in range(1, rounds + 1)})
    if n_problems < 1:
        raise ValueError(f"a selection needs one or more problems, got {n_problems}")
    # a round of fewer than MIN_ROUND problems costs a round trip per survivor for little evidence
    early, late = max(MIN_ROUND, math.ceil(n_problems / 50)), max(MIN_ROUND, math.ceil(n_problems / 20))
    looks = set(range(early, n_problems // 5 + 1, early)) | set(range(late, n_problems, late)) | {n_problems}
    return sorted(looks)


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
    settled_at: int | None = None  # the look after which it was read no further: no plausible outcome of the rest
    #                                would have separated it from another survivor (None: read to the end or dropped)


@dataclass(frozen=True)
class Selection:
    """The state of a selection after reading the rows it was given. `status`: `best` (one survives), `equivalent`
    (all survivors shown within margin of each other), `undecided` (the last look reached or every survivor settled:
    the set is those not shown worse, `reason` says why), `pending` (more rows needed: `need` says how many)."""

    status: str
    best: str                     # the leader: highest mean paired difference to the other survivors (`_leader`)
    chosen: tuple[str, ...]       # the set: with probability >= 1 - alpha it holds the truly best checkpoint
    alpha: float
    margin: float
    looks: tuple[int, ...]
    look: int                     # the last look completed (0: none)
    records: tuple[CheckpointRecord, ...]
    need: dict[str, int] = field(default_factory=dict)
    settled: tuple[str, ...] = ()  # members of the set that stopped reading early (`CheckpointRecord.settled_at`)
    reason: str = ""               # for `undecided`: why, in a sentence to print beside the set

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
    per-problem scores are multiples of 1/n, so few distinct values carry all the wealth's terms (a value may
    appear twice in `values`, from two pairs of scores; its counts are then split)."""
    a = x.shape[0]
    scores, code = np.unique(x, return_inverse=True)
    code = code.reshape(x.shape)
    u = scores.size
    combo = code[:, None, :] * u + code[None, :, :]                 # (a, a, m): which pair of scores
    pair = np.arange(a * a).reshape(a, a, 1)
    counts = np.bincount((pair * u * u + combo).ravel(), minlength=a * a * u * u)
    values = (scores[:, None] - scores[None, :]).ravel()
    return values, counts.reshape(a, a, u * u).astype(np.float64)


def _pair_logs(values: np.ndarray, counts: np.ndarray, c: float, upper: bool) -> np.ndarray:
    """(a, a, G) log wealth increments of every ordered pair (the bets of `log_wealth`) from `_pair_counts`."""
    z = (c - values if upper else values - c) / (1.0 + abs(c))
    return counts @ np.log1p(LAMBDAS[:, None] * z[None, :]).T


def _mixture(logs: np.ndarray) -> np.ndarray:
    """log of the mean over the bets (last axis) of exp(logs)."""
    top = logs.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(logs - top).mean(axis=-1, keepdims=True)))[..., 0]


class _Pairs:
    """Running evidence of every ordered pair (a, b) of checkpoints, d = x_a - x_b on their common rows: the log
    wealth per bet of "a worse than b" and of "a within margin of b", and the sums of d and d^2 (for `reachable`)."""

    def __init__(self, k: int, margin: float) -> None:
        self.margin = margin
        self.worse = np.zeros((k, k, LAMBDAS.size))
        self.within = np.zeros((k, k, LAMBDAS.size))
        self.sums = np.zeros((3, k, k))                     # count, sum d, sum d^2

    def add(self, ids: np.ndarray, x: np.ndarray) -> None:
        """Read rows x (len(ids), m): the next m rows of the checkpoints `ids`, all at the same count."""
        sub = np.ix_(ids, ids)
        values, counts = _pair_counts(x)
        self.worse[sub] += _pair_logs(values, counts, 0.0, upper=True)
        self.within[sub] += _pair_logs(values, counts, -self.margin, upper=False)
        for power in range(3):
            self.sums[(power, *sub)] += counts @ values ** power

    def reachable(self, ids: np.ndarray, remaining: np.ndarray, log_thr: float, z: float
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(worse, within) (a, a) booleans over `ids`: could the pair's test plausibly reach the threshold if it read
        `remaining[a, b]` more problems? Each bet's log wealth is grown at the favourable end of the pair's plausible
        mean (the observed mean plus z standard errors, one pseudo-observation of spread 1 so that agreement so far
        is not taken for certainty) by the quadratic approximation of log(1 + lambda x), which overstates a bet's
        growth where x < 0: the projection leans towards reading on. It decides only what is read, never a verdict,
        so it cannot touch the guarantee (module docstring)."""
        sub = np.ix_(ids, ids)
        count, total, square = (self.sums[(p, *sub)] for p in range(3))
        mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
        var = np.divide(np.maximum(square - count * mean ** 2, 0.0) + 1.0, count + 1.0)
        step = z * np.sqrt(var / np.maximum(count, 1.0))
        m = self.margin
        worse = self._grows(self.worse[sub], -mean + step, var, remaining) >= log_thr
        within = self._grows(self.within[sub], (mean + m) / (1 + m) + step / (1 + m), var / (1 + m) ** 2,
                             remaining) >= log_thr
        return worse, within

    @staticmethod
    def _grows(logs: np.ndarray, mean: np.ndarray, var: np.ndarray, remaining: np.ndarray) -> np.ndarray:
        """log wealth of the mixture after `remaining` more problems whose x has this mean and variance."""
        rate = LAMBDAS * mean[..., None] - LAMBDAS ** 2 * (var + mean ** 2)[..., None] / 2
        return _mixture(logs + remaining[..., None] * np.maximum(rate, 0.0))


def _settled(pairs: _Pairs, index: dict[str, int], alive: list[str], active: list[str], remaining: int,
             log_thr: float, z: float) -> set[str]:
    """The survivors no plausible outcome of the remaining problems would still separate: each can neither be
    dropped by nor drop another survivor by the last look, and the survivors cannot all be shown equivalent.
    A pair with a settled member reads nothing more (remaining 0)."""
    ids = np.array([index[j] for j in alive])
    reading = np.array([j in active for j in alive])
    left = np.where(reading[:, None] & reading[None, :], float(remaining), 0.0)
    worse, within = pairs.reachable(ids, left, log_thr, z)
    np.fill_diagonal(worse, False)
    np.fill_diagonal(within, True)
    if within.all():
        return set()
    separable = worse | worse.T
    return {j for a, j in enumerate(alive) if not separable[a].any()}


def select_step(rows: Mapping[str, Sequence[float]], looks: Sequence[int], alpha: float = 0.05,
                margin: float = 0.02, intervals: bool = True, futility: float | None = FUTILITY_Z) -> Selection:
    """Replay the elimination on the rows as they are and say where it stands: done (status, set, records) or
    `pending` with the rows each unsettled survivor needs before the next look. At look t every comparison reads the
    first t rows of each survivor that has them: a settled one (`Selection.settled`) is asked for no more, but reads
    what it has (a full evaluation's rows are never thrown away). The result is a pure function of the rows, so
    the rows in the store re-derive it, and so do `rows[name][:problems]` of its records. `futility`: the z of the
    settling projection (`_Pairs.reachable`; None: every survivor is read to the last look). `intervals=False`
    skips the records' intervals (nan), for simulations."""
    data, counts = _validate(rows, looks, alpha, margin)
    names = list(data)
    log_thr = log_threshold(len(names), alpha)
    index = {j: n for n, j in enumerate(names)}
    pairs = _Pairs(len(names), margin)
    alive = list(names)
    read = dict.fromkeys(names, 0)                          # rows of each checkpoint read so far
    dropped: dict[str, tuple[int, int, str]] = {}           # name -> (look, round, by whom)
    settled: dict[str, int] = {}                            # name -> the look after which it was asked no more
    status, look_done = "undecided", 0
    for r, t in enumerate(counts, start=1):
        short = {j: t for j in alive if j not in settled and data[j].size < t}
        if short:
            return _result("pending", data, pairs, alive, dropped, settled, read, alpha, margin, counts, look_done,
                           log_thr, short, intervals, futility)
        reading = [j for j in alive if data[j].size >= t]
        if len(reading) < 2:
            break                    # all settled, and at most one has rows left: no comparison can change
        pairs.add(np.array([index[j] for j in reading]), np.stack([data[j][look_done:t] for j in reading]))
        read.update(dict.fromkeys(reading, t))
        look_done = t
        sub = np.ix_(*(2 * [np.array([index[j] for j in alive])]))
        evidence = _mixture(pairs.worse[sub])
        np.fill_diagonal(evidence, -np.inf)
        for a, j in enumerate(alive):
            if evidence[a].max() >= log_thr:
                dropped[j] = (t, r, alive[int(np.argmax(evidence[a]))])    # by whom it is most clearly worse than
        keep = [a for a, j in enumerate(alive) if j not in dropped]
        alive = [alive[a] for a in keep]
        if len(alive) == 1:
            status = "best"
            break
        shown_within = _mixture(pairs.within[sub])[np.ix_(keep, keep)] >= log_thr
        np.fill_diagonal(shown_within, True)
        if shown_within.all():
            status = "equivalent"
            break
        if futility is not None and t < counts[-1]:
            asked = [j for j in alive if j not in settled]
            settled.update(dict.fromkeys(_settled(pairs, index, alive, asked, counts[-1] - t, log_thr, futility)
                                         - set(settled), t))
    return _result(status, data, pairs, alive, dropped, settled, read, alpha, margin, counts, look_done, log_thr, {},
                   intervals, futility)


def _result(status: str, data: dict[str, np.ndarray], pairs: _Pairs, alive: list[str],
            dropped: dict[str, tuple[int, int, str]], settled: dict[str, int], read: dict[str, int], alpha: float,
            margin: float, counts: tuple[int, ...], look_done: int, log_thr: float, need: dict[str, int],
            intervals: bool, futility: float | None) -> Selection:
    """The Selection of a replay: each checkpoint's interval against who dropped it (on the rows of that look), or
    against the leader (on the rows both read)."""
    leader = _leader(pairs, {j: n for n, j in enumerate(data)}, alive)
    records = []
    for j, x in data.items():
        t, r, vs = dropped.get(j, (None, None, leader if j != leader else None))
        both = min(read[j], read[vs]) if vs is not None else read[j]
        diff = lo = hi = float("nan")
        if vs is not None and both:
            d = x[:both] - data[vs][:both]
            diff = float(d.mean())
            if intervals:
                lo, hi = confidence_bounds(d, log_thr)
        records.append(CheckpointRecord(j, read[j], float(x[:read[j]].mean()) if read[j] else float("nan"), t, r,
                                        vs, diff, lo, hi, both, settled.get(j)))
    undecided = status == "undecided" and len(alive) > 1
    reason = _undecided_reason(alive, read, counts, alpha, margin, futility) if undecided else ""
    return Selection(status, leader, tuple(alive), alpha, margin, counts, look_done, tuple(records), dict(need),
                     tuple(j for j in alive if j in settled), reason)


def _leader(pairs: _Pairs, index: dict[str, int], alive: list[str]) -> str:
    """The survivor of highest mean paired difference to the other survivors, each pair on the rows both read (a
    member that settled early is compared on its own rows, not on the shortest survivor's); ties: the earlier."""
    ids = np.array([index[j] for j in alive])
    count, total = (pairs.sums[(p, *np.ix_(ids, ids))] for p in range(2))
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    score = mean.sum(axis=1) / max(len(alive) - 1, 1)
    return alive[int(np.argmax(score))]                 # argmax: the first of equal scores


def _undecided_reason(alive: list[str], read: dict[str, int], counts: tuple[int, ...], alpha: float,
                      margin: float, z: float | None) -> str:
    """The plain sentence an undecided set carries."""
    least, most = min(read[j] for j in alive), max(read[j] for j in alive)
    span = f"the first {least}" if least == most else f"the first {least} to {most}"
    where = (f"all {counts[-1]} problems read" if least == counts[-1] else
             f"each read on {span} of the {counts[-1]} problems, then settled: projected over the rest from the "
             f"rows read, even {z:g} standard errors in its favour would not separate any pair nor show them all "
             "equivalent")
    return (f"{len(alive)} checkpoints cannot be told apart on this benchmark at alpha {alpha:g} and margin "
            f"{margin:g} ({where}); the best is among them with probability at least {1 - alpha:g}, none of them is "
            "shown worse than another, and which one leads is not significant")


def run_selection(rows: Mapping[str, Sequence[float]], generate: Callable[[dict[str, int]], Mapping[str, Sequence[float]]],
                  looks: Sequence[int], alpha: float = 0.05, margin: float = 0.02, intervals: bool = True,
                  futility: float | None = FUTILITY_Z) -> Selection:
    """Drive `select_step` to the end: `rows` names every checkpoint of the selection with the rows it already has
    (possibly none), which are never asked for again; `generate(need)` returns each named checkpoint's rows (all of
    them, in the shared order) once it has at least `need[name]`. The flow's loop, in memory; the intervals are
    computed once, on the final replay."""
    current = {str(k): np.asarray(v, dtype=np.float64) for k, v in rows.items()}
    while True:
        sel = select_step(current, looks, alpha, margin, intervals=False, futility=futility)
        if sel.done:
            return select_step(current, looks, alpha, margin, intervals, futility) if intervals else sel
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

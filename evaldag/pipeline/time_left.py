"""How long a shard's generation has left, while it runs.

A shard's completions have lengths from 1 to the token cap, and the short ones finish first, so the completions
finished at any moment are a biased sample: counting problems done (or assuming the finished mean) forecasts far
too early an end. Here the length distribution is estimated with Kaplan-Meier, which is unbiased under this kind
of censoring: finished completions are observed lengths; running ones are censored at the tokens they have so far
(their length is known to be larger); completions not started carry no information. Then

    tokens left = sum over running completions of E[L - g | L > g]  +  (completions not started) x E[L]

with the expectations taken under the estimated distribution, capped at `cap` (no completion is longer), and

    seconds left = tokens left / the shard's generation rate over the last `window_s` seconds.

Before any completion has finished the estimate is the pessimistic one (every completion runs to the cap). What it
leaves out: the engine's throughput falls in the last minutes, when fewer sequences run than it can batch, so the
forecast is then somewhat early; docs/performance.md gives its measured error.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


# Seconds of generation before the first forecast: the engine takes the prompts in first, at a fraction of its rate.
MIN_SPAN_S = 30.0


@dataclass(frozen=True)
class Estimate:
    """A forecast: tokens still to generate, the recent generation rate, and seconds left (None until a rate is
    known)."""
    tokens_left: int
    tokens_per_s: float | None
    seconds_left: float | None


def tokens_left(finished: Sequence[int], running: Sequence[int], not_started: int, cap: int) -> float:
    """Expected tokens still to generate (see the module's doc): `finished` and `running` are completion lengths in
    tokens (final and so far), `not_started` counts completions without a token yet, `cap` is max_new_tokens."""
    if cap <= 0:
        return 0.0
    events = np.minimum(np.asarray(finished, dtype=np.int64), cap)
    censored = np.minimum(np.asarray(running, dtype=np.int64), cap)
    # Kaplan-Meier: S(t) = P(L > t) steps down at each observed length t_j by (1 - finished at t_j / at risk at t_j);
    # a completion running with g tokens is at risk at every t_j <= g
    times, deaths = np.unique(events, return_counts=True)
    observed = np.sort(np.concatenate([events, censored]))
    at_risk = observed.size - np.searchsorted(observed, times, side="left")
    survival = np.cumprod(1.0 - deaths / np.maximum(at_risk, 1))
    # S as segments: 1 on [0, t_0), survival[j] on [t_j, t_{j+1}), the last one up to the cap
    starts = np.concatenate([[0], times]).astype(np.float64)
    ends = np.concatenate([times, [cap]]).astype(np.float64)
    values = np.concatenate([[1.0], survival])
    areas = values * np.maximum(ends - starts, 0.0)
    tail = np.concatenate([np.cumsum(areas[::-1])[::-1], [0.0]])      # tail[k]: sum of S over segments k...
    k = np.searchsorted(times, censored, side="right")                # the segment holding each running g
    s_g = values[k]
    running_left = (tail[k + 1] + s_g * np.maximum(ends[k] - censored, 0.0)) / np.maximum(s_g, 1e-12)
    left = not_started * tail[0] + float(running_left.sum())        # E[L] = sum of S(t) for t = 0..cap-1
    return float(left)


class TimeLeft:
    """Tracks one shard's generation and forecasts its end: feed it finished completions and the running ones'
    token counts; `estimate` gives tokens and seconds left.

    `clock` is injectable for tests; the rate is taken over the last `window_s` seconds of reports (generation
    slows and speeds up as the running set changes, so the recent rate forecasts better than the average), and
    seconds left are given once `min_span_s` seconds of generation and one finished completion are behind."""

    def __init__(self, completions: int, cap: int, window_s: float = 300.0, min_span_s: float | None = None,
                 clock=time.monotonic) -> None:
        self.completions, self.cap, self.window_s, self.clock = completions, cap, window_s, clock
        self.min_span_s = MIN_SPAN_S if min_span_s is None else min_span_s
        self.finished: list[int] = []
        self._history: deque[tuple[float, int]] = deque()     # (time, tokens generated so far)

    def finish(self, lengths: Sequence[int]) -> None:
        """Completions that finished, with their lengths in tokens."""
        self.finished.extend(int(n) for n in lengths)

    def estimate(self, tokens_so_far: int, running: Sequence[int] | None, not_started: int | None = None) -> Estimate:
        """The forecast now, given the tokens generated so far (this run's, all completions) and the token counts
        of the running completions (None where the engine does not report them: then every unfinished completion
        counts as not started). `not_started`, where the caller knows it, counts the completions not handed to the
        engine yet; the others that are neither finished nor running have finished without being reported one by
        one (a sample of an n-sample request whose siblings still run) and have nothing left to generate."""
        now = self.clock()
        if tokens_so_far > 0 or self._history:        # the rate counts from the first token (prefill is slower)
            self._history.append((now, tokens_so_far))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        running = list(running or [])
        unfinished = max(self.completions - len(self.finished) - len(running), 0)
        not_started = unfinished if not_started is None else min(max(not_started, 0), unfinished)
        left = tokens_left(self.finished, running, not_started, self.cap)
        t0, tok0 = self._history[0] if self._history else (now, tokens_so_far)
        rate = (tokens_so_far - tok0) / (now - t0) if now > t0 and tokens_so_far > tok0 else None
        # no forecast from the first seconds of generation (the engine is still taking prompts in) nor before a
        # completion has finished (every length is then only known to be at least what it has so far)
        known = rate is not None and now - t0 >= self.min_span_s and self.finished
        seconds = 0.0 if left == 0 else (left / rate if known else None)
        return Estimate(tokens_left=round(left), tokens_per_s=rate, seconds_left=seconds)


__all__ = ["MIN_SPAN_S", "Estimate", "TimeLeft", "tokens_left"]

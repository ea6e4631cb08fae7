"""Pacing an evaluation that may stop early: which requests a shard holds back (the round gate), and when the
parent lets it run at full batch because no verdict is in sight. Scheduling only: the verdict and its error rate do
not depend on anything here (evaldag.decisions.decide reads them)."""

from __future__ import annotations

import bisect
import math

import numpy as np
from scipy.special import ndtr

from evaldag.decisions.sequential import look_quantile, look_spread

# The round gate (RoundGate): a shard hands out the requests of a round only while every round before the previous
# one is done but for this share of its requests (their longest answers, which the verdict bounds instead of
# waiting for), and only over the first GATED_SHARE of the rounds: a verdict there saves most, and an evaluation
# still undecided after them runs at full speed.
GATE_TOLERANCE, GATE_LOOKAHEAD, GATED_SHARE = 0.05, 1, 0.5
# worth_gating counts a verdict in sight while the chance that the last gated round decides is at least this
GATE_CHANCE = 0.3


class RoundGate:
    """Which of a shard's requests must wait for now, so that what it generates beyond the round being decided
    stays small.

    Everything a shard holds in its engine is generated in part, and before this gate a shard with its full batch
    in flight had generated nearly everything by the time a prefix was complete (bench_decide: 0.99 of the tokens
    on 8 slots, MATH-500-like at a 32k cap). `rounds_of[k]` is the round (index of the first round end past the
    problem's place in the decision order) of the k-th request in submission order."""

    def __init__(self, rounds_of: list[int], rounds: int, tolerance: float = GATE_TOLERANCE,
                 lookahead: int = GATE_LOOKAHEAD, gated_share: float = GATED_SHARE) -> None:
        self.rounds_of = rounds_of
        self.gated = math.ceil(rounds * gated_share)
        self.tolerance, self.lookahead = tolerance, lookahead
        self.open: dict[int, int] = {}
        for q in rounds_of:
            self.open[q] = self.open.get(q, 0) + 1
        self.size = dict(self.open)

    def first_open(self) -> int:
        """The first round more than `tolerance` of whose requests are unfinished (a large number when none)."""
        return min((q for q, c in self.open.items() if c > self.tolerance * self.size[q]), default=1 << 30)

    def hold(self, k: int) -> bool:
        """Whether request k must wait for now."""
        first = self.first_open()
        return first < self.gated and self.rounds_of[k] > first + self.lookahead

    def finished(self, k: int) -> None:
        self.open[self.rounds_of[k]] -= 1

    def lift(self) -> None:
        """Hold nothing from now on (the parent sees no verdict in sight within the gated rounds)."""
        self.gated = 0


def worth_gating(d: np.ndarray, target: int, alpha: float, margin: float, z: float) -> bool:
    """Whether a verdict by `target` paired problems is still in sight, from the paired differences `d` of a prefix
    of the decision order (pace_sample): the chance that the look at `target` decides, with its mean predicted from
    this one (normal, variance s^2 (1/t - 1/target): what the problems still to come can move it) and its interval
    from this spread, is at least GATE_CHANCE. While it is, the shards keep the round gate (what they generate
    beyond the round being decided is waste if it decides); once it is not, they drop it and run at full batch (the
    evaluation most likely runs on, and the gate would only slow it). Scheduling only: the verdict and its error
    rate do not depend on it."""
    d = np.asarray(d, dtype=np.float64)
    t = int(d.size)
    if t < 2 or t >= target:
        return t == 0
    s = look_spread(float(((d - d.mean()) ** 2).sum()), t)
    half = look_quantile(z, target) * s / math.sqrt(target)
    spread = s * math.sqrt(1 / t - 1 / target)
    mean = float(d.mean())
    chance = ndtr((mean - half) / spread) + ndtr((-half - mean) / spread)                           # better / worse
    if half < margin:                                                                               # equivalent
        chance += max(0.0, ndtr((margin - half - mean) / spread) - ndtr((half - margin - mean) / spread))
    return chance >= GATE_CHANCE


def pace_sample(low_d: np.ndarray, high_d: np.ndarray, looks: list[int]) -> np.ndarray:
    """What worth_gating reads: the paired differences of the longest look's prefix (of the decision order) whose
    ranges are at most GATE_TOLERANCE unknown, each unfinished sample counted wrong (`low_d`); empty before the first
    look is. A prefix of the random order, not the problems that happen to be complete: those lean to short
    answers, which are more often right, and made a clear difference look like none (the gate was lifted in 40-80 %
    of simulated runs that then decided at a quarter of the problems). Wrong, not the middle of the range, for the
    same reason: the answers still running are the long ones, mostly wrong (and at the cap, always)."""
    unknown = np.cumsum(np.asarray(high_d) - np.asarray(low_d))
    ready = [t for t in looks if 0 < t <= unknown.size and unknown[t - 1] <= GATE_TOLERANCE * t]
    if not ready:
        return np.zeros(0)
    return np.asarray(low_d, dtype=np.float64)[:ready[-1]]


def round_of(ranks: list[int], ends: list[int]) -> list[int]:
    """The round of each decision-order place in `ranks` (0 for the problems before the first round end), given
    the round ends (evaldag.decisions.decide.round_ends)."""
    return [bisect.bisect_right(ends, r) for r in ranks]


__all__ = ["GATE_CHANCE", "RoundGate", "pace_sample", "round_of", "worth_gating"]

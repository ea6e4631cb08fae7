"""Tokens a sequential decision costs at GPU scale: a simulation of how evaldag.decisions.decide runs it on slots
(one shard per slot), used by bench_decide.py.

Model (stated, not fitted). Problems and solve rates as bench_decide.py's (MATH-500's levels); checkpoint B's
samples get lengths: a problem effect (harder problems, longer answers) and a sample effect, log-normal, wrong
answers 1.6x longer, capped at 32,768 tokens, and a sample at the cap is wrong (truncated). Scales: MATH-500-like
(mean ~4.1k sampled tokens, AReaL's figure) and AIME-like (mean ~13.7k, many at the cap). An engine slot runs its
sequences one token a step each; a step takes STEP_BASE + STEP_PER_SEQ x running sequences (a GPU decode step:
memory-bound, a few times faster per sequence when many run together), which gives the wall time.

Two policies:
- before: a request per problem (its n samples, seen when the last ends), `window` requests in flight per shard,
  decided only on the complete prefix of the decision order (evaldag before issue 37);
- after (what decide.py does now): a request per sample in the decision order, the engine's batch in flight but
  paced by the round gate (pacing.RoundGate: a round's requests wait while the round before the previous one
  still has more than 5 % of its requests running, over the first half of the rounds), which the parent lifts
  once no verdict is in sight within those rounds (pacing.worth_gating); the verdict read on the round's
  repeated confidence interval (evaldag.decisions.sequential) whose unfinished samples are bounded by their
  extremes, and at the stop every request outside the decided prefix aborted while the prefix's own finish.
Both read the verdict with today's boundary; before issue 37 the test was a betting confidence sequence, which
decided later (bench_decide's (c): 0.40 of the problems on median against 0.30).
All slots run in lockstep (one step clock) and the parent polls every `poll` steps.
Tokens counted: every token generated, the partial ones of aborted requests included.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from evaldag.decisions.pacing import RoundGate, pace_sample, round_of, worth_gating
from evaldag.decisions.sequential import pocock_boundary, selection_bounds, stopping_times

CAP = 32_768
STEP_BASE, STEP_PER_SEQ = 1.0, 1 / 128          # a step with 128 sequences takes twice one with a single sequence
SCALES = {"MATH-500-like": (2_600.0, 0.75), "AIME-like": (9_000.0, 0.85)}   # median scale, sample sigma


def lengths_and_correct(rng: np.random.Generator, p: np.ndarray, n: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """(problems, n) lengths and correctness of the candidate's samples, solve rates `p` (problems,)."""
    median, sigma = SCALES[scale]
    correct = rng.random((p.size, n)) < p[:, None]
    mu = math.log(median) + 1.2 * (0.5 - p) + 0.35 * rng.standard_normal(p.size)
    length = np.exp(mu[:, None] + sigma * rng.standard_normal((p.size, n))) * np.where(correct, 1.0, 1.6)
    length = np.minimum(np.ceil(length), np.where(correct, CAP - 1, CAP))     # at the cap: wrong (truncated)
    return length.astype(np.int64), correct


def shard_of(problems: int, shards: int, rng: np.random.Generator) -> np.ndarray:
    """Each problem's shard: contiguous near-equal slices of the benchmark's (shuffled) order, as plans cut them."""
    return np.repeat(np.arange(shards), np.diff(np.linspace(0, problems, shards + 1).round().astype(int)))[
        rng.permutation(problems)]


class Slot:
    """One engine slot running a shard's requests (each a list of (rank, sample)) in order, at most `window` in
    flight, the next held while `gate.hold` says so."""

    def __init__(self, units: list, window: int, gate: RoundGate | None) -> None:
        self.units, self.window, self.gate = units, window, gate
        self.next = 0
        self.left: dict[int, int] = {}          # request -> sequences still running
        self.pending: dict[int, list] = {}
        self.running = 0
        self.curve: list[tuple[float, int]] = [(0, 0)]   # (step, running) at every change
        self.withdrawn = False

    def top_up(self, now: float, length: np.ndarray, heap: list, slot: int, starts: dict) -> None:
        while (not self.withdrawn and self.next < len(self.units) and len(self.left) < self.window
               and (not self.left or self.gate is None or not self.gate.hold(self.next))):
            k = self.next
            self.left[k], self.pending[k] = len(self.units[k]), []
            for rank, j in self.units[k]:
                heapq.heappush(heap, (now + int(length[rank, j]), slot, k))
                self.pending[k].append((rank, j))
                starts[(rank, j)] = now
            self.running += len(self.units[k])
            self.next += 1
        self.curve.append((now, self.running))


def cost_until(curve: list, t: float) -> float:
    """A slot's busy time until step t, each step priced STEP_BASE + STEP_PER_SEQ x running."""
    total = 0.0
    for (a, run), (b, _) in zip(curve, curve[1:] + [(float("inf"), 0)]):
        if a >= t:
            break
        if run:
            total += (min(b, t) - a) * (STEP_BASE + STEP_PER_SEQ * run)
    return total


def simulate_run(rng: np.random.Generator, p_a: np.ndarray, p_b: np.ndarray, n: int, scale: str, shards: int,
                 policy: str, budget: int, alpha: float, margin: float, rounds: int, poll: int) -> dict:
    """One evaluation decided against an incumbent, its problems already in the decision order (row = rank).
    Returns the tokens generated (the partial ones of aborted requests and the decided prefix's last ones
    included) over the full evaluation's, the wall-time proxy, where it stopped and its verdict."""
    problems = p_a.size
    score_a = rng.binomial(n, p_a) / n
    length, correct = lengths_and_correct(rng, p_b, n, scale)
    owner = shard_of(problems, shards, rng)
    ends = sorted({math.ceil(problems * r / rounds) for r in range(1, rounds + 1)})
    slots = []
    for s in range(shards):
        ranks = [int(r) for r in np.flatnonzero(owner == s)]     # ascending: the decision order
        if policy == "before":          # a request per problem, the engine's batch of them in flight
            slots.append(Slot([[(r, k) for k in range(n)] for r in ranks], budget // n, None))
        else:
            units = [[(r, k)] for r in ranks for k in range(n)]
            slots.append(Slot(units, budget, RoundGate(round_of([u[0][0] for u in units], ends), rounds)))
    d_full = correct.mean(axis=1) - score_a
    first_end = problems
    if policy == "before":
        at, _ = stopping_times(d_full[None, :], ends, alpha, margin)
        first_end = int(at[0])
    gated_end = ends[max(1, math.ceil(rounds * 0.5)) - 1]
    heap: list = []
    starts: dict = {}
    seen = np.full((problems, n), np.inf)
    for k, slot in enumerate(slots):
        slot.top_up(0, length, heap, k, starts)
    now, next_poll, stop_t, stop_r, verdict, ungated = 0, poll, None, problems, "undecided", False
    while heap:
        if heap[0][0] <= next_poll:
            now, k, req = heapq.heappop(heap)
            slot = slots[k]
            slot.running -= 1
            slot.left[req] -= 1
            if not slot.left[req]:
                del slot.left[req]
                for rank, j in slot.pending.pop(req):
                    seen[rank, j] = now
                if slot.gate is not None:
                    slot.gate.finished(req)
            slot.top_up(now, length, heap, k, starts)
            continue
        now, next_poll = next_poll, next_poll + poll
        known = seen <= now
        complete = int(np.argmin(np.append(known.all(axis=1), False)))      # the complete prefix's length
        if policy == "before":
            if complete >= first_end < problems:
                stop_t, stop_r, verdict = now, first_end, "decided"
                break
            continue
        hit = _decided_end(correct, known, score_a, ends, alpha, margin)
        if hit is not None:
            stop_t, stop_r, verdict = now, hit, "decided"
            break
        c, u = (correct & known).sum(axis=1) / n, (~known).sum(axis=1) / n
        d_read = pace_sample(c - score_a, c + u - score_a, ends)
        if not ungated and d_read.size and not worth_gating(d_read, gated_end, alpha, margin,
                                                            pocock_boundary(tuple(ends), alpha)):
            ungated = True
            for k, slot in enumerate(slots):
                slot.gate.lift()
                slot.top_up(now, length, heap, k, starts)
    full_tokens = float(length.sum())
    if stop_t is None:
        wall = max(cost_until(slot.curve, float("inf")) for slot in slots)
        return {"tokens": 1.0, "wall": wall, "stop": 1.0, "verdict": verdict, "ungated": ungated}
    # at the stop: everything outside the prefix withdrawn (its partial tokens spent), the prefix's own finish
    tokens, last = 0.0, stop_t
    for (rank, j), start in starts.items():
        ran = min(length[rank, j], stop_t - start)
        tokens += length[rank, j] if rank < stop_r else ran
        if rank < stop_r:
            last = max(last, start + length[rank, j])
    unstarted = [(r, j) for r in range(stop_r) for j in range(n) if (r, j) not in starts]
    tokens += sum(float(length[r, j]) for r, j in unstarted)
    last = max([last] + [stop_t + length[r, j] for r, j in unstarted])
    wall = max(cost_until(slot.curve, stop_t) for slot in slots) + (last - stop_t) * STEP_BASE
    return {"tokens": tokens / full_tokens, "wall": wall, "stop": stop_r / problems, "verdict": verdict, "ungated": ungated}


def _decided_end(correct: np.ndarray, known: np.ndarray, score_a: np.ndarray, ends: list[int], alpha: float,
                 margin: float) -> int | None:
    """What decide.Decider reads at a poll: the first round end (before the last) decided whatever the unfinished
    samples turn out to be. A shortcut of the simulation only: rounds with over 15 % of their samples unknown are
    not looked at (the ranges are then far too wide to decide)."""
    n = correct.shape[1]
    c = (correct & known).sum(axis=1) / n
    u = (~known).sum(axis=1) / n
    share = np.cumsum(u) / np.arange(1, c.size + 1)
    z = pocock_boundary(tuple(ends), alpha)
    for e in ends[:-1]:
        if share[e - 1] > 0.15:
            continue
        bounds = selection_bounds([c[:e] - score_a[:e]], z, z, [c[:e] + u[:e] - score_a[:e]])
        if bounds.verdicts(margin)[0] != "undecided":
            return e
    return None


def full_wall(rng: np.random.Generator, p_b: np.ndarray, n: int, scale: str, shards: int, budget: int) -> float:
    """The wall-time proxy of the full evaluation without decide: every sample a request, the engine's batch of
    sequences in flight on every slot."""
    length, _ = lengths_and_correct(rng, p_b, n, scale)
    owner = shard_of(p_b.size, shards, rng)
    heap: list = []
    slots = [Slot([[(int(r), k)] for r in np.flatnonzero(owner == s) for k in range(n)], budget, None)
             for s in range(shards)]
    for k, slot in enumerate(slots):
        slot.top_up(0, length, heap, k, {})
    while heap:
        now, k, req = heapq.heappop(heap)
        slots[k].running -= 1
        del slots[k].left[req]
        slots[k].top_up(now, length, heap, k, {})
    return max(cost_until(slot.curve, float("inf")) for slot in slots)

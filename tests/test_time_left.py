"""The forecast of a shard's end (evaldag.pipeline.time_left): the Kaplan-Meier estimate of what is left, and the rate."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from evaldag.pipeline.time_left import TimeLeft, tokens_left


def test_what_is_left_in_cases_worked_by_hand():
    assert tokens_left([], [], 10, 512) == 10 * 512                 # nothing known yet: every completion to the cap
    assert tokens_left([100] * 5, [], 0, 512) == 0
    assert tokens_left([100] * 5, [], 5, 512) == pytest.approx(500)  # all seen so far were 100 long
    # a completion running past every length seen so far can only be known to end by the cap
    assert tokens_left([100] * 5, [300], 0, 512) == pytest.approx(212)
    # half of those seen were 100 long, half ran to the cap: one at 200 tokens is one of the long ones
    assert tokens_left([100, 100, 512, 512], [200], 0, 512) == pytest.approx(312)
    assert tokens_left([100, 100, 512, 512], [], 1, 512) == pytest.approx(306)
    assert tokens_left([5], [3], 0, 0) == 0.0


def _snapshots(rng, n=400, concurrency=64, cap=512):
    """One engine's run of `n` completions, at most `concurrency` at once, all advancing a token per step; yields
    (finished lengths, running counts, not started, true tokens left) at several moments."""
    lengths = np.minimum(np.rint(np.exp(rng.normal(5.3, 0.9, n))), cap).astype(int).clip(1)
    waiting, running, finished, step = list(lengths[::-1]), [], [], 0
    while waiting and len(running) < concurrency:
        length = waiting.pop()
        heapq.heappush(running, (step + length, step))
    while running:
        end, start = heapq.heappop(running)
        step = end
        finished.append(end - start)
        while waiting and len(running) < concurrency:
            length = waiting.pop()
            heapq.heappush(running, (step + length, step))
        if len(finished) % 40 == 0 and running:
            counts = [step - s for _, s in running]
            truth = sum(e - step for e, _ in running) + sum(waiting)
            yield list(finished), counts, len(waiting), truth


def test_the_estimate_is_unbiased_where_the_finished_mean_is_not():
    """Short completions finish first, so the finished mean forecasts far too little; Kaplan-Meier, which counts
    running completions as lengths known to be larger, does not (mean over many runs, at every moment once 20 % of
    the completions finished: before that no completion has run long enough to say how long the long ones are, and
    the estimate leans to the cap, measured 1.31x at 10 %)."""
    rng = np.random.default_rng(7)
    km, naive, truth = [], [], []
    for _ in range(20):
        for finished, counts, not_started, left in _snapshots(rng):
            if len(finished) < 80:
                continue
            km.append(tokens_left(finished, counts, not_started, 512))
            mean = float(np.mean(finished))
            naive.append(sum(max(mean - g, 0) for g in counts) + not_started * mean)
            truth.append(left)
    km, naive, truth = map(np.asarray, (km, naive, truth))
    assert abs(km.sum() / truth.sum() - 1) < 0.05, km.sum() / truth.sum()
    assert naive.sum() / truth.sum() < 0.8, naive.sum() / truth.sum()


def test_seconds_left_come_from_the_recent_rate():
    now = [0.0]
    est = TimeLeft(completions=4, cap=100, window_s=10.0, min_span_s=4.0, clock=lambda: now[0])
    first = est.estimate(0, [])
    assert first.tokens_left == 400 and first.seconds_left is None and first.tokens_per_s is None
    now[0] = 1.0
    est.estimate(10, [5, 5])                # the first tokens: the rate counts from here
    now[0] = 3.0
    early = est.estimate(50, [25, 25])      # 2 s of generation, nothing finished: no forecast yet
    assert early.tokens_per_s == pytest.approx(20.0) and early.seconds_left is None
    now[0] = 6.0
    est.finish([50, 50])
    second = est.estimate(110, [])          # 100 tokens in 5 s; two left, like those seen: 100 tokens
    assert second.tokens_per_s == pytest.approx(20.0) and second.tokens_left == 100
    assert second.seconds_left == pytest.approx(5.0)
    now[0] = 26.0
    est.finish([30])
    third = est.estimate(170, [10])         # the window has moved past the earlier reports: 60 tokens in 20 s
    assert third.tokens_per_s == pytest.approx(3.0)
    est.finish([50])
    assert est.estimate(220, []).seconds_left == 0.0


def test_a_finished_sample_of_a_running_request_is_not_counted_as_not_started():
    """vLLM drops a request's finished sample from its running set while the siblings run, and reports the request
    once all n are done: with the caller saying how many were never handed to the engine, the dropped one costs
    nothing, where it used to be charged a whole completion (E[L], here 100 tokens)."""
    now = [0.0]
    est = TimeLeft(completions=8, cap=100, min_span_s=0.0, clock=lambda: now[0])   # 2 requests of n = 4
    est.finish([100, 100, 100, 100])                                    # the first request, all four 100 long
    # the second: one sample finished (dropped), three running at 40 tokens; nothing waits outside the engine
    assert est.estimate(460, [40, 40, 40], not_started=0).tokens_left == 3 * 60
    assert est.estimate(460, [40, 40, 40]).tokens_left == 3 * 60 + 100        # unknown: the old reading
    assert est.estimate(460, [40, 40, 40], not_started=4).tokens_left == 3 * 60 + 100   # at most the unfinished

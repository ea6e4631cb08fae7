"""The forecast of a shard's end (evaldag.pipeline.time_left): the estimate of the tokens left (Kaplan-Meier, with a
log-normal tail), the engine's step time against its running sequences, and the seconds left from running the rest
on that engine."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from evaldag.pipeline.time_left import (TAIL_MIN_FINISHED, StepModel, Survival, TimeLeft, drain_seconds,
                                       fit_step_model, tokens_left)


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


def test_the_rate_is_the_recent_one_and_seconds_follow_the_measured_step_time():
    """The rate shown is over the last window_s seconds. Here the engine's step time is 0.05 s per running sequence
    (2 at 20 tokens/s, then 1 at 20): the fitted line says two completions of 50 tokens, together, take 5 s."""
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


def test_the_step_time_line_is_fitted_to_the_run_and_falls_back_on_the_prior():
    # measured at 100, 50 and 10 running sequences on an engine with step = 0.01 + 0.001 c, for 1000 s each
    intervals = [(1000.0, c, 1000.0 * c / (0.01 + 0.001 * c)) for c in (100, 50, 10)]
    model = fit_step_model(intervals, base_fraction=0.5)
    assert model.base_s == pytest.approx(0.01, rel=0.15) and model.per_seq_s == pytest.approx(0.001, rel=0.05)
    # only ever full (100 running): the measured step, with the prior's share of it not growing with c
    full = fit_step_model([(600.0, 100, 600.0 * 100 / 0.11)], base_fraction=0.2)
    assert full.step_s(100) == pytest.approx(0.11, rel=1e-6)
    assert full.base_s == pytest.approx(0.2 * 0.11, rel=1e-6)
    assert fit_step_model([], base_fraction=0.2) is None


def test_draining_an_engine_worked_by_hand():
    # two running with 1 and 3 tokens to go, one of 2 waiting, 2 slots: the waiting one starts after 1 step, so 3
    # steps at 2 running; a step of 1 s whatever the count, or of c seconds with c running
    assert drain_seconds(np.array([1.0, 3.0]), np.array([2.0]), 2, StepModel(1.0, 0.0)) == pytest.approx(3.0)
    assert drain_seconds(np.array([1.0, 3.0]), np.array([2.0]), 2, StepModel(0.0, 1.0)) == pytest.approx(6.0)
    # one slot: 1, then 2, then what is left of the 3 (1 ran alone first... no: the 3 already runs) -> all in turn
    assert drain_seconds(np.array([4.0]), np.array([]), 1, StepModel(0.5, 0.5)) == pytest.approx(4.0)
    assert drain_seconds(np.array([]), np.array([]), 4, StepModel(1.0, 1.0)) == 0.0


def test_lengths_past_the_longest_finished_follow_a_fitted_tail_not_the_cap():
    """Once enough have finished, a completion running past every finished length is expected to end as a
    log-normal fitted to all lengths says, not at the cap; the draws the forecast runs agree with the expectation."""
    rng = np.random.default_rng(3)
    cap = 32768
    finished = np.minimum(np.rint(np.exp(rng.normal(7.0, 0.8, 400))), cap).astype(int)
    longest = int(finished.max())
    running = [longest + 100, 2000, 50]
    survival = Survival(finished, running, cap)
    assert survival.tail is not None
    assert survival.tail.mu == pytest.approx(7.0, abs=0.1) and survival.tail.sigma == pytest.approx(0.8, abs=0.1)
    left = survival.mean_left(np.array(running, dtype=float))
    assert left[0] < 0.25 * (cap - running[0])           # the cap is far in the log-normal's tail
    draws = np.stack([survival.draw(np.array(running, dtype=float), rng) for _ in range(4000)])
    assert (draws > np.array(running)).all() and (draws <= cap).all()
    assert draws.mean(axis=0) - running == pytest.approx(left, rel=0.05)
    unconditional = np.stack([survival.draw(np.zeros(1), rng) for _ in range(4000)])
    assert unconditional.mean() == pytest.approx(survival.mean(), rel=0.05)
    # too few finished to fit: past the longest, every completion runs to the cap (the worked cases above)
    few = Survival(finished[: TAIL_MIN_FINISHED - 1], [longest + 100], cap)
    assert few.tail is None and few.mean_left(np.array([longest + 100.0]))[0] == cap - longest - 100


def _engine_run(rng, base_s, per_seq_s, base_fraction, slots=64, n=600, cap=8192, report_s=2.0):
    """A continuous-batching engine (step = base_s + per_seq_s x running) over `n` log-normal completions in
    random order, a TimeLeft fed as a shard feeds it; returns the end and (work done, seconds left, forecast, tokens
    left / rate) per report once a forecast is given."""
    lengths = np.minimum(np.rint(np.exp(rng.normal(6.5, 0.9, n))), cap).astype(int).clip(1)
    now = [0.0]
    est = TimeLeft(n, cap, clock=lambda: now[0], base_fraction=base_fraction)
    waiting, running, steps, done_tokens, rows = list(lengths[::-1]), [], 0.0, 0, []
    next_report = report_s
    while waiting and len(running) < slots:
        heapq.heappush(running, (steps + waiting.pop(), steps))
    while running:
        step_s = base_s + per_seq_s * len(running)
        t_end = now[0] + (running[0][0] - steps) * step_s
        if next_report <= t_end:
            steps += (next_report - now[0]) / step_s
            now[0] = next_report
            counts = [int(steps - s) for _, s in running]
            e = est.estimate(done_tokens + sum(counts), counts)
            if e.seconds_left is not None:
                rows.append(((done_tokens + sum(counts)) / lengths.sum(), now[0], e.seconds_left,
                             e.tokens_left / e.tokens_per_s))
            next_report += report_s
            continue
        now[0], steps = t_end, running[0][0]
        finished = []
        while running and running[0][0] <= steps + 1e-9:
            end, start = heapq.heappop(running)
            finished.append(round(end - start))
        done_tokens += sum(finished)
        est.finish(finished)
        while waiting and len(running) < slots:
            heapq.heappush(running, (steps + waiting.pop(), steps))
    return now[0], [(work, now[0] - t, forecast, naive) for work, t, forecast, naive in rows]


def test_the_forecast_knows_the_engine_slows_as_it_drains():
    """On a GPU-like engine (a step with 1 sequence costs a third of one with 64) the last sequences run at a fraction
    of the full rate, so tokens left / the current rate forecasts far too early an end; running the rest on the step
    time fitted with the device's prior does not (mean over runs, reports from 20 % of the work to the last 10 % of
    the time). bench/bench_time_left.py measures it at 32k tokens, and with a prior that is off."""
    rng = np.random.default_rng(11)
    ours, rate = [], []
    for _ in range(4):
        end, rows = _engine_run(rng, base_s=0.007, per_seq_s=0.0002, base_fraction=0.007 / (0.007 + 0.0002 * 64))
        for work, truth, forecast, naive in rows:
            if work >= 0.2 and truth > 0.1 * end:
                ours.append(abs(forecast - truth) / truth)
                rate.append(abs(naive - truth) / truth)
    assert np.mean(ours) < 0.15, np.mean(ours)
    assert np.mean(rate) > 2 * np.mean(ours), (np.mean(rate), np.mean(ours))

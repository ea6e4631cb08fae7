"""The forecast of a shard's end (evaldag.pipeline.time_left): the estimate of the tokens left (Kaplan-Meier, with a
log-normal tail), the engine's step time against its running sequences, and the seconds left from running the rest
on that engine."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from evaldag.pipeline.time_left import (BASE_FRACTION, TAIL_MIN_FINISHED, Estimate, StepModel, Survival, TimeLeft,
                                       drain_seconds, fit_step_model, tokens_left, without_finished)


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
    # noise that makes more sequences look cheaper per step: no negative slope, the mean step time instead
    noisy = fit_step_model([(100.0, c, 100.0 * c / s) for c, s in ((100, 0.05), (10, 0.08))], base_fraction=0.0,
                           prior_weight_s=0.0)
    assert noisy.per_seq_s == 0.0 and noisy.base_s == pytest.approx((0.05 + 0.08) / 2)


def test_the_step_time_is_measured_where_the_engine_decodes_not_while_it_takes_prompts_in():
    """While the running set grows the engine spends its steps on the new prompts' prefill (here 2.2 s a step): those
    intervals are not step times of decoding, and fitted in they raised the step of a small running set several-fold.
    Then the running set stays full and drains on an engine with step = 0.02 + 0.002 c: that is what is fitted."""
    now, tokens = [0.0], [0]
    est = TimeLeft(2000, 512, clock=lambda: now[0], base_fraction=0.02)

    def report(c: int, seconds: float, step_s: float) -> None:
        now[0] += seconds
        tokens[0] += round(seconds / step_s * c)
        est.estimate(tokens[0], [5] * c)

    report(1, 1.0, 2.2)
    for c in (60, 120, 180, 240, 256):          # prompts going in: slow steps
        report(c, 6.0, 2.2)
    for c in [256] * 10 + list(range(250, 0, -25)):
        report(c, 6.0, 0.02 + 0.002 * c)
    model = est.step_model()
    assert model.step_s(256) == pytest.approx(0.02 + 0.002 * 256, rel=0.1)
    assert model.step_s(10) == pytest.approx(0.02 + 0.002 * 10, rel=0.5), model
    # noise that would put the line's base below 0: a step proportional to c, fitted by least squares
    steep = fit_step_model([(100.0, c, 100.0 * c / s) for c, s in ((200, 0.5), (10, 0.001))], base_fraction=0.0,
                           prior_weight_s=0.0)
    assert steep.base_s == 0.0 and steep.step_s(200) == pytest.approx(0.5, rel=0.01)


def test_draining_an_engine_worked_by_hand():
    # two running with 1 and 3 tokens to go, one of 2 waiting, 2 slots: the waiting one starts after 1 step, so 3
    # steps at 2 running; a step of 1 s whatever the count, or of c seconds with c running
    assert drain_seconds(np.array([1.0, 3.0]), np.array([2.0]), 2, StepModel(1.0, 0.0)) == pytest.approx(3.0)
    assert drain_seconds(np.array([1.0, 3.0]), np.array([2.0]), 2, StepModel(0.0, 1.0)) == pytest.approx(6.0)
    # one slot, one sequence with 4 tokens to go: 4 steps of 0.5 + 0.5 x 1 s
    assert drain_seconds(np.array([4.0]), np.array([]), 1, StepModel(0.5, 0.5)) == pytest.approx(4.0)
    assert drain_seconds(np.array([]), np.array([]), 4, StepModel(1.0, 1.0)) == 0.0


def _mixture_left(tail, g, cap):
    """E[min(L, cap) - g | L > g] under the tail's mixture, by a brute-force integral of its survival."""
    from scipy.stats import lognorm

    t = np.linspace(g, cap, 200_001)
    ln = lognorm(s=tail.sigma, scale=np.exp(tail.mu))
    surv = (1 - tail.runaway) * ln.sf(t) + tail.runaway
    return float(np.sum((surv[1:] + surv[:-1]) / 2 * np.diff(t)) / surv[0])


def test_the_tail_is_fitted_to_finished_and_running_lengths():
    """A snapshot 1,500 tokens into 1,000 completions all started together: the finished ones are the short ones,
    so a fit to them alone says mu 6.55, sigma 0.53; with the running ones as lengths known to be larger it finds
    the truth (7, 0.8)."""
    rng = np.random.default_rng(5)
    lengths = np.rint(np.exp(rng.normal(7.0, 0.8, 1000))).astype(int)
    finished, running = lengths[lengths <= 1500], [1500] * int((lengths > 1500).sum())
    survival = Survival(finished, running, 32768)
    tail = survival.tail
    assert tail.mu == pytest.approx(7.0, abs=0.1) and tail.sigma == pytest.approx(0.8, abs=0.08)
    # and the mean length is about the truth, 1,503 (every running one to the cap would make it 11,800)
    assert survival.mean() == pytest.approx(lengths.mean(), rel=0.05)


def test_lengths_past_the_longest_finished_follow_the_tail_not_the_cap():
    """Past the longest finished length the expectation is the tail's (checked against a brute-force integral),
    not the cap; the forecast's draws agree with it, before and past that length."""
    rng = np.random.default_rng(3)
    cap = 32768
    finished = np.minimum(np.rint(np.exp(rng.normal(7.0, 0.8, 400))), cap).astype(int)
    longest = int(finished.max())
    running = np.array([longest + 100, 2 * longest, 2000, 50], dtype=float)
    survival = Survival(finished, running, cap)
    tail = survival.tail
    assert tail is not None and tail.runaway == pytest.approx(1 / 402)
    left = survival.mean_left(running)
    for g, got in zip(running[:2], left[:2]):
        assert got == pytest.approx(_mixture_left(tail, g, cap), rel=1e-3)
    # 100 tokens past the longest of 400, the log-normal and the runaway share are about as likely: not all to the cap
    assert left[0] < 0.9 * (cap - running[0])
    draws = np.stack([survival.draw(running, rng) for _ in range(20_000)])
    assert (draws > running).all() and (draws <= cap).all()
    assert draws.mean(axis=0) - running == pytest.approx(left, rel=0.03)
    unconditional = np.stack([survival.draw(np.zeros(1), rng) for _ in range(20_000)])
    assert unconditional.mean() == pytest.approx(survival.mean(), rel=0.03)
    # too few finished to fit: past the longest, every completion runs to the cap (the worked cases above)
    few = Survival(finished[: TAIL_MIN_FINISHED - 1], [longest + 100], cap)
    assert few.tail is None and few.mean_left(np.array([longest + 100.0]))[0] == cap - longest - 100
    assert (Survival([], [5], cap).draw(np.array([0.0, 5.0]), rng) == cap).all()


def test_a_runaway_completion_is_forecast_to_the_cap_not_to_an_end_now():
    """Answers of about 55 tokens, and one completion at 1,000 and counting (a repetition loop): the log-normal fitted
    to the answers gives that length a probability far below 1e-300, so the runaway share decides and it is expected
    to run to the cap; the shard does not say it is done."""
    rng = np.random.default_rng(2)
    cap = 4096
    finished = np.rint(np.exp(rng.normal(4.0, 0.15, 200))).astype(int)
    survival = Survival(finished, [1000], cap)
    assert survival.mean_left(np.array([1000.0]))[0] == pytest.approx(cap - 1000, rel=1e-6)
    assert (survival.draw(np.full(50, 1000.0), rng) == cap).all()
    now = [0.0]
    est = TimeLeft(201, cap, clock=lambda: now[0], min_span_s=1.0)
    est.finish(finished.tolist())
    for k in range(1, 4):
        now[0] = 5.0 * k
        e = est.estimate(int(finished.sum()) + 100 * k, [900 + 100 * k])
    assert e.tokens_left == cap - 1200 and e.seconds_left > 0


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
    of the full rate, so tokens left / the current rate forecasts too early an end, by 29-45 % on average over runs
    (seeds 0-7); running the rest on the step time fitted with the device's prior is off by -8 to +16 % (reports
    from 20 % of the work to the last 10 % of the time). bench/bench_time_left.py measures it at 32k tokens, and with
    a prior that is off."""
    rng = np.random.default_rng(11)
    ours, rate = [], []
    for _ in range(6):
        end, rows = _engine_run(rng, base_s=0.007, per_seq_s=0.0002, base_fraction=0.007 / (0.007 + 0.0002 * 64))
        for work, truth, forecast, naive in rows:
            if work >= 0.2 and truth > 0.1 * end:
                ours.append((forecast - truth) / truth)
                rate.append((naive - truth) / truth)
    assert abs(np.mean(ours)) < 0.2 and np.mean(np.abs(ours)) < 0.25, (np.mean(ours), np.mean(np.abs(ours)))
    assert np.mean(rate) < -0.25, np.mean(rate)


def test_a_finished_request_leaves_the_running_counts():
    """The engine's counts hold a finished request until its next report: each finished completion takes away the
    largest count at or below its length (its last report), the smallest where none is, and nothing else."""
    assert without_finished((30, 120, 118, 400), [119]) == (30, 120, 400)      # 118: the last report of the 119
    assert without_finished((30, 120, 118, 400), [500, 25]) == (118, 120)      # 400 for 500; none below 25: 30
    assert without_finished((5, 5, 7), [7, 7, 7, 7]) == ()
    assert without_finished((), [10]) == ()
    assert without_finished((30, 120, 400), [120]) == (30, 400)                # its last report was its length
    counts = tuple(range(0, 200, 7))
    assert sorted(without_finished(counts, [])) == list(counts)


def test_counts_older_than_a_finish_keep_the_last_length_estimate():
    """An engine reports its running counts every few seconds; a completion that finishes in between is longer
    than every (older) count when all run in step (vLLM without speculation): 250 running at 190 tokens, one
    finishes at 196. Taken as fresh, Kaplan-Meier would see the longest completion of the shard end there and
    forecast almost nothing left (a real MATH-500 shard: 65-80 % short); as counts from before that finish, the
    length estimate stays the last fresh one, applied to the completions running and queued now."""
    now = [0.0]

    def forecast(fresh: bool) -> tuple[int, int]:
        tl = TimeLeft(300, 512, clock=lambda: now[0], min_span_s=1, base_fraction=0.0)
        tl.finish(list(range(40, 190, 8)))
        now[0] = 0.0
        tl.estimate(1000, [190] * 250, 30)
        now[0] = 10.0
        before = tl.estimate(50_000, [190] * 250, 30).tokens_left
        tl.finish([196])
        now[0] = 11.0
        return before, tl.estimate(50_400, [190] * 249, 30, fresh=fresh).tokens_left

    before, after = forecast(fresh=False)
    assert 0.97 * before < after < before                   # one running completion fewer, the same lengths
    _, taken_as_fresh = forecast(fresh=True)
    assert taken_as_fresh < 0.2 * before                     # the failure the flag exists for


def test_a_cpu_engine_forecasts_tokens_left_over_the_recent_rate_not_a_step_model():
    """BASE_FRACTION's 0 for a CPU means no step model: seconds left are tokens left / the recent rate, even once
    the running set has drained (a step model fitted there added error on real CPU runs, docs/performance.md). A
    GPU's prior on the same reports runs the rest on the fitted step time instead, and forecasts otherwise."""
    def forecast(base_fraction: float) -> tuple[Estimate, float]:
        now, tokens, running = [0.0], [0], 64
        est = TimeLeft(64 + 40, 512, clock=lambda: now[0], min_span_s=10.0, base_fraction=base_fraction)
        for c in (64, 64, 64, 48, 32, 16):      # a full engine, then draining at a step of 0.02 + 0.002 c
            now[0] += 5.0
            tokens[0] += round(5.0 / (0.02 + 0.002 * c) * c)
            est.finish(range(100 + c, 100 + running, 1))            # the ones that left the running set
            running = c
            e = est.estimate(tokens[0], [150] * c, not_started=40)
        return e, tokens_left(est.finished, [150] * 16, 40, 512)

    cpu, left = forecast(BASE_FRACTION["cpu"])
    assert cpu.seconds_left is not None and cpu.tokens_left == round(left)
    assert cpu.seconds_left == pytest.approx(left / cpu.tokens_per_s, rel=1e-9)
    gpu, _ = forecast(BASE_FRACTION["cuda"])
    assert gpu.seconds_left != pytest.approx(left / gpu.tokens_per_s, rel=0.01)

"""The progress text the shards publish and `evaldag run` reads back, and the non-terminal display."""

from __future__ import annotations

import io

import polars as pl
import pytest
from rich.console import Console

from evaldag.pipeline import progress
from evaldag.pipeline.progress import progress_key
from evaldag.pipeline.progress import ShardProgress


def test_description_round_trips_and_other_text_is_ignored():
    text = progress.describe("math500", 3, ShardProgress(40, 125, 9120))
    assert progress.parse(text) == progress.Reported("math500", 3, ShardProgress(40, 125, 9120))
    full = progress.describe("math500", 3, ShardProgress(40, 125, 9120, 151.66, 30012, 197.6))
    assert full == "math500 shard 3: 40 of 125 problems, 9120 tokens generated; 151.7 tok/s; 30012 tokens, 198 s left"
    assert progress.parse(full) == progress.Reported("math500", 3, ShardProgress(40, 125, 9120, 151.7, 30012, 198.0))
    assert progress.parse("something else") is None and progress.parse(None) is None
    assert progress_key("MATH_500", 2) == "progress-math-500-shard-2"


def test_the_evaluations_forecast_is_its_slowest_shard_or_all_its_work_at_the_combined_rate():
    fast = ShardProgress(50, 100, 5000, 100.0, 5000, 50.0)
    slow = ShardProgress(20, 100, 2000, 50.0, 8000, 160.0)
    assert progress.forecast([fast, slow]) == (150.0, 160.0)
    # two more shards of 100 problems not reporting yet (queued for a slot): 200 x 100 tokens at 150 tok/s more
    rate, left = progress.forecast([fast, slow], problems=400)
    assert rate == 150.0 and left == pytest.approx((5000 + 8000 + 200 * 100) / 150)
    assert progress.forecast([ShardProgress(0, 100, 0)]) == (None, None)   # nothing known yet
    done = ShardProgress(100, 100, 9000, None, 0, 0.0)
    assert progress.forecast([done, slow]) == (50.0, 160.0)         # a finished shard adds no rate
    assert progress.forecast([done]) == (None, 0.0)
    assert progress.duration(44.6) == "45 s" and progress.duration(700) == "12 min"
    assert progress.duration(3900) == "1 h 05 min"


def test_off_a_terminal_a_line_a_minute_with_rate_and_time_left():
    out, now = io.StringIO(), [0.0]
    console = Console(file=out, force_terminal=False, width=200)
    with progress.Display(console, "eval/math500", every_s=60, clock=lambda: now[0]) as display:
        for t in range(0, 200, 5):          # `evaldag run` polls every second; every 5 s here
            now[0] = float(t)
            display.update("Running", progress.Snapshot(done=t, total=500, tokens=100 * t, shards=1, running=1,
                                                        tokens_per_s=100.0, seconds_left=500.0 - t))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines           # at 60, 120 and 180 s
    assert lines[0] == ("eval/math500: 60/500 problems, 6000 tokens, 100 tok/s, about 7 min left; "
                        "shards 1 running, 0/1 done; 60 s")


def test_not_on_a_terminal_one_line_per_completed_shard():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with progress.Display(console, "eval/math500") as display:
        display.update("Running", progress.Snapshot(done=5, total=10, shards=2, running=2))
        display.update("Running", progress.Snapshot(done=8, total=10, shards=2, running=1, completed=1,
                                                    completed_names=["shard-a"]))
        display.update("Completed", progress.Snapshot(done=10, total=10, shards=2, completed=2,
                                                      completed_names=["shard-a", "shard-b"]))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "shard shard-a done" in lines[0] and "1/2 done" in lines[0] and "8/10 problems" in lines[0]
    assert "shard shard-b done" in lines[1] and "10/10 problems" in lines[1]


def test_on_a_terminal_a_progress_bar_with_rate_and_shards():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    with progress.Display(console, "eval/math500") as display:
        display.update("Running", progress.Snapshot(done=0, total=10, tokens=0, shards=2, running=2))
        display.update("Running", progress.Snapshot(done=4, total=10, tokens=400, shards=2, running=1, completed=1,
                                                    retried=1, tokens_per_s=200.0, seconds_left=130.0))
    text = out.getvalue()
    assert "4/10" in text and "200 tok/s" in text and "about 2 min left" in text
    assert "1/2 done" in text and "1 retried" in text


class _Run:
    id, name = "0b1c", "sassy-fox"


def test_ctrl_c_off_a_terminal_leaves_the_run_and_says_how_to_cancel(monkeypatch):
    from evaldag.runtime import runner

    monkeypatch.setattr(runner, "cancel_flow_run", lambda _id: pytest.fail("cancelled without asking"))
    out = io.StringIO()
    runner._interrupted(Console(file=out, width=200), _Run(), "http://ui/run", ask=False)
    assert "left sassy-fox running" in out.getvalue() and "prefect flow-run cancel 0b1c" in out.getvalue()


@pytest.mark.parametrize("answer, cancels", [("cancel", True), ("leave", False)])
def test_ctrl_c_on_a_terminal_does_what_the_answer_says(monkeypatch, answer, cancels):
    from rich.prompt import Prompt

    from evaldag.runtime import runner

    asked, cancelled = [], []
    monkeypatch.setattr(Prompt, "ask", classmethod(lambda cls, q, **kw: asked.append(q) or answer))
    monkeypatch.setattr(runner, "cancel_flow_run", lambda _id: cancelled.append(_id) or 3)
    out = io.StringIO()
    runner._interrupted(Console(file=out, width=200), _Run(), "http://ui/run", ask=True)
    assert asked and "cancel" in asked[0]
    assert cancelled == (["0b1c"] if cancels else [])
    assert ("cancelling sassy-fox and 2 shard" in out.getvalue()) == cancels


def test_the_evaluations_progress_text_sums_the_shards_and_is_never_read_as_a_shard():
    snap = progress.Snapshot(done=7, total=9, tokens=1234, shards=3, running=1, completed=2, retried=1)
    text = progress.describe_evaluation(["math500", "aime24"], 7, 530, snap)
    assert text == ("evaluation of math500 + aime24: 7 of 530 problems, 1234 tokens generated; "
                    "shards 1 running, 2/3 done, 1 retried")
    snap.tokens_per_s, snap.seconds_left = 151.6, 1250.0
    assert progress.describe_evaluation(["math500"], 7, 500, snap) == (
        "evaluation of math500: 7 of 500 problems, 1234 tokens generated; 152 tok/s, about 21 min left; "
        "shards 1 running, 2/3 done, 1 retried")
    assert progress.parse(text) is None


def test_a_plan_with_several_samples_a_problem_counts_samples():
    """With n > 1 samples a problem (split over shards or not), a shard's count is of samples, which finish one
    request of a few at a time (evaldag.request.sharding.sample_pieces), and every text says so: the shard's, the
    snapshot that sums them, `evaldag run`'s line. Artifacts of earlier versions, which counted "requests", still
    parse."""
    text = progress.describe("aime24", 1, ShardProgress(3, 120, 800, unit="samples"))
    assert text == "aime24 shard 1: 3 of 120 samples, 800 tokens generated"
    assert progress.parse(text) == progress.Reported("aime24", 1, ShardProgress(3, 120, 800, unit="samples"))
    assert progress.parse(progress.describe("aime24", 1, ShardProgress(3, 30, 800))).progress.unit == "problems"
    assert progress.parse("aime24 shard 1: 3 of 30 requests, 800 tokens generated").progress.done == 3
    snap = progress.Snapshot(done=3, total=120, tokens=800, shards=8, running=8, unit="samples")
    assert "3 of 960 samples" in progress.describe_evaluation(["aime24"], 3, 960, snap, "samples")
    out, now = io.StringIO(), [0.0]
    with progress.Display(Console(file=out, force_terminal=False, width=200), "eval/aime24", every_s=60,
                          clock=lambda: now[0]) as display:
        now[0] = 60.0
        display.update("Running", snap)
    assert out.getvalue().startswith("eval/aime24: 3/120 samples, 800 tokens")


def test_the_plan_says_what_its_progress_counts():
    """Problems where each has one sample, else samples, over every shard: AIME24's 30 problems x 32 samples split
    over 8 shards are 960 samples; at n = 1, 30 problems."""
    from evaldag.request.config import SamplingConfig
    from evaldag.request.plan import EvalPlan
    from evaldag.request.sharding import plan_split_shards

    def plan(n, shards, runs):
        fields = {"sampling": SamplingConfig(n=n, temperature=1.0 if n > 1 else 0.0), "sample_runs": runs,
                  "shards": shards, "num_shards": len(shards)}
        fake = type("Plan", (), fields)()
        fake.shard_runs = lambda s: EvalPlan.shard_runs(fake, s)
        return fake

    ids = pl.DataFrame({"sample_id": [f"p{k}" for k in range(30)], "prompt": ["x" * k for k in range(30)]})
    shards, runs = plan_split_shards(ids, 8, 32)
    split = plan(32, shards, runs)
    assert EvalPlan.progress_unit.fget(split) == "samples" and EvalPlan.progress_total.fget(split) == 960
    whole = plan(32, [ids["sample_id"].to_list()], None)
    assert EvalPlan.progress_unit.fget(whole) == "samples" and EvalPlan.progress_total.fget(whole) == 960
    one = plan(1, [ids["sample_id"].to_list()], None)
    assert EvalPlan.progress_unit.fget(one) == "problems" and EvalPlan.progress_total.fget(one) == 30


def test_each_round_of_an_adaptive_evaluation_is_counted_on_its_own():
    """The parent's progress of an adaptive evaluation's second round counts that round's shard runs and reports
    only (tagged and labelled by round), whatever the clocks say; `evaldag run` (no round) sums both rounds."""
    import uuid
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    done = SimpleNamespace(is_running=lambda: False, is_completed=lambda: True, is_failed=lambda: False,
                           is_crashed=lambda: False, name="Completed")
    running = SimpleNamespace(is_running=lambda: True, is_completed=lambda: False, is_failed=lambda: False,
                              is_crashed=lambda: False, name="Running")
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def run(rid, state, tags):
        return SimpleNamespace(id=rid, state=state, tags=tags, run_count=1, name=rid)

    def report(rid, label, shard, p, minute):
        return SimpleNamespace(flow_run_id=rid, description=progress.describe(label, shard, p),
                               updated=t0 + timedelta(minutes=minute), created=t0)

    a, b, c, parent = (uuid.uuid4() for _ in range(4))
    runs = [run(a, done, []), run(b, done, []), run(c, running, [f"{progress.ROUND_TAG}2"])]
    reports = [report(a, "gsm8k", 0, ShardProgress(6, 6, 300, unit="requests"), 1),
               report(b, "gsm8k", 1, ShardProgress(6, 6, 310, unit="requests"), 1),
               report(c, progress.round_label("gsm8k", 2), 0, ShardProgress(2, 5, 40, unit="requests"), 3)]

    class Client:
        def read_flow_runs(self, flow_run_filter):
            return runs

        def read_artifacts(self, artifact_filter):
            ids = set(artifact_filter.flow_run_id.any_)
            return [r for r in reports if r.flow_run_id in ids]

    second = progress.snapshot(Client(), parent, round=2)
    assert (second.done, second.total, second.shards, second.running) == (2, 5, 1, 1)
    first = progress.snapshot(Client(), parent, round=1)
    assert (first.done, first.total, first.shards, first.completed) == (12, 12, 2, 2)
    both = progress.snapshot(Client(), parent)
    assert (both.done, both.total, both.shards) == (14, 17, 3)
    assert progress.label_round("gsm8k/round-2") == 2 and progress.label_round("gsm8k") == 1
    assert progress.run_round(["x", f"{progress.ROUND_TAG}2"]) == 2 and progress.run_round([]) == 1

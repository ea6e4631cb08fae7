"""The progress text the shards publish and `evaldag run` reads back, and the non-terminal display."""

from __future__ import annotations

import io

import pytest

from rich.console import Console

from evaldag import progress
from evaldag.progress import progress_key


def test_description_round_trips_and_other_text_is_ignored():
    text = progress.describe("math500", 3, 40, 125, 9120)
    assert progress.parse(text) == ("math500", 3, 40, 125, 9120)
    assert progress.parse("something else") is None and progress.parse(None) is None
    assert progress_key("MATH_500", 2) == "progress-math-500-shard-2"


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
        display._first_tokens = (display._first_tokens[0] - 2.0, 0)       # as if 2 s went by
        display.update("Running", progress.Snapshot(done=4, total=10, tokens=400, shards=2, running=1, completed=1,
                                                    retried=1))
    text = out.getvalue()
    assert "4/10" in text and "tok/s" in text and "1/2 done" in text and "1 retried" in text


class _Run:
    id, name = "0b1c", "sassy-fox"


def test_ctrl_c_off_a_terminal_leaves_the_run_and_says_how_to_cancel(monkeypatch):
    from evaldag import runner

    monkeypatch.setattr(runner, "cancel_flow_run", lambda _id: pytest.fail("cancelled without asking"))
    out = io.StringIO()
    runner._interrupted(Console(file=out, width=200), _Run(), "http://ui/run", ask=False)
    assert "left sassy-fox running" in out.getvalue() and "prefect flow-run cancel 0b1c" in out.getvalue()


@pytest.mark.parametrize("answer, cancels", [("cancel", True), ("leave", False)])
def test_ctrl_c_on_a_terminal_does_what_the_answer_says(monkeypatch, answer, cancels):
    from rich.prompt import Prompt

    from evaldag import runner

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
    assert progress.parse(text) is None

"""The parts of `evaldag select` that need no stack: which checkpoints, the prefix a selection asks of a
checkpoint's shards, and the result in words, markdown and a rich table (the whole path: test_select_e2e.py)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from evaldag.cli.selection import render
from evaldag.decisions.decide import stop_path, stopped_problems, ungated_path
from evaldag.decisions.select_rows import ask_prefix
from evaldag.errors import ConfigError
from evaldag.storage import store
from evaldag.tracking.selection import choose_checkpoints, describe, markdown, parse_steps, table


def test_steps_ranges():
    assert parse_steps(None) == (None, None)
    assert parse_steps("100:500") == (100, 500) and parse_steps(":500") == (None, 500)
    assert parse_steps("100:") == (100, None)
    for bad in ("500", "500:100", "a:b"):
        with pytest.raises(ConfigError, match="give a range A:B"):
            parse_steps(bad)


def test_checkpoints_given_by_folder_take_their_step_from_the_name(tmp_path):
    paths = [str(tmp_path / f"checkpoint-{s}") for s in (300, 100, 200)]
    assert choose_checkpoints("job", paths, None) == {100: paths[1], 200: paths[2], 300: paths[0]}
    assert choose_checkpoints("job", paths, "150:") == {200: paths[2], 300: paths[0]}
    with pytest.raises(ConfigError, match="no training step in its folder name"):
        choose_checkpoints("job", [str(tmp_path / "best")], None)
    with pytest.raises(ConfigError, match="needs two or more"):
        choose_checkpoints("job", paths, "250:")


def test_the_prefix_asked_never_shrinks(tmp_path):
    plan = SimpleNamespace(request=SimpleNamespace(decide="select"),
                           path=lambda name: store.as_path(tmp_path) / name)
    assert ask_prefix(plan, 20) == 20 and stopped_problems(plan) == 20 and ungated_path(plan).is_file()
    assert ask_prefix(plan, 40) == 40
    # a concurrent selection of the same checkpoint asking less does not cut short what the other asked for
    assert ask_prefix(plan, 10) == 40 and stopped_problems(plan) == 40
    assert stop_path(plan).is_file()


def _summary(**over) -> dict:
    rows = [{"step": 1, "in_set": False, "problems": 20, "mean": 0.1, "dropped_round": 1, "dropped_at": 20,
             "vs": "job@2", "diff": -0.5, "ci_low": -0.8, "ci_high": -0.2, "checkpoint": "/c/checkpoint-1"},
            {"step": 2, "in_set": True, "problems": 20, "mean": 0.6, "dropped_round": None, "dropped_at": None,
             "vs": None, "diff": None, "ci_low": None, "ci_high": None, "checkpoint": "/c/checkpoint-2"}]
    return {"train_run": "job", "benchmark": "arith", "status": "best", "best_step": 2, "set": [2], "alpha": 0.05,
            "margin": 0.02, "look": 20, "n_problems": 40, "checkpoints": rows,
            "tokens": {"generated": 400, "reused": 0, "full_est": 1600}, "tokens_ratio": 0.25, **over}


def test_the_result_in_words_markdown_and_a_table():
    s = _summary()
    assert describe(s) == ("job on arith: best: step 2 is best; alpha 0.05, margin 0.02, 20 of 40 problems read; "
                           "400 tokens generated (0.25 of the 1600 of all in full)")
    md = markdown(s)
    assert "| 1 | no | 20 | 0.100 | 1 (20) | job@2 | -50.0 [-80.0, -20.0] |" in md
    assert "| 2 | yes | 20 | 0.600 | - | - | - [-, -] |" in md
    assert table(s)["step"] == [1, 2] and table(s)["dropped_round"] == [1, None]
    out = io.StringIO()
    Console(file=out, width=200).print(render(s))
    assert "round 1 (20)" in out.getvalue() and "-50.0 [-80.0, -20.0]" in out.getvalue()
    undecided = describe(_summary(status="undecided", best_step=None, set=[2, 3]))
    assert "the best is one of steps 2, 3" in undecided


def test_a_settled_set_says_why_it_is_undecided_and_where_each_member_stopped():
    rows = _summary()["checkpoints"]
    rows[0] |= {"in_set": True, "dropped_round": None, "dropped_at": None, "settled_at": 150}
    rows[1] |= {"settled_at": 150}
    reason = "2 checkpoints cannot be told apart on this benchmark at alpha 0.05 and margin 0.02 (settled)"
    s = _summary(status="undecided", best_step=None, set=[1, 2], settled=[1, 2], reason=reason, checkpoints=rows)
    assert reason in describe(s) and "the best is one of steps 1, 2" in describe(s)
    assert "| 1 | yes | 20 | 0.100 | settled after 150 |" in markdown(s)
    out = io.StringIO()
    Console(file=out, width=200).print(render(s))
    assert "settled after 150" in out.getvalue()

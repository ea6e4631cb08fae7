"""`evaldag run --seed`, `--eval-loss` and `--benchmarks a,b`: what the command line hands to the deployment it runs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from evaldag.cli import app


@pytest.fixture
def sent(monkeypatch):
    from evaldag.runtime import runner
    from evaldag.runtime import stack as stack_module

    calls = []
    monkeypatch.setattr(stack_module, "Stack", lambda *a, **k: None)
    monkeypatch.setattr(runner, "run_and_report", lambda stack, benchmark, params: calls.append((benchmark, params)))
    return calls


def _run(*args: str):
    return CliRunner().invoke(app, ["run", *args], env={"COLUMNS": "200"})


def test_seed_is_the_sampling_seed(sent):
    result = _run("gsm8k", "--seed", "7", "--limit", "4")
    assert result.exit_code == 0, result.output
    assert sent == [("gsm8k", {"limit": 4, "sampling": {"seed": 7}})]
    assert _run("gsm8k", "--seed", "3", "--temperature", "0.6").exit_code == 0
    assert sent[-1][1]["sampling"] == {"temperature": 0.6, "seed": 3}
    assert _run("gsm8k", "--seed", "-1").exit_code == 2 and len(sent) == 2


def test_eval_loss_is_passed_only_when_given(sent):
    assert _run("math500", "--eval-loss", "--limit", "3").exit_code == 0
    assert _run("gsm8k", "--no-eval-loss").exit_code == 0
    assert _run("gsm8k").exit_code == 0
    assert sent == [("math500", {"limit": 3, "eval_loss": True}), ("gsm8k", {"eval_loss": False}), ("gsm8k", {})]


def test_several_benchmarks_run_as_one_suite(sent):
    result = _run("--benchmarks", "math500, aime24,math500", "--checkpoint", "/ckpts/run/checkpoint-5")
    assert result.exit_code == 0, result.output
    assert sent == [("suite", {"checkpoint": "/ckpts/run/checkpoint-5", "benchmarks": ["math500", "aime24"]})]
    assert _run("--benchmarks", "gsm8k").exit_code == 0 and sent[-1] == ("gsm8k", {})   # one: its own deployment


@pytest.mark.parametrize("args, message", [
    (("aime24", "--benchmarks", "math500,gsm8k"), "give BENCHMARK (aime24) or --benchmarks, not both"),
    (("--benchmarks", "math500,nosuch"), "no benchmark config for nosuch"),
    (("--benchmarks", "Math 500"), "benchmarks must be a non-empty list"),
    (("--benchmarks", ","), "benchmarks must be a non-empty list"),
])
def test_bad_benchmark_lists_are_refused_by_name(sent, args, message):
    result = _run(*args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert sent == []


def test_the_report_covers_every_benchmark_of_the_suite(monkeypatch):
    """run_and_report prints one result per benchmark the suite's flow run evaluated (its parameters)."""
    from types import SimpleNamespace

    from evaldag.runtime import runner

    printed = []
    fr = SimpleNamespace(id="fr-1", parameters={"benchmarks": ["math500", "aime24"]})
    monkeypatch.setattr(runner, "_print_result", lambda console, b, *a: printed.append(b))
    monkeypatch.setattr(runner, "_flow_summary", lambda fr, b: None)
    runner._report_each(None, fr, "suite", 1.0, None)
    assert printed == ["math500", "aime24"]
    runner._report_each(None, SimpleNamespace(id="fr-2", parameters={"benchmark": "gsm8k"}), "gsm8k", 1.0, None)
    assert printed[2:] == ["gsm8k"]

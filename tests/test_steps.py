"""Step validity (evaldag.scoring.steps): the hand-written case table, the GSM8K truth set, the hard timeout, the
graded table's columns, older graded files, the reduce's figures and the reward component."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import polars as pl
import pytest

from evaldag.scoring.grading import grade_table
from evaldag.scoring.metrics import step_metrics
from evaldag.scoring.rewards import RewardSpec
from evaldag.scoring.grading import check_many
from evaldag.scoring.steps import check_step, count_steps, find_steps
from evaldag.storage.schema import GENERATION_SCHEMA, GRADED_SCHEMA, read_table, write_table

ROOT = Path(__file__).resolve().parents[1]
CASES = json.loads((ROOT / "tests" / "cases" / "step_cases.json").read_text())["cases"]
GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

_spec = importlib.util.spec_from_file_location("bench_steps", ROOT / "bench" / "bench_steps.py")
bench_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_steps)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_hand_written_cases(case: dict) -> None:
    assert count_steps(case["completion"]) == (case["checked"], case["valid"]), (case["why"],
                                                                                 find_steps(case["completion"]))


@pytest.mark.parametrize(("lhs", "rhs", "valid"), [
    ("48/2", "24", True), ("48/2", "25", False), ("2^(10)", "1024", True), ("√(2)*√(8)", "4", True),
    ("10/3", "3.33", True), ("10/3", "3.3", True), ("10/3", "3.4", False), ("100/3", "33", False),
    ("50%*40", "20", True), ("9/27*100%", "33.33%", True), ("05*2", "10", True),
    # irrational sides: equal within 1e-12 of their size, or within the rounding a bare decimal states
    ("2π", "π*2", True), ("√(2)", "1.414213562373", True), ("22/7", "π", False), ("π", "3.14159265358", False),
    ("√(2)*10^6", "1414213.5623731", True), ("√(2)*10^6", "1414213.56238", False),
    # beyond the float range an exact (rational) step is still checked
    ("10^400+1", "10^400", False), ("2*10^400", "10^400+10^400", True),
])
def test_check_step(lhs: str, rhs: str, valid: bool) -> None:
    assert check_step(lhs, rhs) is valid


@pytest.mark.parametrize(("lhs", "rhs"), [("(π*10^300)^2", "5"), ("10^400*√(2)", "7"), ("5", "-(π*10^300)^2")])
def test_an_irrational_step_beyond_the_float_range_is_not_checkable(lhs: str, rhs: str) -> None:
    """Its size as a float is inf, and so was the tolerance (1e-12 of it): every such step counted as valid."""
    assert check_step(lhs, rhs) is None
    assert count_steps(f"Then {lhs} = {rhs} and 3*4 = 12.") == (1, 1)        # only 3*4 = 12 is checked


@pytest.mark.parametrize("side", ["__import__('os').system('true')", "(1).__class__", "[1][0]", "9**9**9**9",
                                  "1/0", "lambda: 1"])
def test_no_code_runs_and_what_is_no_arithmetic_is_not_checkable(side: str) -> None:
    assert check_step(side, "1") is None


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason="GSM8K mirror not beside the project (../shared/data)")
def test_gsm8k_annotations_truth_set() -> None:
    """Annotations are valid by construction; a corrupted third must be found invalid, the rest not."""
    rows = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines()[:400]]
    truth_set = bench_steps.gsm8k_truth([r["answer"] for r in rows], share=0.3, seed=1)
    score = bench_steps.score_truth(truth_set)
    assert score["invalid"] > 250 and score["annotations"] > 1000
    assert score["recall"] >= 0.99, score
    assert score["precision"] >= 0.99, score
    untouched = [count_steps(r["answer"]) for r in rows]
    checked, valid = sum(c for c, _ in untouched), sum(v for _, v in untouched)
    assert checked >= 0.95 * score["annotations"] and valid >= 0.995 * checked


def test_corruption_changes_the_value() -> None:
    import random

    rng = random.Random(0)
    for result in ("24", "0.2", "1000", "7", "3.75"):
        for _ in range(20):
            wrong = bench_steps.corrupt_result(result, rng)
            assert wrong is not None and check_step(result, wrong) is False


def test_check_many_bounds_each_item_with_the_grading_timeout() -> None:
    slow = "\n".join(f"{i} * 987654321 = {i * 987654321}" for i in range(1, 40_000))   # tens of seconds
    out = check_many(["12 * 4 = 48, 5 + 5 = 11", slow, "2^3 = 8"], timeout_s=1.0, workers=2)
    assert out == [(2, 1), (None, None), (1, 1)]


def _generations() -> pl.DataFrame:
    rows = [{"sample_id": "a", "completion": "12 * 4 = 48, so \\boxed{48}", "gold": "48"},
            {"sample_id": "b", "completion": "12 * 4 = 46, so \\boxed{48}", "gold": "48"},
            {"sample_id": "c", "completion": "12 * 4 = 46 and 46 + 1 = 47, so \\boxed{47}", "gold": "48"},
            {"sample_id": "d", "completion": "It is \\boxed{48}", "gold": "48"}]
    base = {"prompt": "p", "gold_raw": "48", "subject": None, "level": None, "sample_index": 0, "shard_index": 0,
            "completion_ids": [1], "prompt_tokens": 3, "completion_tokens": 5, "finish_reason": "stop",
            "latency_s": 0.1, "batch_size": 1}
    return pl.DataFrame([{**base, **r} for r in rows], schema=GENERATION_SCHEMA)


def test_graded_rows_carry_their_steps_and_the_reduce_its_figures() -> None:
    graded = grade_table(_generations(), timeout_s=10.0, workers=0)
    assert graded["steps_checked"].to_list() == [1, 1, 2, 0]
    assert graded["steps_valid"].to_list() == [1, 0, 1, 0]
    m = step_metrics(graded)
    assert m["step_checkable_rate"] == pytest.approx(3 / 4)
    assert m["step_validity"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert m["step_validity/right_answer"] == pytest.approx(0.5)      # a: 1, b: 0
    assert m["step_validity/wrong_answer"] == pytest.approx(0.5)      # c: 1 of 2
    assert m["right_answer_invalid_steps_rate"] == pytest.approx(0.5)  # b: right answer through a wrong step
    reward = graded.select(RewardSpec(name="step_validity", params={"no_steps": 0.25}).expr())[:, 0].to_list()
    assert reward == [1.0, 0.0, 0.5, 0.25]


def test_no_step_figures_without_checked_rows() -> None:
    graded = grade_table(_generations(), timeout_s=10.0, workers=0).with_columns(
        pl.lit(None, dtype=pl.Int64).alias("steps_checked"), pl.lit(None, dtype=pl.Int64).alias("steps_valid"))
    assert step_metrics(graded) == {}
    assert step_metrics(graded.drop("steps_checked", "steps_valid")) == {}


def test_a_graded_file_from_before_steps_reads_with_null_steps(tmp_path: Path) -> None:
    graded = grade_table(_generations(), timeout_s=10.0, workers=0)
    older = {k: v for k, v in GRADED_SCHEMA.items() if k not in ("steps_checked", "steps_valid")}
    write_table(graded, tmp_path / "graded.parquet", older)
    back = read_table(tmp_path / "graded.parquet", GRADED_SCHEMA)
    assert back["steps_checked"].null_count() == back.height
    assert read_table(tmp_path / "graded.parquet", GRADED_SCHEMA, columns=["sample_id", "steps_valid"]).height == 4

"""Tests for evaldag.scoring.grading: gold normalisation, the case table, hard timeouts, order, and the table schema.

The expected statuses in tests/cases/grading_cases.json were checked by running math-verify 0.9 and by reading each
case; cases where math-verify disagrees with a human are kept apart ("known_misgrades") and run as strict xfails, so
a math-verify upgrade that fixes one is noticed (and GRADER_VERSION gets bumped).
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path

import polars as pl
import pytest

from evaldag.scoring.grading import (
    GRADER_VERSION,
    Grade,
    grade_many,
    grade_one,
    grade_table,
)
from evaldag.scoring.gold import normalize_gold
from evaldag.storage.schema import GENERATION_SCHEMA, GRADE_STATUSES, GRADED_SCHEMA

CASES_FILE = Path(__file__).parent / "cases" / "grading_cases.json"
CASES = json.loads(CASES_FILE.read_text())

# Python computes 9^387420489 in one C call that runs for minutes and ignores signals: only killing the worker
# process stops it. This is the kind of input the hard per-item timeout exists for.
HANGING_COMPLETION = r"The answer is $\boxed{9^{9^{9}}}$."


def _item(case: dict) -> tuple[str, str, str]:
    return case["completion"], normalize_gold(case["gold_raw"], case["format"]), case["finish_reason"]


@lru_cache(maxsize=None)
def _graded(table: str) -> dict[str, Grade]:
    """Grade one table of cases through a single pool (one start-up for all parametrized tests)."""
    cases = CASES[table]
    return dict(zip([c["id"] for c in cases], grade_many([_item(c) for c in cases], timeout_s=10.0, workers=2)))


# --------------------------------------------------------------------------------------------------------------
# The case table
# --------------------------------------------------------------------------------------------------------------

def test_case_table_is_well_formed() -> None:
    ids = [c["id"] for table in ("cases", "known_misgrades") for c in CASES[table]]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    formats = {c["format"] for c in CASES["cases"]}
    assert formats == {"latex", "integer", "gsm8k", "number"}, "every benchmark format needs cases"
    statuses = {c["expected_status"] for c in CASES["cases"]}
    assert statuses == set(GRADE_STATUSES) - {"timeout"}, "every non-timeout status needs cases"
    for c in CASES["cases"] + CASES["known_misgrades"]:
        assert c["expected_status"] in GRADE_STATUSES and c["finish_reason"] in ("stop", "length") and c["why"]


@pytest.mark.parametrize("case", CASES["cases"], ids=[c["id"] for c in CASES["cases"]])
def test_case(case: dict) -> None:
    grade = _graded("cases")[case["id"]]
    assert grade.status == case["expected_status"], f"{case['why']}: got {grade}"
    assert grade.correct == (case["expected_status"] == "correct")
    assert grade.seconds >= 0
    if case["expected_status"] in ("correct", "wrong"):
        assert grade.pred, "a graded answer must show what was extracted"
    if case["expected_status"] == "unparseable":
        assert grade.pred is None


@pytest.mark.parametrize("case", CASES["known_misgrades"], ids=[c["id"] for c in CASES["known_misgrades"]])
def test_known_misgrade(case: dict) -> None:
    grade = _graded("known_misgrades")[case["id"]]
    # Documents what math-verify does today; if this fails, math-verify changed: update the table and GRADER_VERSION.
    assert grade.status == case["math_verify_status"]
    if grade.status != case["expected_status"]:
        pytest.xfail(f"known math-verify misgrade: {case['why']}")
    pytest.fail(f"math-verify now grades {case['id']} as a human would: move it to 'cases' and bump GRADER_VERSION")


def test_truncated_keeps_pred_and_is_not_wrong() -> None:
    grade = grade_one(r"so far $\boxed{25}$ and then", "25", finish_reason="length")
    assert (grade.status, grade.correct, grade.pred) == ("truncated", False, "25")


def test_inline_matches_pool() -> None:
    items = [_item(c) for c in CASES["cases"][:12]]
    assert [g.status for g in grade_many(items, workers=0)] == [g.status for g in grade_many(items, workers=2)]


# --------------------------------------------------------------------------------------------------------------
# normalize_gold
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "fmt", "expected"), [
    (r"  \frac{14}{3} ", "latex", r"\frac{14}{3}"),
    (r"\text{(C)}", "latex", r"\text{(C)}"),
    (r"\$18.90", "latex", r"\$18.90"),
    (r"(3, \frac{\pi}{2})", "latex", r"(3, \frac{\pi}{2})"),
    ("025", "integer", "25"),
    ("000", "integer", "0"),
    (" 204\n", "integer", "204"),
    (7, "integer", "7"),
    (25.0, "integer", "25"),
    ("He paid 3 * 400 = <<3*400=1200>>1200 dollars.\n#### 1,234", "gsm8k", "1234"),
    ("first #### 5\nthen #### 6", "gsm8k", "6"),
    ("so she lost 5.\n#### -5", "gsm8k", "-5"),
    ("#### 2.5", "gsm8k", "2.5"),
    ("#### 1 000 000", "gsm8k", "1000000"),
    (27.0, "number", "27"),
    (0.5, "number", "0.5"),
    ("3", "number", "3"),
    (12, "number", "12"),
    ("0.50", "number", "0.5"),
    (1e20, "number", "100000000000000000000"),
])
def test_normalize_gold(raw: object, fmt: str, expected: str) -> None:
    assert normalize_gold(raw, fmt) == expected


@pytest.mark.parametrize(("raw", "fmt", "message"), [
    (None, "latex", "a non-empty value"),
    ("   ", "latex", "a non-empty LaTeX string"),
    ("2.5", "integer", "an integer or a string of digits"),
    ("twelve", "integer", "an integer or a string of digits"),
    (True, "integer", "a non-empty value"),
    ("She has 12 apples.", "gsm8k", "ending in '#### <number>'"),
    ("#### ", "gsm8k", "a number after the last '####'"),
    ("#### twelve", "gsm8k", "a number after the last '####', found 'twelve'"),
    ("", "number", "a number such as 27.0"),
    ("1/2", "number", "a number such as 27.0"),
    (float("nan"), "number", "a finite number"),
    ("5", "decimal", "unknown gold format 'decimal'"),
])
def test_normalize_gold_errors_name_value_format_and_expectation(raw: object, fmt: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        normalize_gold(raw, fmt)  # type: ignore[arg-type]
    text = str(info.value)
    assert message in text
    assert repr(raw) in text and repr(fmt) in text


# --------------------------------------------------------------------------------------------------------------
# grade_many: timeouts, order, errors
# --------------------------------------------------------------------------------------------------------------

def test_hard_timeout_kills_only_the_hanging_item() -> None:
    items = [
        (r"$\boxed{25}$", "25", "stop"),
        (HANGING_COMPLETION, "25", "stop"),
        (r"$\boxed{7}$", "25", "stop"),
        (r"$\boxed{\frac{1}{2}}$", "0.5", "stop"),
    ]
    t0 = time.perf_counter()
    grades = grade_many(items, timeout_s=1.0, workers=2)
    elapsed = time.perf_counter() - t0
    assert grades[1] == Grade(pred=None, status="timeout", correct=False, seconds=1.0)
    assert [g.status for g in grades] == ["correct", "timeout", "wrong", "correct"]
    assert elapsed < 20, f"the hanging item was not killed at its timeout ({elapsed:.1f} s)"


def test_inline_timeout_in_main_thread() -> None:
    # Expanding two 300th powers is slow pure-Python sympy work (~0.5 s), which the inline SIGALRM timer interrupts.
    slow = (r"$\boxed{(x+1)^{300} - (x-1)^{300}}$", "5", "stop")
    grades = grade_many([slow, (r"$\boxed{5}$", "5", "stop")], timeout_s=0.05, workers=0)
    assert [g.status for g in grades] == ["timeout", "correct"]


def test_inline_timeout_in_a_fresh_process_leaves_math_verify_whole() -> None:
    """The first inline item of a process: math-verify is imported before the timer is armed. An alarm inside the
    import used to leave it half imported, and the next item failed as if its gold could not be parsed."""
    import subprocess
    import sys

    script = (
        "import signal\n"
        "from evaldag.scoring.grading import grade_many\n"
        "import time\n"
        "signal.setitimer(signal.ITIMER_REAL, 600)\n"                     # a caller's own timer runs on after,
        "t0 = time.monotonic()\n"                                         # less the time grading took
        "slow = (r'$\\boxed{(x+1)^{300} - (x-1)^{300}}$', '5', 'stop')\n"
        "grades = grade_many([slow, (r'$\\boxed{5}$', '5', 'stop')], timeout_s=0.05, workers=0)\n"
        "left, took = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic() - t0\n"
        "print([g.status for g in grades], 500 < left <= 600 - took + 0.01)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "['timeout', 'correct'] True", out.stdout + out.stderr


def test_order_is_preserved() -> None:
    items = [(rf"The answer is $\boxed{{{i}}}$.", str(i if i % 3 else i + 1), "stop") for i in range(40)]
    grades = grade_many(items, workers=2)
    assert [g.pred for g in grades] == [str(i) for i in range(40)]
    assert [g.status for g in grades] == ["correct" if i % 3 else "wrong" for i in range(40)]


def test_empty_batch() -> None:
    assert grade_many([], workers=2) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_unparseable_gold_is_a_data_error(workers: int) -> None:
    items = [(r"$\boxed{1}$", "1", "stop"), (r"$\boxed{1}$", r"\text{}", "stop")]
    with pytest.raises(ValueError, match=r"item 1 \(gold '\\\\text\{\}'\).*cannot parse gold"):
        grade_many(items, workers=workers)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        grade_many([("1", "1", "stop")], timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        grade_many([("1", "1", "stop")], workers=-1)


def test_grader_version_is_set() -> None:
    assert GRADER_VERSION.startswith("math-verify-0.9/")


# --------------------------------------------------------------------------------------------------------------
# grade_table
# --------------------------------------------------------------------------------------------------------------

def test_grade_table_conforms_to_graded_schema() -> None:
    rows = [("a", r"$\boxed{25}$", "25", "stop"), ("b", "no idea", "25", "stop"), ("c", r"$\boxed{3}$", "25", "length")]
    df = pl.DataFrame({
        "sample_id": [r[0] for r in rows], "prompt": ["p"] * 3, "gold": [r[2] for r in rows],
        "gold_raw": ["025"] * 3, "subject": [None] * 3, "level": [None] * 3, "sample_index": [0] * 3,
        "shard_index": [0] * 3, "completion": [r[1] for r in rows], "prompt_tokens": [10] * 3,
        "completion_tokens": [20] * 3, "finish_reason": [r[3] for r in rows], "latency_s": [0.1] * 3,
        "batch_size": [3] * 3, "completion_ids": [[1, 2]] * 3,
    }, schema=GENERATION_SCHEMA)
    graded = grade_table(df, workers=2)
    assert graded.schema == pl.Schema(GRADED_SCHEMA)
    assert graded["sample_id"].to_list() == ["a", "b", "c"]
    assert graded["status"].to_list() == ["correct", "unparseable", "truncated"]
    assert graded["correct"].to_list() == [True, False, False]
    assert graded["pred"].to_list() == ["25", None, "3"]
    assert graded["grade_s"].min() >= 0


def test_strip_thinking_reads_the_answer_after_the_reasoning():
    import polars as pl

    from evaldag.scoring.grading import strip_thinking
    from evaldag.storage.schema import GENERATION_SCHEMA

    assert strip_thinking("<think>maybe 7?</think> The answer is $\\boxed{5}$") == "The answer is $\\boxed{5}$"
    assert strip_thinking("<think>still thinking, 7") == ""
    row = {c: None for c in GENERATION_SCHEMA}
    row.update(sample_id="a", prompt="p", gold="5", gold_raw="5", sample_index=0, shard_index=0,
               completion="<think>Maybe $\\boxed{7}$? No.</think> The answer is $5$.", completion_ids=[1],
               prompt_tokens=1, completion_tokens=1, finish_reason="stop", latency_s=0.1, batch_size=1)
    df = pl.DataFrame([row], schema=GENERATION_SCHEMA)
    with_thinking = grade_table(df, workers=0)
    stripped = grade_table(df, workers=0, strip_thinking=True)
    assert stripped["status"][0] == "correct"
    assert with_thinking["status"][0] == "wrong"     # the boxed guess inside <think> would be taken otherwise


_START_SERVER = """
import time
import psutil
from evaldag.scoring.grading import grade_many, start_worker_server

def forkservers():
    return [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]

if __name__ == "__main__":
    start_worker_server()
    # it is started without waiting: until its exec, the child still shows this script's command line
    deadline = time.monotonic() + 10
    while not (servers := forkservers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(servers) == 1, [p.cmdline() for p in psutil.Process().children()]
    assert [g.correct for g in grade_many([("\\\\boxed{4}", "4", "stop")])] == [True]
    start_worker_server()                  # grading used it (no second one started); once running, a no-op
    assert [p.pid for p in forkservers()] == [servers[0].pid]
"""


def test_grading_worker_server_starts_ahead_of_grading(tmp_path: Path) -> None:
    """A shard starts the grading workers' server while its engine loads; grading then uses that server."""
    import subprocess
    import sys

    script = tmp_path / "start_server.py"
    script.write_text(_START_SERVER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

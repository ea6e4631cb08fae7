"""The shared input rules (evaldag.request.rules): one definition, the same answer wherever they are applied."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field, ValidationError

from evaldag.request import rules
from evaldag.errors import CheckpointError


@pytest.mark.parametrize("value, ok", [("grpo-42", True), ("a" * 128, True), ("a" * 129, False), ("a/b", False),
                                       ("has space", False), (".hidden", False), (5, False)])
def test_train_run(value, ok):
    if ok:
        assert rules.check_train_run(value) == value
    else:
        with pytest.raises(ValueError, match="train_run must match"):
            rules.check_train_run(value)


def test_limit_and_step():
    assert rules.check_limit(None) is None and rules.check_limit(3) == 3
    with pytest.raises(ValueError, match="limit must be >= 1"):
        rules.check_limit(0)
    with pytest.raises(CheckpointError, match="extra.limit must be an integer >= 1, got True"):
        rules.check_limit(True, "extra.limit", CheckpointError)
    assert rules.check_step(0) == 0
    with pytest.raises(ValueError, match="step must be an int"):
        rules.check_step("12")


def test_run_id_and_benchmarks():
    assert rules.check_run_id(None) is None and rules.check_run_id("0123abcd") == "0123abcd"
    with pytest.raises(ValueError, match="run id"):
        rules.check_run_id("")
    assert rules.check_benchmark_names(("math500", "gsm8k")) == ["math500", "gsm8k"]
    with pytest.raises(ValueError, match="benchmarks must be"):
        rules.check_benchmark_names(["MATH 500"])


def test_describe_errors_names_missing_fields_then_values():
    class M(BaseModel):
        a: int
        b: str = Field(pattern=rules.TRAIN_RUN_PATTERN)

    with pytest.raises(ValidationError) as e:
        M.model_validate({"b": "x/y"})
    assert rules.describe_errors(e.value.errors()) == ("missing required field(s) 'a'; b: String should match pattern "
                                                       f"'{rules.TRAIN_RUN_PATTERN}' (got str 'x/y')")


def test_describe_errors_can_leave_every_value_out():
    """For models that hold passwords (the stack settings): field and message only."""
    class M(BaseModel):
        a: int
        auth: str = Field(min_length=12)

    with pytest.raises(ValidationError) as e:
        M.model_validate({"auth": "PW-short"})
    assert rules.describe_errors(e.value.errors(), show_input=False) == (
        "missing required field(s) 'a'; auth: String should have at least 12 characters")

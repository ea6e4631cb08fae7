"""Reward registry, spec validation and vectorised values on a hand table."""

from __future__ import annotations

import numpy as np
import polars as pl
import pydantic
import pytest

from evaldag.scoring import rewards
from evaldag.scoring.rewards import (RewardSpec, check_rewards, combined_reward, get_reward, register_reward,
                             reward_metrics, reward_names)

TABLE = pl.DataFrame({
    "correct": [True, False, True, False],
    "completion": ["so $\\boxed{\\frac{1}{2}}$", "answer: \\boxed{}", "it is 3", "\\boxed {7}"],
    "completion_tokens": [100, 1000, 4000, 0],
})
SPEC = [{"name": "correctness", "weight": 1.0},
        {"name": "format", "weight": 0.1},
        {"name": "length_penalty", "weight": 0.05, "params": {"max_new_tokens": 2000}}]


def _values(spec: dict) -> list[float]:
    return TABLE.select(RewardSpec(**spec).expr())[:, 0].to_list()


def test_components_on_hand_table():
    assert _values({"name": "correctness"}) == [1.0, 0.0, 1.0, 0.0]
    assert _values({"name": "format"}) == [1.0, 0.0, 0.0, 1.0]             # empty \boxed{} is no answer
    assert _values({"name": "length_penalty", "params": {"max_new_tokens": 2000}}) == [-0.05, -0.5, -1.0, 0.0]
    assert _values({"name": "length_penalty", "params": {"max_new_tokens": 2000, "scale": 2.0,
                                                         "free_tokens": 1000}}) == [0.0, 0.0, -2.0, 0.0]


def test_combined_is_weighted_sum():
    got = TABLE.select(combined_reward(SPEC))["reward"].to_numpy()
    expected = (np.array([1, 0, 1, 0]) + 0.1 * np.array([1, 0, 0, 1])
                + 0.05 * -np.array([0.05, 0.5, 1.0, 0.0]))
    np.testing.assert_allclose(got, expected)
    m = reward_metrics(TABLE, SPEC)
    assert m["reward/mean"] == pytest.approx(expected.mean())
    assert m["reward/std"] == pytest.approx(expected.std(ddof=1))
    assert m["reward/p05"] == pytest.approx(np.quantile(expected, 0.05))
    assert m["reward/p95"] == pytest.approx(np.quantile(expected, 0.95))
    assert m["reward/correctness/mean"] == 0.5                        # unweighted component means
    assert m["reward/format/mean"] == 0.5
    assert m["reward/length_penalty/mean"] == pytest.approx(-1.55 / 4)


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown reward 'lenght'.*correctness.*format.*length_penalty"):
        get_reward("lenght")
    with pytest.raises(pydantic.ValidationError, match="unknown reward"):
        RewardSpec(name="lenght")


def test_spec_is_strict():
    with pytest.raises(pydantic.ValidationError, match="wieght"):
        RewardSpec(name="format", wieght=2.0)
    with pytest.raises(pydantic.ValidationError, match="max_tokens"):
        RewardSpec(name="length_penalty", params={"max_tokens": 100})
    with pytest.raises(pydantic.ValidationError, match="max_new_tokens"):
        RewardSpec(name="length_penalty")
    # values the factory refuses fail where the config is put to use (check_rewards runs the factories), not in
    # validation, which only reads the signature: a config travels in every plan.json
    bad = RewardSpec(name="length_penalty", params={"max_new_tokens": 10, "free_tokens": 10})
    with pytest.raises(ValueError, match="free_tokens"):
        check_rewards([RewardSpec(name="correctness"), bad])
    with pytest.raises(ValueError, match="more than once"):
        reward_metrics(TABLE, [{"name": "format"}, {"name": "format", "weight": 2}])


def test_register_reward(monkeypatch):
    monkeypatch.setattr(rewards, "_REWARDS", dict(rewards._REWARDS))

    @register_reward("short")
    def short(limit: int = 50) -> pl.Expr:
        return (pl.col("completion_tokens") < limit).cast(pl.Float64)

    assert "short" in reward_names()
    assert _values({"name": "short", "params": {"limit": 500}}) == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("short")(short)


def test_one_row_table_leaves_std_out():
    m = reward_metrics(TABLE.head(1), [{"name": "correctness"}])
    assert "reward/std" not in m and m["reward/mean"] == 1.0


def test_the_summary_shows_no_std_where_one_sample_has_none():
    """A one-sample evaluation has no reward std (left out of the metrics, not 0); the summary said '± 0'."""
    from evaldag.tracking.report import _reward

    assert _reward({"reward/mean": 0.5, "reward/std": 0.25}) == "0.5 ± 0.25"
    assert _reward({"reward/mean": 1.0}) == "1 (one sample: no std)"

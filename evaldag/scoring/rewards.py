"""Reward functions, chosen per benchmark config by name, computed as polars expressions over the graded table.

A reward is a factory registered with `@register_reward("name")`: called with its params (from the config), it
returns a `pl.Expr` giving one float per sample. Expressions rather than per-row Python functions, because a
million-row table is then scored in one vectorised pass. The registry is this module's dict, filled only by the
decorators below: no entry points, no imports elsewhere that register things as a side effect.

A benchmark config lists components, e.g.
    [{"name": "correctness", "weight": 1.0},
     {"name": "format", "weight": 0.1},
     {"name": "length_penalty", "weight": 0.05, "params": {"max_new_tokens": 2048}}]
and the reward of a sample is the weighted sum of the components (`combined_reward`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RewardFn = Callable[..., pl.Expr]

_REWARDS: dict[str, RewardFn] = {}

# A final answer in \boxed{...} with something inside (an empty \boxed{} is not an answer).
_BOXED_RE = r"\\boxed\s*\{\s*[^\s}]"


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward factory under `name`. Raises ValueError if the name is taken."""
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered (by {_REWARDS[name].__qualname__})")
        _REWARDS[name] = fn
        return fn
    return deco


def reward_names() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
    """The reward factory registered as `name`; ValueError listing the known names otherwise."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known rewards: {reward_names()}") from None


@register_reward("correctness")
def correctness() -> pl.Expr:
    """1.0 for a correct sample, else 0.0 (an ungraded null earns nothing, as it would in training)."""
    return pl.col("correct").fill_null(False).cast(pl.Float64)


@register_reward("format")
def format_reward() -> pl.Expr:
    """1.0 when the completion contains a non-empty `\\boxed{...}` final answer, else 0.0."""
    return pl.col("completion").str.contains(_BOXED_RE).fill_null(False).cast(pl.Float64)


@register_reward("length_penalty")
def length_penalty(max_new_tokens: int, scale: float = 1.0, free_tokens: int = 0) -> pl.Expr:
    """-scale * (tokens beyond `free_tokens`) / (max_new_tokens - free_tokens), in [-scale, 0].

    Normalised by the generation budget so one weight means the same across benchmarks with different budgets.
    """
    if max_new_tokens <= 0 or not 0 <= free_tokens < max_new_tokens:
        raise ValueError(f"length_penalty needs max_new_tokens > 0 and 0 <= free_tokens < max_new_tokens, "
                         f"got max_new_tokens={max_new_tokens}, free_tokens={free_tokens}")
    over = (pl.col("completion_tokens").cast(pl.Float64) - free_tokens) / (max_new_tokens - free_tokens)
    return -scale * over.clip(0.0, 1.0)


@register_reward("step_validity")
def step_validity(no_steps: float = 0.0) -> pl.Expr:
    """steps_valid / steps_checked of the completion's arithmetic steps (evaldag.scoring.steps), in [0, 1];
    `no_steps` for a completion with no checkable step, or whose check overran the grading timeout."""
    ratio = pl.col("steps_valid").cast(pl.Float64) / pl.col("steps_checked").cast(pl.Float64)
    return pl.when(pl.col("steps_checked") > 0).then(ratio).otherwise(pl.lit(float(no_steps)))


class RewardSpec(BaseModel):
    """One weighted component of a benchmark's reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="a registered reward name (see evaldag.scoring.rewards.reward_names())")
    weight: float = Field(1.0, description="multiplier of this component in the summed reward")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward factory")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        get_reward(name)
        return name

    @model_validator(mode="after")
    def _params_fit(self) -> RewardSpec:
        # Build the expression once here, so a misspelt or missing param fails at config load, not at reduce.
        self.expr()
        return self

    def expr(self) -> pl.Expr:
        """The component's unweighted expression."""
        fn = get_reward(self.name)
        sig = inspect.signature(fn)
        unknown = sorted(set(self.params) - set(sig.parameters))
        try:
            if unknown:
                raise TypeError(f"unknown params {unknown}")
            sig.bind(**self.params)
        except TypeError as error:
            raise ValueError(f"reward {self.name!r}: bad params {self.params}: {error}; "
                             f"expected {self.name}{sig}") from None
        return fn(**self.params)


def _specs(spec: list[RewardSpec | dict]) -> list[RewardSpec]:
    specs = [s if isinstance(s, RewardSpec) else RewardSpec.model_validate(s) for s in spec]
    if not specs:
        raise ValueError("a reward spec needs at least one component")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"reward components {dup} appear more than once; their per-component metrics would clash")
    return specs


def combined_reward(spec: list[RewardSpec | dict]) -> pl.Expr:
    """The weighted sum of the components in `spec` (dicts are validated as RewardSpec)."""
    return pl.sum_horizontal([s.weight * s.expr() for s in _specs(spec)]).alias("reward")


def reward_metrics(graded: pl.DataFrame, spec: list[RewardSpec | dict]) -> dict[str, float]:
    """reward/mean, reward/std, reward/p05, reward/p95 of the summed reward, and reward/<name>/mean per component.

    reward/std is absent for a one-sample table (undefined).
    Component means are unweighted, so they read the same whatever weights a config gives them.
    """
    if graded.height == 0:
        raise ValueError("no graded samples to compute rewards on")
    specs = _specs(spec)
    scored = graded.select(combined_reward(specs), *[s.expr().alias(s.name) for s in specs])
    reward = pl.col("reward")
    row = scored.select(
        **{"reward/mean": reward.mean(), "reward/std": reward.std(),
           "reward/p05": reward.quantile(0.05, "linear"), "reward/p95": reward.quantile(0.95, "linear")},
        **{f"reward/{s.name}/mean": pl.col(s.name).mean() for s in specs},
    ).row(0, named=True)
    # The std of a single sample is undefined (null): left out rather than faked as 0, as in evaldag.scoring.metrics.
    return {k: float(v) for k, v in row.items() if v is not None}

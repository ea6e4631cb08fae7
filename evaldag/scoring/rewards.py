"""Reward functions, chosen per benchmark config by name, computed as polars expressions over the graded table.

A reward is a factory registered with `@register_reward("name")`: called with its params (from the config), it
returns a `pl.Expr` giving one float per sample. Expressions rather than per-row Python functions, because a
million-row table is then scored in one vectorised pass. The registry is this module's dict, filled only by the
decorators below: no imports elsewhere that register things as a side effect. A team's own rewards come as
plug-ins (evaldag.scoring.plugins): a config names an entry point of group `evaldag.rewards` of an installed
package; a built-in name wins over an entry point's. Validating a config reads the factory's signature and never
calls it (a config travels in every plan.json, read back from a store that every node writes); `check_rewards`
builds the expressions and tries them on one row, where a config is put to use (`load_benchmark`).

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
    """The reward factory registered as `name`, else the plug-in of that name (an entry point of group
    `evaldag.rewards`, loaded, not called); a ValueError (PluginError) naming the built-in rewards, the entry point
    group and how to register one otherwise."""
    from evaldag.scoring import plugins

    if name in _REWARDS:
        return _REWARDS[name]
    return plugins.load(name, plugins.REWARDS_GROUP, builtin=reward_names())


def _probe_table() -> pl.DataFrame:
    """One plausible graded row, to try a reward's expression on before generation (check_rewards)."""
    from evaldag.storage.schema import GRADED_SCHEMA

    row = {"sample_id": "probe", "prompt": "What is 2 + 2?", "gold": "4", "gold_raw": "4", "subject": None,
           "level": None, "sample_index": 0, "shard_index": 0, "completion": "2 + 2 = 4, so \\boxed{4}",
           "completion_ids": [1, 2, 3], "prompt_tokens": 8, "completion_tokens": 3, "finish_reason": "stop",
           "latency_s": 0.1, "batch_size": 1, "pred": "4", "status": "correct", "correct": True, "grade_s": 0.01,
           "answer_group": 0, "steps_checked": 1, "steps_valid": 1}
    return pl.DataFrame([row], schema=GRADED_SCHEMA)


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
        # a misspelt or missing param fails here, from the signature alone: validation never calls the factory
        self._factory()
        return self

    def _factory(self) -> RewardFn:
        """The factory, its signature checked against the params (read, not called)."""
        fn = get_reward(self.name)
        try:
            sig = inspect.signature(fn)
        except ValueError:      # no signature to read (a builtin): the call says what is wrong, in check_rewards
            return fn
        unknown = sorted(set(self.params) - set(sig.parameters))
        try:
            if unknown:
                raise TypeError(f"unknown params {unknown}")
            sig.bind(**self.params)
        except TypeError as error:
            raise ValueError(f"reward {self.name!r}: bad params {self.params}: {error}; "
                             f"expected {self.name}{sig}") from None
        return fn

    def expr(self) -> pl.Expr:
        """The component's unweighted expression (the factory called with the params)."""
        expr = self._factory()(**self.params)
        if not isinstance(expr, pl.Expr):
            raise ValueError(f"reward {self.name!r} returned a {type(expr).__name__}; a reward factory returns a "
                             "polars expression (pl.Expr) giving one float per row of the graded table")
        return expr


def check_rewards(spec: list[RewardSpec]) -> None:
    """Build each component's expression and try it on one plausible graded row, so that a factory refusing its
    params, or a plug-in returning no expression or reading a column the table lacks, fails before generation
    (naming the reward) rather than at the reduce. It runs the factories: call it where a config is put to use,
    never while validating one (a plan read back from the store is data only)."""
    for s in spec:
        try:
            expr = s.expr()
        except ValueError:
            raise
        except Exception as error:    # a factory's own error (bad values of its params, a plug-in's bug)
            raise ValueError(f"reward {s.name!r} with params {s.params}: {type(error).__name__}: {error}") from error
        _evaluate(s.name, _probe_table(), [expr])


def _evaluate(name: str, table: pl.DataFrame, exprs: list[pl.Expr]) -> pl.DataFrame:
    try:
        return table.select(exprs)
    except Exception as error:     # polars' own errors (a missing column, a wrong type) and a plug-in's
        raise ValueError(f"reward {name!r} failed on the graded table ({table.height} rows): "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error


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
    try:
        scored = graded.select(combined_reward(specs), *[s.expr().alias(s.name) for s in specs])
    except Exception:
        for s in specs:    # say which component failed (a plug-in's, most likely)
            _evaluate(s.name, graded, [s.expr()])
        raise
    reward = pl.col("reward")
    row = scored.select(
        **{"reward/mean": reward.mean(), "reward/std": reward.std(),
           "reward/p05": reward.quantile(0.05, "linear"), "reward/p95": reward.quantile(0.95, "linear")},
        **{f"reward/{s.name}/mean": pl.col(s.name).mean() for s in specs},
    ).row(0, named=True)
    # The std of a single sample is undefined (null): left out rather than faked as 0, as in evaldag.scoring.metrics.
    return {k: float(v) for k, v in row.items() if v is not None}

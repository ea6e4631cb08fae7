"""What an adaptive request (evaldag.decisions.adaptive) must satisfy, and the sampling of its first round
(evaldag.request.second_round has how the rounds run)."""

from __future__ import annotations

from evaldag.decisions.adaptive import AdaptiveSettings
from evaldag.errors import ConfigError
from evaldag.request.config import SamplingConfig, merge_sampling


def check_request(settings: AdaptiveSettings, engine: str, overrides: dict | None, n_problems: int,
                  decide: str | None, reference: str | None) -> None:
    """ConfigError, naming the fix, for an adaptive request that cannot run as asked."""
    if engine != "vllm":
        raise ConfigError(f"adaptive samples need engine=vllm, which seeds each sample alone (the second round draws "
                          f"samples n0.. of a problem by themselves); this model runs on {engine!r}. Evaluate it "
                          "with engine=vllm, or with a fixed sampling.n instead of adaptive")
    if overrides and "n" in overrides and overrides["n"] != settings.n0:
        raise ConfigError(f"adaptive draws n0={settings.n0} samples of every problem first and more where needed, so "
                          f"sampling.n={overrides['n']} has no meaning beside it: drop sampling.n (set adaptive.n0 "
                          "for the first round's size)")
    if decide is not None:
        raise ConfigError("decide (stopping early) and adaptive samples cannot be combined yet: decide reads a "
                          "verdict over problems in rounds, adaptive spends its second round on the problems the "
                          "first left uncertain; drop one of them")
    if reference is not None:
        raise ConfigError("KL to a reference model and adaptive samples cannot be combined: the KL estimate is a "
                          "mean over completions drawn alike for every problem; drop `reference` or `adaptive`")
    try:
        settings.check_problems(n_problems)
    except ValueError as e:
        raise ConfigError(f"adaptive: {e}") from None


def first_round_sampling(base: SamplingConfig, overrides: dict | None, settings: AdaptiveSettings) -> SamplingConfig:
    """The benchmark's sampling with the request's overrides and n = n0; ConfigError when it is greedy."""
    sampling = merge_sampling(base, {k: v for k, v in (overrides or {}).items() if k != "n"})
    if sampling.temperature == 0.0:
        raise ConfigError("adaptive samples need sampling with temperature > 0 (greedy decoding draws the same "
                          "completion every time); pass e.g. sampling={\"temperature\": 0.6}")
    return sampling.model_copy(update={"n": settings.n0})


__all__ = ["check_request", "first_round_sampling"]

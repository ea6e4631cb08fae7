"""Each diagnostic fires on a constructed case and stays quiet on noise (rate about alpha over seeds)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from evaldag.scoring.diagnostics import (Diagnostic, accuracy_reward_divergence, reward_fluctuation,
                                 shard_disagreement, to_markdown, to_tags)


def _shards(accuracies: list[float], problems: int = 50, n: int = 4, seed: int = 0,
            spread: float = 0.0) -> pl.DataFrame:
    """Samples of `problems` problems per shard; per-problem accuracy = shard accuracy +- `spread` (difficulty)."""
    rng = np.random.default_rng(seed)
    frames = []
    for shard, acc in enumerate(accuracies):
        p = np.clip(acc + rng.uniform(-spread, spread, size=problems), 0, 1)
        correct = rng.random((problems, n)) < p[:, None]
        frames.append(pl.DataFrame({
            "sample_id": np.repeat([f"s{shard}p{i}" for i in range(problems)], n),
            "sample_index": np.tile(np.arange(n), problems),
            "shard_index": shard,
            "correct": correct.ravel(),
        }))
    return pl.concat(frames)


# ---- shard_disagreement ---------------------------------------------------------------------------------------

def test_shards_quiet_on_equal_accuracy_and_fire_on_30_points():
    quiet = shard_disagreement(_shards([0.5] * 4, seed=0))
    assert not quiet.fired and quiet.details["p_value"] >= 0.01
    fired = shard_disagreement(_shards([0.5, 0.5, 0.8, 0.5], seed=0))
    # no reassignment of problems comes close: the smallest p-value the permutations can give
    assert fired.fired and fired.details["p_value"] == pytest.approx(1 / (1 + fired.details["permutations"]))
    assert fired.details["p_value_iid"] < 1e-6
    assert "shard 2" in fired.explanation


def test_shard_fire_rate_is_about_alpha():
    alpha = 0.05
    runs = [shard_disagreement(_shards([0.4] * 4, seed=s), alpha=alpha) for s in range(100)]
    rate = np.mean([d.fired for d in runs])
    assert 0.01 <= rate <= 0.12                              # binomial(100, 0.05): P(0) = 0.006, P(> 12) < 0.001
    # on noise the p-value is about uniform: a test that never fires (p stuck near 1) or always does fails here
    p = np.array([d.details["p_value"] for d in runs])
    assert 0.35 <= p.mean() <= 0.65 and 0.35 <= np.mean(p < 0.5) <= 0.65, (p.mean(), np.mean(p < 0.5))


def test_problem_difficulty_is_not_disagreement():
    # 20 samples per problem, difficulties spread +-0.4: the plain sample-level chi-square fires on problem mix,
    # the design-effect-corrected test does not.
    runs = [shard_disagreement(_shards([0.5] * 4, problems=25, n=20, seed=s, spread=0.4), alpha=0.05)
            for s in range(40)]
    iid_rate = np.mean([d.details["p_value_iid"] < 0.05 for d in runs])
    rate = np.mean([d.fired for d in runs])
    assert min(d.details["design_effect"] for d in runs) > 2
    assert iid_rate > 0.3 and rate <= 0.15


def _healthy(shards: int, per_shard: int, n: int, seed: int) -> pl.DataFrame:
    """A healthy evaluation: problem difficulties from Uniform(0, 1), dealt round-robin to shards; no shard effect."""
    rng = np.random.default_rng(seed)
    problems = shards * per_shard
    correct = rng.random((problems, n)) < rng.uniform(0, 1, problems)[:, None]
    return pl.DataFrame({"sample_id": np.repeat([f"p{i:03d}" for i in range(problems)], n),
                         "sample_index": np.tile(np.arange(n), problems),
                         "shard_index": np.repeat(np.arange(problems) % shards, n), "correct": correct.ravel()})


@pytest.mark.parametrize("shards, per_shard", [(2, 5), (4, 5), (4, 15)])
def test_shard_false_alarm_rate_is_alpha_with_few_problems_per_shard(shards, per_shard):
    """Healthy runs with a handful of problems per shard and n=8 samples each: the diagnostic fires at about alpha,
    no more (problem difficulty is not a shard effect) and no less (a check that never fires checks nothing)."""
    alpha, runs = 0.05, 300
    rate = np.mean([shard_disagreement(_healthy(shards, per_shard, 8, seed), alpha=alpha).fired
                    for seed in range(runs)])
    # binomial(300, 0.05): P(rate < 0.015) < 0.002, P(rate > 0.09) < 0.003
    assert 0.015 <= rate <= 0.09, f"false-alarm rate {rate:.3f} at alpha {alpha}"


def test_one_problem_per_shard_is_not_tested():
    """One problem per shard: a shard's accuracy is its problem's, so a shard effect cannot be told from problem
    difficulty. The diagnostic says so and never fires (the old test fired on 44% of healthy 4 x 1 runs at 0.01)."""
    runs = [shard_disagreement(_healthy(4, 1, 8, seed), alpha=0.01) for seed in range(200)]
    assert not any(d.fired for d in runs)
    assert "one problem" in runs[0].explanation and runs[0].details["p_value"] == 1.0


def test_shard_disagreement_still_finds_a_broken_shard_with_few_problems():
    """Power where a real shard effect exists: 4 shards x 15 problems, one shard 40 points worse on the same
    difficulty mix."""
    fired = []
    for seed in range(50):
        df = _healthy(4, 15, 8, seed)
        broken = df.with_columns(correct=pl.when(pl.col("shard_index") == 2)
                                 .then(pl.col("correct") & (pl.lit(np.random.default_rng(seed).random(df.height)) > 0.7))
                                 .otherwise(pl.col("correct")))
        fired.append(shard_disagreement(broken, alpha=0.01).fired)
    assert np.mean(fired) >= 0.8


def test_shard_degenerate_cases():
    all_correct = shard_disagreement(_shards([1.0, 1.0]), num_shards=3)
    assert not all_correct.fired and all_correct.details["p_value"] == 1.0
    assert "[2]" in all_correct.explanation                  # the empty shard is named
    one = shard_disagreement(_shards([0.5]))
    assert not one.fired and "nothing to compare" in one.explanation


# ---- reward_fluctuation ---------------------------------------------------------------------------------------

def _history(means: np.ndarray, se: float = 0.02) -> pl.DataFrame:
    return pl.DataFrame({"step": np.arange(len(means)) * 100, "reward_mean": means,
                         "reward_se": np.full(len(means), se)})


def test_reward_fluctuation_fires_on_jump_and_names_steps():
    means = np.array([0.50, 0.51, 0.49, 0.80, 0.79])
    d = reward_fluctuation(_history(means))
    assert d.fired and "step 200 -> 300" in d.explanation
    assert d.details["max_z"] == pytest.approx(0.31 / np.sqrt(2 * 0.02 ** 2))


def test_reward_fluctuation_quiet_on_noise():
    fired = []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        fired.append(reward_fluctuation(_history(0.5 + rng.normal(0, 0.02, size=10)), alpha=0.05).fired)
    assert 0.02 <= np.mean(fired) <= 0.10                    # family-wise rate ~0.05 with Bonferroni
    # each jump's z is |N(0, 1)| on noise, mean sqrt(2 / pi) = 0.80: a wrong standard error moves it
    z = [j["z"] for seed in range(200)
         for j in reward_fluctuation(_history(0.5 + np.random.default_rng(seed).normal(0, 0.02, size=10)))
         .details["jumps"]]
    assert np.mean(z) == pytest.approx(np.sqrt(2 / np.pi), abs=0.08)
    rng = np.random.default_rng(0)
    assert not reward_fluctuation(_history(0.5 + rng.normal(0, 0.02, size=10))).fired


def test_reward_fluctuation_from_std_and_n():
    h = pl.DataFrame({"step": [0, 100], "reward_mean": [0.5, 0.55], "reward_std": [0.5, 0.5],
                      "n_samples": [100, 10000]})
    d = reward_fluctuation(h)
    assert d.details["jumps"][0]["z"] == pytest.approx(0.05 / np.sqrt(0.25 / 100 + 0.25 / 10000))
    with pytest.raises(ValueError, match="reward_se"):
        reward_fluctuation(h.drop("n_samples"))


# ---- accuracy_reward_divergence -------------------------------------------------------------------------------

def _job(acc_slope: float, rew_slope: float, seed: int, m: int = 12, se: float = 0.01) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    t = np.arange(m)
    return pl.DataFrame({"step": t * 500, "accuracy": 0.4 + acc_slope * t + rng.normal(0, se, m),
                         "reward_mean": 0.6 + rew_slope * t + rng.normal(0, se, m),
                         "accuracy_se": np.full(m, se), "reward_se": np.full(m, se)})


def test_divergence_fires_on_opposite_trends():
    d = accuracy_reward_divergence(_job(0.01, -0.01, seed=0))
    assert d.fired and d.details["accuracy_slope"] > 0 > d.details["reward_mean_slope"]
    assert "opposite" in d.explanation


def test_divergence_quiet_when_both_rise_or_on_noise():
    assert not accuracy_reward_divergence(_job(0.01, 0.01, seed=0)).fired
    assert not accuracy_reward_divergence(_job(0.0, 0.0, seed=0)).fired
    assert not accuracy_reward_divergence(_job(0.0005, -0.0005, seed=0)).fired   # noise-level drift
    runs = [accuracy_reward_divergence(_job(0.0, 0.0, seed=s), alpha=0.05) for s in range(100)]
    assert np.mean([d.fired for d in runs]) <= 0.05          # needs two significant slopes: rate ~alpha^2 / 2
    # too rare to bound from below, so each slope test is checked instead: its p-value is about uniform on noise
    p = np.array([d.details[f"{m}_p_value"] for d in runs for m in ("accuracy", "reward_mean")])
    assert 0.4 <= p.mean() <= 0.6 and np.mean(p < 0.05) <= 0.1, (p.mean(), np.mean(p < 0.05))
    # and a real opposite drift of 0.3 points per checkpoint (3 SE over the job) is found most of the time
    power = np.mean([accuracy_reward_divergence(_job(0.003, -0.003, seed=s), alpha=0.05).fired for s in range(100)])
    assert power >= 0.7, power


def test_divergence_without_standard_errors_uses_residuals():
    d = accuracy_reward_divergence(_job(0.01, -0.01, seed=1).drop("accuracy_se", "reward_se"))
    assert d.fired
    with pytest.raises(ValueError, match="at least 3"):
        accuracy_reward_divergence(_job(0.01, -0.01, seed=1, m=2))


# ---- rendering ------------------------------------------------------------------------------------------------

def test_markdown_and_tags():
    diags = [Diagnostic("a", False, "all fine", "None."), Diagnostic("b", True, "x | y", "look")]
    md = to_markdown(diags)
    assert md.splitlines()[2].startswith("| b | **fired** | x \\| y |")      # fired first, pipes escaped
    assert to_tags(diags) == {"diagnostic.a": "ok", "diagnostic.b": "fired"}


def test_divergence_quiet_when_standard_errors_are_understated():
    # Reported errors 10x too small (e.g. samples of one problem treated as independent): the scatter of the points
    # around the line shows it, and the slope errors are scaled up rather than trusting the stated ones.
    runs = [accuracy_reward_divergence(_job(0.0, 0.0, seed=s, se=0.02)
                                       .with_columns(accuracy_se=pl.lit(0.002), reward_se=pl.lit(0.002)),
                                       alpha=0.05)
            for s in range(50)]
    assert np.mean([d.fired for d in runs]) <= 0.06
    # the rescaled slope tests are calibrated, not just quiet: p about uniform, not stuck near 1
    p = np.array([d.details[f"{m}_p_value"] for d in runs for m in ("accuracy", "reward_mean")])
    assert 0.4 <= p.mean() <= 0.6 and np.mean(p < 0.05) <= 0.1, (p.mean(), np.mean(p < 0.05))


def _split(shards: int, problems: int, n: int, seed: int, broken: int | None = None) -> pl.DataFrame:
    """A healthy evaluation whose plan split every problem's n samples over the shards (evaldag.request.plan.
    plan_split_shards: sample k of problem i on shard (i + k * shards // n) mod shards); `broken`: that shard's
    correct samples are kept with probability 0.5 only."""
    rng = np.random.default_rng(seed)
    p = rng.beta(0.6, 0.6, problems)
    correct = rng.random((problems, n)) < p[:, None]
    shard = (np.arange(problems)[:, None] + np.arange(n)[None, :] * shards // n) % shards
    if broken is not None:
        correct &= (shard != broken) | (rng.random((problems, n)) < 0.5)
    return pl.DataFrame({"sample_id": np.repeat([f"p{i:03d}" for i in range(problems)], n),
                         "sample_index": np.tile(np.arange(n), problems), "shard_index": shard.ravel(),
                         "correct": correct.ravel()})


def test_split_plans_are_tested_within_problems_at_alpha_and_with_power():
    """Where the plan split problems' samples over the shards, problems cannot be dealt out whole; each problem's
    samples are shuffled among its shards instead. Healthy: fires at about alpha. One shard of 4 losing half its
    correct samples (40 problems x 8 samples): found."""
    alpha, runs = 0.05, 200
    healthy = [shard_disagreement(_split(4, 20, 8, seed), alpha=alpha, permutations=400) for seed in range(runs)]
    assert {d.details["test"] for d in healthy} == {"permutation of samples within problems"}
    rate = np.mean([d.fired for d in healthy])
    # binomial(200, 0.05): P(rate < 0.015) < 0.01, P(rate > 0.1) < 0.01
    assert 0.015 <= rate <= 0.1, f"false-alarm rate {rate:.3f} at alpha {alpha}"
    power = np.mean([shard_disagreement(_split(4, 40, 8, seed, broken=1), alpha=alpha, permutations=400).fired
                     for seed in range(40)])
    assert power >= 0.8, power

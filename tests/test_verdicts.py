"""Paired verdicts (evaldag.decisions.verdicts) and the group-sequential verdict (evaldag.decisions.sequential), each statistic
checked against an independent computation (by hand, scipy, brute force), the sequential rule by simulation with
bounds on both sides, and `evaldag compare --verdicts` on a real MLflow store (SQLite) with the samples loader
replaced (no artifacts server needed)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import polars as pl
import pytest
from scipy import stats

from evaldag.decisions import sequential, verdicts


def _brute_sign_flip(d: np.ndarray) -> float:
    """Two-sided sign-flip p-value by enumerating all 2^m sign vectors."""
    observed = abs(d.sum())
    hits = sum(abs(np.dot(signs, np.abs(d))) >= observed - 1e-12
               for signs in itertools.product((-1.0, 1.0), repeat=d.size))
    return hits / 2 ** d.size


def test_hand_computed_example():
    # 10 problems, n = 2 samples: d_i in steps of 1/2
    d = np.array([1, 0.5, 0, 0.5, -0.5, 1, 0.5, 0, 1, 0.5])
    v = verdicts.paired_test(d, margin=0.02, alpha=0.05, grid=2)
    # by hand: sum 4.5, mean 0.45; sum of squares 4.25 -> var = (4.25 - 10 * 0.45^2) / 9 = 2.225 / 9
    assert v.diff == pytest.approx(0.45)
    assert v.se == pytest.approx(math.sqrt(2.225 / 9 / 10))
    half = stats.t.ppf(0.975, 9) * v.se
    assert (v.ci_low, v.ci_high) == pytest.approx((0.45 - half, 0.45 + half))
    # by hand: |d| has units (2,1,0,1,1,2,1,0,2,1) (x 1/2), total 11; the observed sum is 9 units; flips reaching
    # |S| >= 9 need the flipped units to sum to <= 1: none flipped, or one of the five 1-unit problems -> 6 of
    # 2^8 sign patterns of the nonzero problems, each side -> p = 12 / 256
    assert v.p_value == pytest.approx(12 / 256) and v.p_method == "exact"
    assert v.p_value == pytest.approx(_brute_sign_flip(d))
    assert v.verdict == "better"


def test_interval_matches_scipy_ttest_rel():
    rng = np.random.default_rng(3)
    a = rng.binomial(4, 0.6, size=200) / 4
    b = rng.binomial(4, 0.5, size=200) / 4
    v = verdicts.paired_test(a - b, alpha=0.1, grid=4)
    ref = stats.ttest_rel(a, b)
    ci = ref.confidence_interval(0.9)
    assert (v.ci_low, v.ci_high) == pytest.approx((ci.low, ci.high))
    # the exact sign-flip p-value and the t-test's agree closely on 200 problems
    assert v.p_value == pytest.approx(ref.pvalue, rel=0.25, abs=1e-3)


@pytest.mark.parametrize("seed", range(5))
def test_exact_sign_flip_matches_brute_force_and_monte_carlo(seed):
    rng = np.random.default_rng(seed)
    d = (rng.integers(0, 5, 14) - rng.integers(0, 5, 14)) / 4      # n = 4 per problem
    p, method = verdicts.sign_flip_p_value(d, grid=4)
    assert method == "exact" and p == pytest.approx(_brute_sign_flip(d))
    mc, method = verdicts.sign_flip_p_value(d, grid=None)           # no grid given: Monte Carlo
    assert method == "monte-carlo" and mc == pytest.approx(p, abs=0.01)


def test_exact_null_is_fast_on_full_math500_at_n64():
    rng = np.random.default_rng(0)
    d = (rng.binomial(64, 0.5, 500) - rng.binomial(64, 0.5, 500)) / 64
    p, method = verdicts.sign_flip_p_value(d, grid=64)
    assert method == "exact" and 0 < p <= 1


@pytest.mark.parametrize("interval, verdict", [
    ((-0.01, 0.015), "equivalent"), ((0.005, 0.015), "equivalent"),    # significant but within the margin
    ((0.01, 0.08), "better"), ((-0.08, -0.001), "worse"), ((-0.01, 0.05), "undecided"),
    ((float("nan"), float("nan")), "undecided")])
def test_verdict_rule(interval, verdict):
    assert verdicts.verdict_from_interval(*interval, margin=0.02) == verdict


def test_better_needs_the_exact_test_too():
    assert verdicts.verdict_from_interval(0.01, 0.08, 0.02, p_value=0.2, alpha=0.05) == "undecided"


def test_worse_needs_the_exact_test_too():
    """Ten problems, five lost by one sample in four, five tied: Student's t interval lies below 0, but the exact
    sign-flip p-value is 2 / 2^5 (only the all-negative and all-positive flips of the five reach |sum|) >= 0.05."""
    d = np.r_[np.full(5, -0.25), np.zeros(5)]
    # by hand: mean -0.125, sd sqrt(10 x 0.125^2 / 9), upper bound -0.125 + t(0.975, 9) x sd / sqrt(10) < 0
    upper = -0.125 + stats.t.ppf(0.975, 9) * math.sqrt(10 * 0.125 ** 2 / 9) / math.sqrt(10)
    v = verdicts.paired_test(d, margin=0.02, alpha=0.05, grid=4)
    assert v.ci_high == pytest.approx(upper) and upper < 0
    assert v.p_value == pytest.approx(2 / 2 ** 5)
    assert v.verdict == "undecided"
    assert verdicts.verdict_from_interval(-0.08, -0.01, 0.02, p_value=0.2, alpha=0.05) == "undecided"


def test_degenerate_inputs():
    assert verdicts.paired_test([]).verdict == "undecided"
    v = verdicts.paired_test(np.zeros(5), grid=1)
    assert v.p_value == 1.0 and v.verdict == "undecided"            # too few problems to call anything
    # 50 agreeing problems: a zero-width t interval, but a checkpoint that breaks 2 % of problems and fixes none
    # agrees on all 50 with probability 0.36, so not `equivalent` at margin 0.02 (the rare-difference bound: +-0.075)
    assert verdicts.paired_test(np.zeros(50), grid=1).verdict == "undecided"
    assert verdicts.paired_test(np.zeros(50), 0.1, grid=1).verdict == "equivalent"


def _samples(scores: dict[str, list[int]]) -> pl.DataFrame:
    return pl.DataFrame([{"sample_id": sid, "sample_index": i, "correct": bool(c), "status": "correct" if c else
                          "wrong"} for sid, cs in scores.items() for i, c in enumerate(cs)])


def test_scores_are_per_problem_means_joined_on_common_ids():
    a = verdicts.per_problem_scores(_samples({"p1": [1, 1], "p2": [1, 0], "p3": [0, 0], "only_a": [1, 1]}))
    b = verdicts.per_problem_scores(_samples({"p1": [0, 0], "p2": [1, 0], "p3": [0, 1], "only_b": [0, 0]}))
    pairs = verdicts.paired_differences(a, b)
    assert pairs["sample_id"].to_list() == ["p1", "p2", "p3"]
    assert pairs["d"].to_list() == [1.0, 0.0, -0.5]
    v = verdicts.compare_scores(a, b, min_problems=1)
    assert v.n_problems == 3 and v.diff == pytest.approx(0.5 / 3) and v.p_method == "exact"


# ------------------------------------------------------------------------------------------------------------
# the confidence sequence
# ------------------------------------------------------------------------------------------------------------

# Pocock's constant boundary, two-sided, equally spaced looks: Jennison & Turnbull, "Group Sequential Methods with
# Applications to Clinical Trials" (2000), Table 2.1, to the 3 decimals printed there
POCOCK_TABLE = {(0.05, 2): 2.178, (0.05, 3): 2.289, (0.05, 4): 2.361, (0.05, 5): 2.413, (0.05, 10): 2.555,
                (0.05, 15): 2.626, (0.05, 20): 2.672, (0.01, 2): 2.772, (0.01, 5): 2.986, (0.01, 10): 3.117}


@pytest.mark.parametrize("alpha,looks", sorted(POCOCK_TABLE))
def test_the_boundary_is_pococks(alpha, looks):
    z = sequential.pocock_boundary(tuple(range(1, looks + 1)), alpha)
    assert z == pytest.approx(POCOCK_TABLE[alpha, looks], abs=6e-4)


def test_the_boundary_of_uneven_looks_matches_scipys_multivariate_normal():
    """Looks at uneven counts: the z at which the normal process's joint coverage over them is 1 - alpha, computed
    independently from the looks' correlation matrix (corr(Z_i, Z_j) = sqrt(t_i / t_j)) with scipy's integrator."""
    counts = (7, 30, 31, 90, 200)
    z = sequential.pocock_boundary(counts, 0.05)
    t = np.array(counts, dtype=float)
    cov = np.sqrt(np.minimum.outer(t, t) / np.maximum.outer(t, t))
    joint = stats.multivariate_normal(np.zeros(t.size), cov, seed=0)
    assert 1 - joint.cdf(np.full(t.size, z), lower_limit=np.full(t.size, -z)) == pytest.approx(0.05, abs=1e-3)
    assert stats.norm.isf(0.025) < z < stats.norm.isf(0.025 / t.size)            # above one look, below Bonferroni
    with pytest.raises(ValueError, match="increasing"):
        sequential.pocock_boundary((5, 5), 0.05)


def test_a_looks_interval_is_the_t_interval_with_one_pseudo_observation_at_the_boundary():
    """By hand: mean +- t_{m-1}(the boundary's tail) x s / sqrt(m), s^2 = (sum of squares about the mean + 1) / m;
    with ranges, the interval holds every exact one drawn inside them."""
    rng = np.random.default_rng(3)
    d = rng.choice([-1.0, -0.5, 0.0, 0.0, 0.5, 1.0], size=40)
    low, high = sequential.look_interval(d, 2.5)
    s = math.sqrt((((d - d.mean()) ** 2).sum() + 1) / 40)
    half = stats.t.ppf(stats.norm.cdf(2.5), 39) * s / math.sqrt(40)
    assert (low[0], high[0]) == pytest.approx((d.mean() - half, d.mean() + half))
    agree = np.zeros(40)                                    # every problem agreeing: not a zero-width interval
    lo0, hi0 = sequential.look_interval(agree, 2.5)
    assert hi0[0] - lo0[0] > 0.1
    width = np.where(rng.random(40) < 0.2, 0.5, 0.0)
    low_d, high_d = np.maximum(-1, d - width), d
    lo_r, hi_r = sequential.look_interval(low_d, 2.5, d_high=high_d)
    for _ in range(50):
        exact = low_d + (high_d - low_d) * rng.integers(0, 3, 40) / 2
        lo_e, hi_e = sequential.look_interval(exact, 2.5)
        assert lo_r[0] <= lo_e[0] + 1e-12 and hi_e[0] <= hi_r[0] + 1e-12
    with pytest.raises(ValueError, match="d_high"):
        sequential.look_interval(high_d, 2.5, d_high=low_d - 0.5)


def _paired_population(rng, runs: int, size: int, shift: float) -> np.ndarray:
    """d = score_b - score_a with n = 4, U-shaped solve rates, b better by about `shift`."""
    p = rng.beta(0.75, 0.75, size=(runs, size))
    q = np.clip(p + shift, 0, 1)
    return (rng.binomial(4, q) - rng.binomial(4, p)) / 4


def test_type_one_error_at_every_look_is_alpha_not_more_and_not_far_less():
    """Read after every 10 problems (30 looks): false verdicts at most alpha, but not far below it (a boundary
    that ignores the number of looks errs far more, a Bonferroni one far less); greedy (d in {-1, 0, 1}) too. The
    fixed-n t test read at the same looks goes wrong far more often."""
    rng = np.random.default_rng(11)
    for n in (4, 1):
        p = rng.beta(0.75, 0.75, size=(4000, 300))
        d = (rng.binomial(n, p) - rng.binomial(n, p)) / n
        _, verdict = sequential.stopping_times(d, 10, alpha=0.1, margin=0.0)
        false_pos = np.isin(verdict, ["better", "worse"]).mean()
        # measured: 0.065 (n = 4) and 0.089 (greedy); Bonferroni over the 30 looks 0.013 / 0.021, the look-blind
        # boundary 0.35 / 0.43
        assert 0.05 <= false_pos <= 0.1 + 2 * math.sqrt(0.1 * 0.9 / 4000), (n, false_pos)
    looks = np.arange(10, 301, 10)
    means = np.cumsum(d, axis=1)[:, looks - 1] / looks
    sds = np.array([[row[:t].std(ddof=1) for t in looks] for row in d[:400]])
    naive = (np.abs(means[:400]) > stats.t.ppf(0.95, looks - 1) * sds / np.sqrt(looks)).any(axis=1).mean()
    assert naive > 0.25
    with pytest.raises(ValueError, match="planned looks"):
        sequential.sequential_verdict(d[0, :15], (10, 20), 0.05, 0.02)


def test_stops_early_and_not_too_early_on_a_clear_difference():
    rng = np.random.default_rng(12)
    d = _paired_population(rng, 200, 500, 0.12)
    stop, verdict = sequential.stopping_times(d, 10, alpha=0.05, margin=0.03)
    assert (verdict == "better").mean() >= 0.95                     # a rule that never stops fails here
    assert np.median(stop) <= 250                                   # ... or one that stops only at the end
    assert np.min(stop) >= 20                                       # a rule that always stops at once fails here
    assert not np.any(verdict == "worse")


def test_equivalence_is_reached_for_identical_models():
    rng = np.random.default_rng(13)
    d = _paired_population(rng, 50, 2000, 0.0)
    _, verdict = sequential.stopping_times(d, 50, alpha=0.05, margin=0.05)
    assert (verdict == "equivalent").mean() >= 0.9


def test_sequential_verdict_reads_the_last_interval():
    d = np.random.default_rng(1).permutation(np.r_[np.ones(60), np.zeros(40)])   # a random order, as required
    v = sequential.sequential_verdict(d, (50, 100), alpha=0.05, margin=0.02)
    assert v.n == 100 and v.verdict == "better" and 0 < v.ci_low <= 0.6 <= v.ci_high
    z = sequential.pocock_boundary((50, 100), 0.05)
    assert (v.ci_low, v.ci_high) == tuple(float(x[0]) for x in sequential.look_interval(d, z))
    assert sequential.sequential_verdict([], (10,), margin=0.02).verdict == "undecided"
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        sequential.look_interval(np.array([2.0, 0.0]), 2.0)


# ------------------------------------------------------------------------------------------------------------
# pairing a job's evaluations, `evaldag compare --verdicts`, log_verdicts
# ------------------------------------------------------------------------------------------------------------

def _scores_for(acc: float, size: int = 200, seed: int = 0) -> pl.DataFrame:
    """A per-sample table (n = 1) whose problems p000.. are solved with a nested pattern: a higher `acc` solves a
    superset of a lower one's problems, so differences are clear."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(size)
    solved = order < round(acc * size)
    return pl.DataFrame({"sample_id": [f"p{i:03d}" for i in range(size)], "sample_index": 0,
                         "correct": solved, "status": np.where(solved, "correct", "wrong")})


def test_pairing_previous_best_and_baseline_within_one_comparison_key():
    runs = pl.DataFrame({
        "run_id": ["r1", "r2", "r3", "r4", "q1", "base"],
        "train_run": ["job", "job", "job", "job", "job", "base-model"],
        "step": [100, 200, 300, 400, 200, 0],
        "benchmark": ["math500"] * 6,
        "comparison_key": ["K", "K", "K", "K", "Q", "K"],       # q1: a quick slice, another key
        "checkpoint": ["c1", "c2", "c3", "c4", "c2", "/models/base"],
        "model": ["m"] * 5 + ["base"], "start": [1, 2, 3, 4, 5, 0], "asked": [True] * 5 + [False]})
    acc = {"r1": 0.30, "r2": 0.60, "r3": 0.45, "r4": 0.61, "q1": 0.5, "base": 0.2}
    loaded = []

    def load(run_id):
        loaded.append(run_id)
        return _scores_for(acc[run_id])

    out = verdicts.pair_job_evaluations(runs, load, margin=0.02, baseline="/models/base")
    rows = {(r["step"], r["vs"]): r for r in out.filter(pl.col("train_run") == "job").iter_rows(named=True)}
    assert rows[(200, "previous")]["other"] == "job@100" and rows[(200, "previous")]["verdict"] == "better"
    assert rows[(300, "previous")]["other"] == "job@200" and rows[(300, "previous")]["verdict"] == "worse"
    assert rows[(400, "best")]["other"] == "job@200"                # best so far, not the previous (300)
    assert rows[(400, "best")]["verdict"] in ("equivalent", "undecided")
    assert rows[(100, "baseline")]["other"] == "base-model@0" and rows[(100, "baseline")]["verdict"] == "better"
    assert (100, "previous") not in rows                            # the first checkpoint has nothing before it
    assert not out.filter(pl.col("step") == 200).filter(pl.col("other").str.contains("q1")).height
    # the quick slice q1 (key Q) is paired with nothing: alone in its key and no baseline with key Q
    assert "q1" not in out["run_id"].to_list()
    assert len(loaded) == len(set(loaded))                          # each run's samples are loaded once
    assert out["diff"].to_list()[0] == pytest.approx(acc["r1"] - acc["base"])


def _log_eval(client, exp_id: str, job: str, step: int, acc: float, key: str = "K") -> str:
    from evaldag.tracking.names import COMPARISON_TAG

    run = client.create_run(exp_id, run_name=f"{job}@{step}", tags={
        "kind": "ckpt_eval", "train_run": job, "benchmark": "math500", "step": f"{step:012d}",
        COMPARISON_TAG: key, "checkpoint": f"/ckpts/{job}/checkpoint-{step}", "model": job})
    for k, v in {"accuracy": acc, "accuracy_ci_low": acc - 0.05, "accuracy_ci_high": acc + 0.05,
                 "reward/mean": acc, "step": step}.items():
        client.log_metric(run.info.run_id, k, v, step=step)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def test_compare_cli_prints_verdicts(mlflow_store, monkeypatch):
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from evaldag.cli import app
    from evaldag.tracking import samples as tracking_samples
    from evaldag.tracking.names import experiment_name
    from evaldag.tracking.parent_runs import ensure_experiment

    client = MlflowClient()
    exp_id = ensure_experiment(client, experiment_name("math500"))
    accs = {}
    for step, acc in ((100, 0.3), (200, 0.6), (300, 0.6)):
        accs[_log_eval(client, exp_id, "job-a", step, acc)] = acc
    accs[_log_eval(client, exp_id, "base", 0, 0.1)] = 0.1
    accs[_log_eval(client, exp_id, "job-b", 100, 0.9)] = 0.9          # not asked for
    monkeypatch.setattr(tracking_samples, "load_samples", lambda run_id: _scores_for(accs[run_id]))

    result = CliRunner().invoke(app, ["compare", "-b", "math500", "--train-run", "job-a", "--verdicts",
                                      "--margin", "0.02", "--baseline", "base@0"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "paired verdicts" in out and "job-b" not in out.split("paired verdicts")[1]
    lines = [line for line in out.splitlines() if "job-a" in line and ("previous" in line or "best" in line
                                                                       or "baseline" in line)]
    by = {(line.split("│")[3].strip(), line.split("│")[5].strip()): line for line in lines}
    assert "better" in by[("200", "previous")] and "+30.0" in by[("200", "previous")]
    assert "equivalent" in by[("300", "previous")]                  # the same problems solved: d = 0 everywhere
    assert "better" in by[("100", "baseline")]


def test_log_verdicts_writes_tags_and_metrics(mlflow_store):
    from mlflow import MlflowClient

    from evaldag.tracking.names import experiment_name
    from evaldag.tracking.parent_runs import ensure_experiment

    client = MlflowClient()
    exp_id = ensure_experiment(client, experiment_name("math500"))
    run_id = _log_eval(client, exp_id, "job", 100, 0.5)
    v = verdicts.paired_test(np.r_[np.ones(30), np.zeros(70)], grid=1)
    verdicts.log_verdicts(client, run_id, {"best": v}, step=100)
    data = client.get_run(run_id).data
    assert data.tags["verdict.vs_best"] == "better"
    assert data.metrics["verdict.vs_best.diff"] == pytest.approx(0.3)
    assert data.metrics["verdict.vs_best.ci_low"] == pytest.approx(v.ci_low)
    assert data.metrics["verdict.vs_best.p_value"] == pytest.approx(v.p_value)


def test_verdict_settings_default_and_validate():
    assert verdicts.verdict_settings({}) == (0.02, 0.05)
    assert verdicts.verdict_settings({verdicts.MARGIN_ENV: "0.01", verdicts.ALPHA_ENV: "0.1"}) == (0.01, 0.1)
    for bad in ({verdicts.MARGIN_ENV: "two points"}, {verdicts.ALPHA_ENV: "0"}, {verdicts.MARGIN_ENV: "-0.1"}):
        with pytest.raises(ValueError, match="EVALDAG_VERDICT"):
            verdicts.verdict_settings(bad)

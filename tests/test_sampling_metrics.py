"""pass@k, maj@k, answer groups and intervals against closed forms, brute force and hand-built tables."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import polars as pl
import pytest

from evaldag.scoring.sampling_metrics import (assign_answer_groups, bootstrap_mean_ci,
                                      maj_at_k, math_equivalent, pass_at_k,
                                      per_problem_maj_at_k, per_problem_pass_at_k, sampling_metrics,
                                      wilson_interval)


def _closed_form(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def _brute_force(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def _graded(problems: dict[str, list[bool]], **cols: dict[str, object]) -> pl.DataFrame:
    """One row per sample; rows in reverse order so nothing can lean on the table's order."""
    rows = [{"sample_id": sid, "sample_index": i, "correct": bool(ok), "status": "correct" if ok else "wrong",
             **{name: values[sid] for name, values in cols.items()}}
            for sid, outcomes in problems.items() for i, ok in enumerate(outcomes)]
    return pl.DataFrame(rows[::-1])


# ---- pass@k ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,c,k", [(5, 2, 1), (5, 2, 2), (5, 2, 3), (5, 2, 5), (5, 0, 1), (5, 0, 5), (5, 5, 1),
                                   (5, 5, 5), (1, 1, 1), (1, 0, 1), (2000, 3, 100), (2000, 1999, 1)])
def test_pass_at_k_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_closed_form(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)       # C(3,2)/C(5,2) = 3/10
    assert pass_at_k(5, 2, 4) == 1.0                              # any 4 of 5 include a correct one
    assert pass_at_k(5, 0, 3) == 0.0


def test_pass_at_k_matches_brute_force_enumeration():
    problems = {f"n{n}c{c}": [True] * c + [False] * (n - c) for n in [6] for c in range(n + 1)}
    table = _graded(problems)
    for k in range(1, 7):
        per = per_problem_pass_at_k(table, k)
        for sid, value in per.select("sample_id", "pass_at_k").iter_rows():
            c = int(sid.split("c")[1])
            assert value == pytest.approx(_brute_force(6, c, k), abs=1e-12), (sid, k)
            assert pass_at_k(6, c, k) == pytest.approx(_brute_force(6, c, k), abs=1e-12)


def test_pass_at_k_is_the_mean_over_problems():
    table = _graded({"a": [True, False, False, True], "b": [False] * 4, "c": [True] * 4})
    out = sampling_metrics(table, [1, 2, 4])
    for k in (1, 2, 4):
        expected = np.mean([pass_at_k(4, 2, k), pass_at_k(4, 0, k), pass_at_k(4, 4, k)])
        assert out[f"pass@{k}"] == pytest.approx(expected)
    assert out["avg@4"] == pytest.approx(6 / 12)


@pytest.mark.parametrize("k", [0, 5, -1])
def test_pass_at_k_rejects_k_outside_1_to_n(k):
    with pytest.raises(ValueError, match=rf"k={k}.*n=4"):
        pass_at_k(4, 1, k)


def test_unequal_sample_counts_are_a_data_error():
    table = _graded({"a": [True, False, True], "b": [True, False]})
    with pytest.raises(ValueError, match="different sample counts"):
        sampling_metrics(table, [1])


# ---- maj@k ----------------------------------------------------------------------------------------------------

def _voting_table() -> pl.DataFrame:
    rows = []
    plan = {  # sample_id -> [(answer_group, correct), ...] by sample_index
        "tie_wrong_first": [(5, False), (2, True), (2, True), (5, False)],
        "tie_correct_first": [(2, True), (5, False), (5, False), (2, True)],
        "nobody_votes": [(None, False)] * 4,
        "nulls_skip": [(None, False), (None, False), (None, False), (1, True)],
    }
    for sid, votes in plan.items():
        for i, (group, ok) in enumerate(votes):
            rows.append({"sample_id": sid, "sample_index": i, "answer_group": group, "correct": ok,
                         "status": "correct" if ok else ("wrong" if group is not None else "unparseable")})
    return pl.DataFrame(rows).sample(fraction=1.0, shuffle=True, seed=3)   # row order must not matter


def test_maj_at_k_tie_goes_to_earliest_group():
    per = {k: dict(per_problem_maj_at_k(_voting_table(), k).select("sample_id", "maj_at_k").iter_rows())
           for k in (1, 3, 4)}
    assert per[4]["tie_wrong_first"] == 0.0     # 2 votes each: group 5 voted first (sample 0)
    assert per[4]["tie_correct_first"] == 1.0
    assert per[3]["tie_wrong_first"] == 1.0     # first 3 samples: group 2 has 2 votes
    assert per[3]["tie_correct_first"] == 0.0
    assert per[1]["tie_wrong_first"] == 0.0
    assert per[4]["nobody_votes"] == 0.0        # no vote counts as incorrect, not as missing
    assert per[3]["nulls_skip"] == 0.0          # the only voter is sample 3, outside the first 3
    assert per[4]["nulls_skip"] == 1.0
    assert maj_at_k(_voting_table(), [3, 4]) == {"maj@3": pytest.approx(1 / 4), "maj@4": pytest.approx(2 / 4)}


def test_maj_at_k_needs_answer_groups():
    with pytest.raises(ValueError, match="assign_answer_groups"):
        maj_at_k(_graded({"a": [True]}), [1])


def test_answer_groups_with_math_verify_equivalence():
    # gold 2: one correct sample, then "0.5" and "\frac{1}{2}": by string a three-way tie that the correct answer
    # (first) wins; by value the wrong answer 1/2 has two votes and wins.
    preds = [("2", "correct"), ("0.5", "wrong"), ("\\frac{1}{2}", "wrong"), ("7", "wrong"), (None, "unparseable")]
    table = pl.DataFrame([{"sample_id": "p", "sample_index": i, "pred": pred, "status": status,
                           "correct": status == "correct"} for i, (pred, status) in enumerate(preds)])
    assert math_equivalent("0.5", "\\frac{1}{2}") and not math_equivalent("0.5", "7")
    grouped = assign_answer_groups(table)
    groups = grouped.sort("sample_index")["answer_group"].to_list()
    assert groups == [0, 1, 1, 2, None]
    assert maj_at_k(grouped, [3, 4]) == {"maj@3": 0.0, "maj@4": 0.0}
    by_string = table.with_columns(answer_group=pl.col("pred").rank("dense").cast(pl.Int64))
    assert maj_at_k(by_string, [3]) == {"maj@3": 1.0}


def test_assign_answer_groups_short_circuits_and_caches():
    calls: list[tuple[str, str]] = []

    def equivalent(a: str, b: str) -> bool:
        calls.append((a, b))
        return {a, b} == {"x", "X"}

    rows = [("a", "correct", "1"), ("a", "wrong", "x"), ("a", "wrong", "X"), ("a", "wrong", "x"),
            ("a", "correct", "one"), ("a", "timeout", None), ("a", "truncated", "x"), ("a", "wrong", "y"),
            ("b", "wrong", "X"), ("b", "wrong", "x")]
    table = pl.DataFrame([{"sample_id": sid, "sample_index": i, "status": st, "pred": pred,
                           "correct": st == "correct"} for i, (sid, st, pred) in enumerate(rows)])
    out = assign_answer_groups(table, equivalent).sort("sample_index")["answer_group"].to_list()
    assert out == [0, 1, 1, 1, 0, None, None, 2, 0, 0]
    # correct preds are never compared; "x" vs "x" is a string match; x/X is compared once although met twice;
    # y is compared once with the wrong group's representative, its first pred "x".
    assert sorted(calls) == [("X", "x"), ("x", "y")]


# ---- intervals ------------------------------------------------------------------------------------------------

def test_wilson_interval_known_values_and_shrinks():
    z = 1.959963984540054
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(z * z / (10 + z * z))   # closed form at p = 0
    small, big = wilson_interval(30, 100), wilson_interval(300, 1000)
    assert small[0] < 0.3 < small[1] and big[0] < 0.3 < big[1]
    assert big[1] - big[0] < small[1] - small[0]
    assert wilson_interval(30, 100, 0.99)[1] > small[1]
    with pytest.raises(ValueError):
        wilson_interval(5, 0)


def test_bootstrap_contains_estimate_shrinks_and_is_seeded():
    rng = np.random.default_rng(1)
    few, many = rng.random(50), rng.random(5000)
    lo, hi = bootstrap_mean_ci(few)
    assert lo < few.mean() < hi
    lo2, hi2 = bootstrap_mean_ci(many)
    assert lo2 < many.mean() < hi2 and hi2 - lo2 < (hi - lo) / 5
    assert bootstrap_mean_ci(few, seed=7) == bootstrap_mean_ci(few, seed=7)
    assert bootstrap_mean_ci(few, seed=7) != bootstrap_mean_ci(few, seed=8)


def test_bootstrap_ci_resamples_problems():
    rng = np.random.default_rng(0)
    table = _graded({f"p{i}": list(rng.random(8) < rng.random()) for i in range(60)})
    per = per_problem_pass_at_k(table, 4)["pass_at_k"]
    lo, hi = bootstrap_mean_ci(per.to_numpy())
    assert lo < per.mean() < hi


# ---- headline dict --------------------------------------------------------------------------------------------

def test_sampling_metrics_headline():
    rng = np.random.default_rng(0)
    subjects = {f"p{i}": ["Intermediate Algebra", "Geometry"][i % 2] for i in range(40)}
    problems = {sid: list(rng.random(8) < rng.random()) for sid in subjects}
    table = _graded(problems, subject=subjects, level={sid: None for sid in subjects})
    table = table.with_columns(answer_group=pl.when(pl.col("correct")).then(0).otherwise(1))
    m = sampling_metrics(table, [1, 4, 8, 16])
    assert "pass@16" not in m and "maj@16" not in m            # k > n is skipped
    assert m["pass@1"] == pytest.approx(m["avg@8"])
    assert m["pass@8"] >= m["pass@4"] >= m["pass@1"]
    assert m["pass@4"] == pytest.approx(np.mean([pass_at_k(8, int(sum(v)), 4) for v in problems.values()]))
    assert m["maj@4"] == pytest.approx(maj_at_k(table, [4])["maj@4"])
    for name in ("avg@8", "pass@1", "pass@4", "pass@8", "maj@1", "maj@4", "maj@8"):
        assert m[f"{name}_ci_low"] <= m[name] <= m[f"{name}_ci_high"], name
    ia = [sid for sid, s in subjects.items() if s == "Intermediate Algebra"]
    assert m["pass@4/subject/intermediate_algebra"] == pytest.approx(
        np.mean([pass_at_k(8, int(sum(problems[s])), 4) for s in ia]))
    assert not any("/level/" in key for key in m)                # level is all null


def test_sampling_metrics_one_sample_uses_wilson():
    table = _graded({f"p{i}": [i % 3 == 0] for i in range(30)})
    m = sampling_metrics(table, [1])
    assert (m["avg@1_ci_low"], m["avg@1_ci_high"]) == pytest.approx(wilson_interval(10, 30))
    assert "maj@1" not in m                                      # no answer groups in the table


def test_maj_vote_for_a_mixed_group_is_not_correct():
    # A caller's grouping that mixes correct and wrong samples (e.g. by string across different golds) must not
    # turn a wrong vote into a correct one: the winner counts only if all of its samples are correct.
    table = pl.DataFrame({"sample_id": ["a"] * 3, "sample_index": [0, 1, 2], "answer_group": [4, 4, 9],
                          "correct": [True, False, False], "status": ["correct", "wrong", "wrong"]})
    assert maj_at_k(table, [3]) == {"maj@3": 0.0}


@pytest.mark.parametrize("all_correct", [False, True])
def test_all_wrong_or_all_right_has_a_real_interval(all_correct):
    """0 of 500 problems right with n=4 samples each: the bootstrap of a constant has width 0, but the data only
    bound the accuracy by about 3.8/500 (the Wilson bound over problems); the interval must say so."""
    n, problems = 4, 500
    graded = pl.DataFrame({"sample_id": np.repeat([f"p{i:03d}" for i in range(problems)], n),
                           "sample_index": np.tile(np.arange(n), problems), "correct": all_correct})
    m = sampling_metrics(graded, [1, 4])
    for name in ("avg@4", "pass@1", "pass@4"):
        low, high = m[f"{name}_ci_low"], m[f"{name}_ci_high"]
        assert high - low > 0.005, (name, low, high)
        assert low <= m[name] <= high
        assert (high if not all_correct else 1 - low) == pytest.approx(wilson_interval(0, problems)[1], rel=1e-6)

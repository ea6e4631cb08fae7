"""The fixed-n paired verdicts logged on every evaluation (evaldag.decisions.paired.paired_test, best.best_verdict)
on AIME24's and AMC23's sizes (issue 54 item 5): `equivalent` needs the rare-difference bound inside the margin too,
as decide's verdict does (evaldag.decisions.sequential.rare_interval)."""

from __future__ import annotations

import numpy as np
import pytest

from evaldag.decisions import best, paired


@pytest.mark.parametrize("problems", [30, 40])
def test_a_rare_one_sided_regression_on_a_small_set_is_not_called_equivalent(problems):
    """A greedy checkpoint that breaks 2 % of problems (5 %) and fixes none, at margin 0.02 (0.05). Before:
    `equivalent` in 55 % (21 %) of runs on 30 problems and 45 % (12 %) on 40, whenever no problem differed (a
    zero-width t interval)."""
    rng = np.random.default_rng(3)
    for share in (0.02, 0.05):
        calls = [paired.paired_test(-(rng.random(problems) < share).astype(float), share, 0.05, grid=1).verdict
                 for _ in range(300)]
        assert calls.count("equivalent") <= 0.05 * len(calls), (share, calls.count("equivalent"))


@pytest.mark.parametrize("problems", [30, 40])
def test_against_the_best_of_twenty_agreement_on_a_small_set_is_not_equivalence(problems):
    assert best.best_verdict([np.zeros(problems)] * 20, 0.02).verdict == "undecided"
    assert best.best_verdict([np.zeros(problems)], 0.02).verdict == "undecided"     # one candidate: paired_test's
    assert paired.paired_test(np.zeros(problems), 0.02, grid=1).verdict == "undecided"


def test_equivalence_stays_within_reach_where_the_data_can_show_it():
    """500 problems of which a tenth differ both ways (as close checkpoints on MATH-500 do): the rare-difference
    bound is about the t interval's, so `equivalent` is still reached at margin 0.05."""
    rng = np.random.default_rng(4)
    d = np.where(rng.random(500) < 0.1, rng.choice([-1.0, 1.0], 500), 0.0)
    assert paired.paired_test(d, 0.05, grid=1).verdict == "equivalent"
    assert paired.rare_within_margin([d], 0.05, 0.05)

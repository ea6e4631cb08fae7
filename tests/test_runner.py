"""What `evaldag run` says about the figures it prints: this flow run's own, and where they came from when the
evaluation's MLflow run was logged by an earlier flow run (reused whole, or recomputed with results that differ)."""

from __future__ import annotations

import polars as pl

from evaldag.scoring.metrics import MEASUREMENT_KEYS, system_metrics
from evaldag.runtime.runner import provenance
from evaldag.pipeline.reduce import _STAT_COLUMNS
from evaldag.tracking.write import differing_results

LOGGED = {"accuracy": 0.25, "pass_at_4": 0.5, "generation_s": 100.0, "cache_hit_rate": 0.0, "step": 3.0}


def test_every_system_figure_is_a_measurement_not_a_result():
    """A system figure left out of MEASUREMENT_KEYS would make every recomputation look like other results."""
    stats = pl.DataFrame([{"shard_index": 0, **dict.fromkeys(_STAT_COLUMNS, 1.0)}])
    graded = pl.DataFrame({"latency_s": [0.5, 1.5]})
    assert set(system_metrics(stats, graded)) <= MEASUREMENT_KEYS
    assert {"reduce_s", "cache_hit_rate"} <= MEASUREMENT_KEYS and "accuracy" not in MEASUREMENT_KEYS


def test_differing_results_ignore_timings_and_map_names_to_mlflow_keys():
    same = {"accuracy": 0.25, "pass@4": 0.5, "generation_s": 80.0, "cache_hit_rate": 0.0, "reduce_s": 0.1}
    assert differing_results(same, LOGGED) == []
    assert differing_results({**same, "pass@4": 0.75}, LOGGED) == ["pass@4"]
    assert differing_results({**same, "kl/mean": 0.1}, LOGGED) == ["kl/mean"]     # missing from the logged run
    assert differing_results({"x": float("nan")}, {"x": float("nan")}) == []


def test_a_run_this_flow_logged_needs_no_explanation():
    assert provenance("fr-1", "fr-1", {"accuracy": 0.25, "cache_hit_rate": 0.0}, LOGGED) == []


def test_a_reused_evaluation_says_nothing_was_recomputed():
    assert provenance("fr-2", "fr-1", {"accuracy": 0.25, "cache_hit_rate": 1.0}, LOGGED) == [
        "this evaluation was computed and logged before: nothing was recomputed"]


def test_an_unreadable_summary_says_recomputation_is_unknown_not_that_nothing_was():
    """None: the flow run's result store is out of reach from this machine, so what it reused is not known here."""
    [line] = provenance("fr-2", "fr-1", None, LOGGED)
    assert "whether anything was recomputed is unknown here" in line and "not readable from this machine" in line
    assert "nothing was recomputed" not in line and "flow run fr-1" in line
    [line] = provenance("fr-2", "fr-1", {"accuracy": 0.25}, LOGGED)          # a summary that does not say
    assert "unknown here" in line and "no cache_hit_rate" in line


def test_a_recomputation_says_whose_figures_are_whose_and_warns_on_other_results():
    computed = {"accuracy": 0.25, "pass@4": 0.5, "generation_s": 60.0, "cache_hit_rate": 0.0}
    [line] = provenance("fr-2", "fr-1", computed, LOGGED)
    assert line.startswith("recomputed by this flow run (0% of its stages reused)") and "flow run fr-1" in line
    lines = provenance("fr-2", "fr-1", {**computed, "accuracy": 0.2}, LOGGED)
    assert lines[1:] == ["warning: accuracy differs from the logged run: 0.2 here, 0.25 logged"]


def test_evaldag_run_prints_the_logged_verdicts_after_the_metrics():
    """The verdicts track() logged (tags verdict.vs_*, metrics verdict.vs_*.diff|ci_low|ci_high|p_value|n_problems)
    become one line each, previous / best / baseline in that order; a run without them says so."""
    from evaldag.runtime.runner import verdict_lines

    tags = {"verdict.vs_best": "equivalent", "verdict.vs_best.other": "job@2",
            "verdict.vs_previous": "better", "verdict.vs_previous.other": "job@1", "train_run": "job"}
    metrics = {"verdict.vs_previous.diff": 0.3, "verdict.vs_previous.ci_low": 0.21,
               "verdict.vs_previous.ci_high": 0.39, "verdict.vs_previous.p_value": 1.86e-9,
               "verdict.vs_previous.n_problems": 100.0, "verdict.vs_best.diff": 0.0, "verdict.vs_best.ci_low": 0.0,
               "verdict.vs_best.ci_high": 0.0, "verdict.vs_best.p_value": 1.0, "verdict.vs_best.n_problems": 100.0}
    assert verdict_lines(tags, metrics) == [
        "paired verdicts (accuracy difference [interval], sign-flip p-value):",
        "  vs previous (job@1): better, +30.0 points [+21.0, +39.0], p = 1.86e-09, 100 common problems",
        "  vs best (job@2): equivalent, +0.0 points [+0.0, +0.0], p = 1, 100 common problems"]
    [none] = verdict_lines({"train_run": "job"}, {"accuracy": 0.5})
    assert none.startswith("paired verdicts: none logged")

"""Metrics on small hand-computed tables."""

from __future__ import annotations

import math

import polars as pl
import pytest

from evaldag.scoring.metrics import check_complete, system_metrics, task_metrics
from evaldag.storage.schema import GRADED_SCHEMA


def _table(rows: list[dict]) -> pl.DataFrame:
    base = {"prompt": "p", "gold": "1", "gold_raw": "1", "subject": None, "level": None, "shard_index": 0,
            "completion": "c", "prompt_tokens": 10, "completion_tokens": 5, "finish_reason": "stop",
            "latency_s": 1.0, "batch_size": 1, "pred": "1", "grade_s": 0.01, "sample_index": 0,
            "completion_ids": [1, 2], "answer_group": None}
    out = []
    for r in rows:
        row = {**base, **r}
        row["correct"] = row["status"] == "correct"
        out.append(row)
    return pl.DataFrame(out, schema=GRADED_SCHEMA)


TABLE = _table([
    {"sample_id": "a", "status": "correct", "subject": "Algebra", "level": 1, "completion_tokens": 10},
    {"sample_id": "b", "status": "wrong", "subject": "Algebra", "level": 2, "completion_tokens": 20},
    {"sample_id": "c", "status": "correct", "subject": "Number Theory", "level": 2, "completion_tokens": 30},
    {"sample_id": "d", "status": "truncated", "subject": "Number Theory", "level": 5, "completion_tokens": 512,
     "finish_reason": "length"},
    {"sample_id": "e", "status": "unparseable", "subject": "Geometry", "level": 5, "completion_tokens": 28},
])


def test_accuracy_and_rates():
    m = task_metrics(TABLE)
    assert m["accuracy"] == pytest.approx(2 / 5)
    assert m["accuracy_scored"] == pytest.approx(2 / 3)        # correct / (correct + wrong)
    assert m["rate_wrong"] == pytest.approx(1 / 5)
    assert m["truncation_rate"] == pytest.approx(1 / 5)
    assert m["rate_unparseable"] == pytest.approx(1 / 5)
    assert m["rate_timeout"] == 0.0
    assert m["n_samples"] == 5 and m["n_problems"] == 5
    assert m["mean_completion_tokens"] == pytest.approx((10 + 20 + 30 + 512 + 28) / 5)
    assert m["max_completion_tokens"] == 512


def test_breakdowns():
    m = task_metrics(TABLE)
    assert m["accuracy/subject/algebra"] == pytest.approx(0.5)
    assert m["accuracy/subject/number_theory"] == pytest.approx(0.5)
    assert m["accuracy/subject/geometry"] == 0.0
    assert m["accuracy/level/1"] == 1.0
    assert m["accuracy/level/2"] == pytest.approx(0.5)
    assert m["accuracy/level/5"] == 0.0


def test_avg_at_n_and_no_breakdown_without_fields():
    t = _table([{"sample_id": "a", "sample_index": i, "status": s}
                for i, s in enumerate(["correct", "wrong", "wrong", "correct"])]
               + [{"sample_id": "b", "sample_index": i, "status": "wrong"} for i in range(4)])
    m = task_metrics(t)
    assert m["accuracy"] == pytest.approx(2 / 8)
    assert m["n_problems"] == 2 and m["n_samples"] == 8
    assert not any(k.startswith("accuracy/") for k in m)


def test_nothing_scored_leaves_accuracy_scored_out():
    m = task_metrics(_table([{"sample_id": "a", "status": "timeout"}]))
    assert "accuracy_scored" not in m and m["accuracy"] == 0.0


def test_check_complete_catches_gaps_duplicates_and_strays():
    t = _table([{"sample_id": "a", "status": "correct"}, {"sample_id": "b", "status": "wrong"}])
    check_complete(t, ["a", "b"], n=1)
    with pytest.raises(ValueError, match="1 expected samples have no graded row"):
        check_complete(t, ["a", "b", "c"], n=1)
    with pytest.raises(ValueError, match="appear more than once"):
        check_complete(pl.concat([t, t.head(1)]), ["a", "b"], n=1)
    with pytest.raises(ValueError, match="not in the plan"):
        check_complete(t, ["a"], n=1)
    with pytest.raises(ValueError, match="no graded row"):
        check_complete(t, ["a", "b"], n=2)


def test_system_metrics():
    stats = pl.DataFrame({"shard_index": [0, 1], "generation_tokens": [1000.0, 3000.0],
                          "generation_s": [10.0, 30.0], "grading_s": [1.0, 2.0], "grading_samples": [30.0, 60.0],
                          "scoring_s": [0.0, 0.0], "model_load_s": [2.0, 2.0], "peak_rss_mb": [900.0, 1100.0],
                          "peak_gpu_mb": [0.0, 0.0]})
    graded = _table([{"sample_id": str(i), "status": "wrong", "latency_s": float(i + 1)} for i in range(100)])
    m = system_metrics(stats, graded)
    assert m["generation_tokens_per_s"] == pytest.approx(100.0)
    assert m["grading_samples_per_s"] == pytest.approx(30.0)
    assert m["shard_peak_rss_mb"] == 1100.0
    assert m["shard_generation_s_max"] == 30.0
    assert m["grading_s"] == 3.0
    assert m["latency_p50_s"] == pytest.approx(50.5)
    assert m["latency_p95_s"] == pytest.approx(95.05)
    assert m["latency_p99_s"] == pytest.approx(99.01)
    assert not math.isnan(m["model_load_s"])
    # CPU shards: per GiB of peak RSS; tokens / sum(seconds x GiB) = 4000 / (10 x 900/1024 + 30 x 1100/1024)
    assert m["generation_tokens_per_s_per_gib"] == pytest.approx(4000 / ((10 * 900 + 30 * 1100) / 1024))


def test_throughput_per_gib_reads_accelerator_memory_where_there_is_some():
    stats = pl.DataFrame({"shard_index": [0], "generation_tokens": [2048.0], "generation_s": [4.0],
                          "grading_s": [1.0], "grading_samples": [1.0], "scoring_s": [0.0], "model_load_s": [1.0],
                          "peak_rss_mb": [8192.0], "peak_gpu_mb": [2048.0]})
    graded = _table([{"sample_id": "a", "status": "wrong"}])
    assert system_metrics(stats, graded)["generation_tokens_per_s_per_gib"] == pytest.approx(2048 / 4 / 2)
    idle = stats.with_columns(pl.lit(0.0).alias("generation_s"), pl.lit(0.0).alias("generation_tokens"))
    assert "generation_tokens_per_s_per_gib" not in system_metrics(idle, graded)      # undefined, not 0

"""Reduce the graded per-sample table to metrics, with polars only.

Accuracy counts every sample in the denominator (the number papers report); the status rates next to it say how
much of the miss is wrong answers versus unparseable, timed-out or truncated completions, which are never folded
silently into "wrong".
"""

from __future__ import annotations

import re

import polars as pl

from evaldag.storage.schema import GRADE_STATUSES

# Figures of how a computation ran (time, memory, throughput, cache use), not of what it found: two computations of
# one evaluation differ in these and only these (system_metrics' keys, plus reduce's own time and the cache use).
MEASUREMENT_KEYS = frozenset({
    "generation_tokens", "generation_s", "grading_s", "scoring_s", "eval_loss_s", "model_load_s", "engine_loads",
    "shard_peak_rss_mb", "shard_peak_gpu_mb", "shard_generation_s_max", "generation_tokens_per_s",
    "generation_tokens_per_s_per_gib", "grading_samples_per_s", "latency_p50_s", "latency_p95_s", "latency_p99_s",
    "reduce_s", "cache_hit_rate",
})


def _slug(value: object) -> str:
    """MLflow metric names allow [A-Za-z0-9_-./ ]; subjects such as 'Intermediate Algebra' become intermediate_algebra."""
    return re.sub(r"[^a-z0-9]+", "_", str(value).lower()).strip("_") or "none"


def check_complete(graded: pl.DataFrame, expected_ids: list[str], n: int) -> None:
    """Fail loudly unless there is exactly one row per (sample_id, sample_index) for every expected sample."""
    keys = graded.select("sample_id", "sample_index")
    dup = keys.filter(keys.is_duplicated()).unique()
    if dup.height:
        raise ValueError(f"{dup.height} (sample_id, sample_index) pairs appear more than once, e.g. "
                         f"{dup.head(3).rows()}; a shard was counted twice")
    expected = pl.DataFrame({"sample_id": expected_ids}).join(
        pl.DataFrame({"sample_index": list(range(n))}, schema={"sample_index": pl.Int64}), how="cross")
    missing = expected.join(keys, on=["sample_id", "sample_index"], how="anti")
    if missing.height:
        raise ValueError(f"{missing.height} expected samples have no graded row, e.g. {missing.head(3).rows()}; "
                         "a shard output is missing")
    extra = keys.join(expected, on=["sample_id", "sample_index"], how="anti")
    if extra.height:
        raise ValueError(f"{extra.height} graded rows are not in the plan, e.g. {extra.head(3).rows()}")


def task_metrics(graded: pl.DataFrame) -> dict[str, float]:
    """Headline accuracy (avg@n), status rates, token statistics and breakdowns by subject and level."""
    total = graded.height
    if total == 0:
        raise ValueError("no graded samples to reduce")
    row = graded.select(
        accuracy=pl.col("correct").cast(pl.Float64).mean(),
        n_samples=pl.len(),
        n_problems=pl.col("sample_id").n_unique(),
        mean_completion_tokens=pl.col("completion_tokens").mean(),
        max_completion_tokens=pl.col("completion_tokens").max(),
        mean_prompt_tokens=pl.col("prompt_tokens").mean(),
        **{f"rate_{s}": (pl.col("status") == s).cast(pl.Float64).mean() for s in GRADE_STATUSES},
    ).row(0, named=True)
    scored = graded.filter(pl.col("status").is_in(["correct", "wrong"]))
    if scored.height:  # undefined (not 0) when nothing could be scored, so it is left out rather than faked
        row["accuracy_scored"] = scored["correct"].cast(pl.Float64).mean()
    row["truncation_rate"] = row.pop("rate_truncated")
    metrics = {k: float(v) for k, v in row.items()}
    for key in ("subject", "level"):
        if graded[key].null_count() == total:
            continue
        by = (graded.filter(pl.col(key).is_not_null())
              .group_by(key).agg(acc=pl.col("correct").cast(pl.Float64).mean(), n=pl.len()).sort(key))
        for value, acc, n in by.iter_rows():
            metrics[f"accuracy/{key}/{_slug(value)}"] = float(acc)
    return metrics


def step_metrics(graded: pl.DataFrame) -> dict[str, float]:
    """Step validity (evaldag.scoring.steps) over the completions with at least one checked step.

    step_validity: the mean over those completions of valid / checked steps (the mean of the `step_validity` reward
    over them); step_checkable_rate: their share of the completions whose steps were checked (not timed out);
    step_validity/right_answer and /wrong_answer: step_validity over those with a correct and a wrong final answer;
    right_answer_invalid_steps_rate: the share of correct completions with a checked step that hold an invalid
    one (a right answer reached through a wrong step). A figure with no completion to be over is left out.
    """
    if "steps_checked" not in graded.columns:
        return {}
    rows = graded.filter(pl.col("steps_checked").is_not_null())
    if rows.height == 0:       # graded before steps were checked, or every check overran
        return {}
    stepped = rows.filter(pl.col("steps_checked") > 0).with_columns(
        ratio=pl.col("steps_valid") / pl.col("steps_checked"),
        invalid=pl.col("steps_valid") < pl.col("steps_checked"))
    metrics = {"step_checkable_rate": stepped.height / rows.height}
    right, wrong = stepped.filter(pl.col("correct")), stepped.filter(pl.col("status") == "wrong")
    for key, part in (("step_validity", stepped), ("step_validity/right_answer", right),
                      ("step_validity/wrong_answer", wrong)):
        if part.height:
            metrics[key] = float(part["ratio"].mean())
    if right.height:
        metrics["right_answer_invalid_steps_rate"] = float(right["invalid"].cast(pl.Float64).mean())
    return metrics


def _tokens_per_s_per_gib(shard_stats: pl.DataFrame) -> float | None:
    """Generated tokens per second per GiB of the shard's peak memory: its peak accelerator memory (torch's
    max_memory_allocated in the shard's process, which holds vLLM's engine), or on a CPU shard (no accelerator
    memory) its process's peak RSS. Over several shards: all tokens / the sum of each shard's generation seconds x
    its GiB, so one shard's figure is its own. None where no shard generated (no seconds or no memory figure)."""
    gib = pl.when(pl.col("peak_gpu_mb") > 0).then(pl.col("peak_gpu_mb")).otherwise(pl.col("peak_rss_mb")) / 1024
    row = shard_stats.select(tokens=pl.col("generation_tokens").sum(),
                             gib_s=(pl.col("generation_s") * gib).sum()).row(0, named=True)
    return float(row["tokens"]) / row["gib_s"] if row["gib_s"] and row["gib_s"] > 0 else None


def system_metrics(shard_stats: pl.DataFrame, graded: pl.DataFrame) -> dict[str, float]:
    """Throughput (generation_tokens_per_s, and per GiB of peak memory: see _tokens_per_s_per_gib), latency, memory
    and stage wall times.

    `shard_stats` has one row per shard (figures written by the stages); latency percentiles are over requests
    (completions) from the graded table, where a request's latency is its own wall time on vLLM and a server, and the
    wall time of the batch that served it on transformers (evaldag.engines.base.Completion.latency_s).
    """
    row = shard_stats.select(
        generation_tokens=pl.col("generation_tokens").sum(),
        generation_s=pl.col("generation_s").sum(),
        grading_s=pl.col("grading_s").sum(),
        grading_samples=pl.col("grading_samples").sum(),
        scoring_s=pl.col("scoring_s").sum(),
        model_load_s=pl.col("model_load_s").sum(),
        shard_peak_rss_mb=pl.col("peak_rss_mb").max(),
        shard_peak_gpu_mb=pl.col("peak_gpu_mb").max(),
        shard_generation_s_max=pl.col("generation_s").max(),
    ).row(0, named=True)
    metrics = {k: float(v or 0.0) for k, v in row.items()}
    if "engine_loads" in shard_stats.columns:    # 0 for a shard whose engine was already loaded by another benchmark
        metrics["engine_loads"] = float(shard_stats["engine_loads"].sum())
    if "eval_loss_s" in shard_stats.columns and shard_stats["eval_loss_s"].sum() > 0:   # scoring reference solutions
        metrics["eval_loss_s"] = float(shard_stats["eval_loss_s"].sum())
    metrics["generation_tokens_per_s"] = (metrics["generation_tokens"] / metrics["generation_s"]
                                          if metrics["generation_s"] > 0 else 0.0)
    per_gib = _tokens_per_s_per_gib(shard_stats)
    if per_gib is not None:
        metrics["generation_tokens_per_s_per_gib"] = per_gib
    metrics["grading_samples_per_s"] = (metrics.pop("grading_samples") / metrics["grading_s"]
                                        if metrics["grading_s"] > 0 else 0.0)
    lat = graded.select(**{f"latency_p{q}_s": pl.col("latency_s").quantile(q / 100, "linear") for q in (50, 95, 99)})
    metrics.update({k: float(v) for k, v in lat.row(0, named=True).items()})
    return metrics

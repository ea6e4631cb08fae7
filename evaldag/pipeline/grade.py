"""The grade stage of a shard: its generations graded against the plan's current gold, equivalent answers grouped
for maj@k (each math-verify call bounded by the grading timeout), timed-out rows graded again on a later run; and
the grading of any rows of a plan (the parent grades a stopped evaluation's prefix with it)."""

from __future__ import annotations

import logging
import time

import polars as pl
from upath import UPath

from evaldag.pipeline import faults
from evaldag.pipeline.records import record_stage, timed_out
from evaldag.request.plan import EvalPlan
from evaldag.storage import store
from evaldag.storage.schema import GENERATION_SCHEMA, GRADED_SCHEMA, INPUT_SCHEMA, read_table, write_table

log = logging.getLogger("evaldag")


def grade_shard(plan: EvalPlan, shard: int, workers: int = 2) -> UPath:
    """Grade one shard's generations (and group equivalent answers for maj@k); write and return the graded file."""
    out = plan.graded_path(shard)
    with store.lock(out):
        if out.is_file():
            if timed_out(out):
                return _regrade_timeouts(plan, shard, out, workers)
            log.info("shard %d: grades already in %s, reusing them", shard, out)
            record_stage(plan.cache_record_path(shard), "grade", computed=False)
            return out
        return _grade(plan, shard, out, workers)


def _regrade_timeouts(plan: EvalPlan, shard: int, out: UPath, workers: int) -> UPath:
    """Grade the timed-out rows of a graded file again (the machine may have been loaded, or the limit raised) and
    rewrite the file; rows that time out again stay "timeout" until the next run."""
    from evaldag.scoring.grading import grade_table

    graded = read_table(out, GRADED_SCHEMA).with_row_index("_row")
    todo = graded.filter(pl.col("status") == "timeout")
    log.info("shard %d: grading %d timed-out rows of %s again", shard, todo.height, out)
    t0 = time.perf_counter()
    redone = grade_table(todo.drop("_row"), timeout_s=plan.benchmark.grading_timeout_s, workers=workers,
                         strip_thinking=plan.benchmark.strip_thinking).with_columns(todo["_row"])
    merged = (pl.concat([graded.filter(pl.col("status") != "timeout"), redone.select(graded.columns)])
              .sort("_row").drop("_row"))
    merged, grouping_timeouts = group_answers(plan, merged, workers)
    stats_path = plan.stats_path("grade", shard)
    stats = store.read_json(stats_path) if stats_path.is_file() else {}
    stats["grouping_timeouts"] = grouping_timeouts
    stats["grading_s"] = stats.get("grading_s", 0.0) + time.perf_counter() - t0
    stats["regraded_timeouts"] = stats.get("regraded_timeouts", 0) + todo.height
    store.write_json(stats_path, stats)
    write_table(merged, out, GRADED_SCHEMA)
    record_stage(plan.cache_record_path(shard), "grade", computed=True)
    return out


def with_current_inputs(gens: pl.DataFrame, plan: EvalPlan, shard: int) -> pl.DataFrame:
    """The generations with their input columns (gold, gold_raw, subject, level) taken from this plan's inputs.

    Generations are shared by every evaluation with the same generation_key, and the input rows copied into them are
    those of the evaluation that generated them: a gold-normalisation fix or a gold_format change since then would
    be graded against the old gold. The plan's inputs.parquet is the current truth."""
    inputs = plan.shard_inputs(shard)
    missing = set(gens["sample_id"].unique()) - set(inputs["sample_id"])
    if missing:
        raise RuntimeError(f"shard {shard}: generations hold samples {sorted(missing)[:3]} that are not in the plan's "
                           f"inputs {plan.path('inputs.parquet')}; delete {plan.generations_path(shard)} to regenerate")
    own = [c for c in INPUT_SCHEMA if c not in ("sample_id", "prompt")]
    return (gens.drop(own).join(inputs.select("sample_id", *own), on="sample_id", how="left", maintain_order="left")
            .select(list(GENERATION_SCHEMA)))


def group_answers(plan: EvalPlan, graded: pl.DataFrame, workers: int) -> tuple[pl.DataFrame, int]:
    """assign_answer_groups with every math-verify comparison bounded by the grading timeout, in a worker process
    (workers >= 1; workers=0, the debugging mode, compares in this process without a bound). A comparison that
    times out counts as "not the same answer". Returns the table and the number of comparisons cut."""
    from evaldag.scoring.grading import BoundedCalls
    from evaldag.scoring.sampling_metrics import assign_answer_groups, math_equivalent

    if workers == 0:
        return assign_answer_groups(graded), 0
    with BoundedCalls(plan.benchmark.grading_timeout_s) as calls:
        grouped = assign_answer_groups(graded, lambda a, b: calls.call(math_equivalent, a, b, default=False))
    return grouped, calls.timeouts


def grade_rows(plan: EvalPlan, gens: pl.DataFrame, workers: int = 1) -> pl.DataFrame:
    """Grade generated rows of this plan (any shards'; the parent grades a stopped evaluation's prefix with it):
    their gold taken from the plan's inputs (see with_current_inputs), answers graded and grouped for maj@k."""
    from evaldag.scoring.grading import grade_table

    own = [c for c in INPUT_SCHEMA if c not in ("sample_id", "prompt")]
    gens = (gens.drop(own).join(plan.inputs().select("sample_id", *own), on="sample_id", how="left",
                                maintain_order="left").select(list(GENERATION_SCHEMA)))
    graded = grade_table(gens, timeout_s=plan.benchmark.grading_timeout_s, workers=workers,
                         strip_thinking=plan.benchmark.strip_thinking)
    return group_answers(plan, graded, workers)[0]


def _grade(plan: EvalPlan, shard: int, out: UPath, workers: int) -> UPath:
    from evaldag.scoring.grading import grade_table

    faults.maybe_fail("grade")
    gens = with_current_inputs(read_table(plan.generations_path(shard), GENERATION_SCHEMA), plan, shard)
    t0 = time.perf_counter()
    graded = grade_table(gens, timeout_s=plan.benchmark.grading_timeout_s, workers=workers,
                         strip_thinking=plan.benchmark.strip_thinking)
    grading_s = time.perf_counter() - t0
    graded, grouping_timeouts = group_answers(plan, graded, workers)
    store.write_json(plan.stats_path("grade", shard), {"grading_s": grading_s, "grading_samples": graded.height,
                                                   "grouping_s": time.perf_counter() - t0 - grading_s,
                                                   "grouping_timeouts": grouping_timeouts})
    write_table(graded, out, GRADED_SCHEMA)
    record_stage(plan.cache_record_path(shard), "grade", computed=True)
    return out

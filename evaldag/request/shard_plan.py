"""One shard of an evaluation as its generation sees it: built once from the plan (`shard_plan`), so the code that
generates, resumes and records a shard reads its problems, sampling and files from one object instead of asking
the plan for each in turn."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl
from upath import UPath

from evaldag.request.config import SamplingConfig
from evaldag.request.plan import EvalPlan

# the stages whose figures a shard keeps beside their outputs (EvalPlan.stats_path)
STAT_STAGES = ("generate", "grade", "score", "eval_loss")


@dataclass(frozen=True)
class ShardPlan:
    """A shard of `plan`: its input rows, its sample runs, its own random stream and the files it writes."""

    plan: EvalPlan
    index: int
    inputs: pl.DataFrame                 # its problems' input rows, in the plan's order
    runs: list[tuple[int, int]]          # (first sample index, samples) of each row of `inputs`
    samples: int                         # completions it generates in all: the runs' counts summed
    sampling: SamplingConfig             # the plan's, seeded for this shard (EvalPlan.shard_sampling)
    generations: UPath
    stats: dict[str, UPath]              # stage -> its figures file (STAT_STAGES)
    cache_record: UPath                  # which of its stages were computed or reused
    unit: str                            # what its progress counts: "problems" or "samples"
    evaluation_ids: list[str]            # every problem of the evaluation, in shard order (the decision order's input)
    prompts: list[str]                   # the prompts of `inputs`
    decide: tuple[float, float, int] | None    # (alpha, margin, rounds) where the evaluation may stop early


def shard_plan(plan: EvalPlan, shard: int) -> ShardPlan:
    """Shard `shard` of `plan` (a ConfigError for an index outside the plan)."""
    inputs = plan.shard_inputs(shard)
    runs = plan.shard_runs(shard)
    return ShardPlan(plan=plan, index=shard, inputs=inputs, runs=runs, samples=sum(count for _, count in runs),
                     sampling=plan.shard_sampling(shard), generations=plan.generations_path(shard),
                     stats={stage: plan.stats_path(stage, shard) for stage in STAT_STAGES},
                     cache_record=plan.cache_record_path(shard), unit=plan.progress_unit,
                     evaluation_ids=plan.sample_ids(), prompts=inputs["prompt"].to_list(),
                     decide=plan.decide_settings)

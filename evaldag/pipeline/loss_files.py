"""Where a shard's eval-loss file is (evaldag.pipeline.eval_loss) and whether the plan asks for one: read by the
stage itself and by evaldag.pipeline.records (whether a shard is done)."""

from __future__ import annotations

import polars as pl
from upath import UPath

from evaldag.request.plan import EvalPlan
from evaldag.storage import store

STAGE = "eval_loss"


def wanted(plan: EvalPlan) -> bool:
    """Whether this plan's shards score reference solutions: asked for, and the first round (an adaptive
    evaluation's second round draws more samples of problems whose losses the first round has)."""
    return plan.eval_loss and plan.round == 1


# (eval_key, shard) -> (sample ids, prompts, reference texts): the parent asks every shard's file (shard_done) and
# a shard asks several times; each would read the dataset again
_SOLUTIONS: dict[tuple[str, int], tuple[list[str], list[str], list[str]]] = {}


def solutions(plan: EvalPlan, shard: int, inputs: pl.DataFrame | None = None) -> tuple[list[str], list[str], list[str]]:
    """(sample ids, prompts, reference texts) of the shard's problems, in the plan's order (`inputs`: the shard's
    input rows where the caller has them, EvalPlan.shard_inputs)."""
    from evaldag.request.datasets import load_solutions
    from evaldag.scoring.eval_loss import reference_text

    key = (plan.eval_key, shard)
    if key not in _SOLUTIONS:
        inputs = plan.shard_inputs(shard) if inputs is None else inputs
        ids, prompts = inputs["sample_id"].to_list(), inputs["prompt"].to_list()
        raw = load_solutions(plan.benchmark, ids)
        if len(_SOLUTIONS) > 256:           # a long-lived process (a worker) evaluates many plans
            _SOLUTIONS.clear()
        _SOLUTIONS[key] = ids, prompts, [reference_text(s, plan.benchmark.gold_format) for s in raw]
    return _SOLUTIONS[key]


def missing(plan: EvalPlan, shard: int) -> bool:
    """Whether the plan asks for eval_loss and the shard's loss file is not there yet."""
    return wanted(plan) and not loss_path(plan, shard).is_file()


def loss_path(plan: EvalPlan, shard: int, digest: str | None = None) -> UPath:
    """The shard's loss file (its name holds the solutions' digest; computed here when not given)."""
    from evaldag.scoring.eval_loss import solutions_digest

    if digest is None:
        ids, _, texts = solutions(plan, shard)
        digest = solutions_digest(ids, texts)
    return store.as_path(plan.stage_dir) / f"evalloss-{digest[:12]}-{shard:04d}-of-{plan.num_shards:04d}.parquet"

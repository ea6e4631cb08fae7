"""The eval-loss stage of a shard, where the plan asks for eval_loss: its problems' reference solutions scored after
their prompts by the shard's engine (evaldag.scoring.eval_loss), one row per problem in a file of the shard's own.

The file sits beside the shard's generations, named after the solutions' digest (version, ids and texts: the
generation key covers model, engine, prompts and shards but not a solution column), and is written atomically: a
resumed or re-run shard finds it and scores nothing again. The engine is the one the shard generated with: the
shard flow sizes its load for the generation and this scoring together (`loss_workload`), so no second load.
"""

from __future__ import annotations

import logging
import time

import polars as pl
from upath import UPath

from evaldag.pipeline.loss_files import STAGE, loss_path, solutions, wanted
from evaldag.pipeline.records import peak_rss_mb, record_stage
from evaldag.request.plan import EvalPlan
from evaldag.request.shard_plan import ShardPlan
from evaldag.storage import store
from evaldag.storage.schema import read_table, write_table

log = logging.getLogger("evaldag")


def loss_workload(shard: ShardPlan):
    """What scoring the shard's solutions asks of a self-sizing engine (vLLM): the longest prompt + solution, all
    problems at once, greedy (one token is generated per request and thrown away); None for other engines or when
    the plan asks for no eval_loss."""
    from evaldag import engines
    from evaldag.engines.base import chat_text
    from evaldag.engines.workload import Workload

    plan, model = shard.plan, shard.plan.model
    # engines.workload is None for an engine that does not size itself (whatever the prompt)
    if not wanted(plan) or engines.workload(model, ["sized?"], plan.sampling) is None:
        return None
    ids, prompts, texts = solutions(plan, shard.index, shard.inputs)
    tok = engines.tokenizer_of(model)
    lengths = tok([chat_text(tok, p) for p in prompts], add_special_tokens=False)["input_ids"]
    sols = tok(texts, add_special_tokens=False)["input_ids"]
    return Workload(context_tokens=max(len(p) + len(s) for p, s in zip(lengths, sols)) + 1,
                    sequences=len(ids), greedy=True)


def eval_loss_shard(shard: ShardPlan, engine=None) -> UPath | None:
    """Score the shard's reference solutions (or find them scored) and return the loss file; None when the plan
    asks for no eval_loss. `engine`: the one already loaded for the shard; else it is taken from
    evaldag.engines.engine_for (the kept one in a shard flow)."""
    from evaldag.scoring.eval_loss import LOSS_SCHEMA, per_problem_losses, score_solutions, solutions_digest

    plan = shard.plan
    if not wanted(plan):
        return None
    ids, prompts, texts = solutions(plan, shard.index, shard.inputs)
    out = loss_path(plan, shard.index, solutions_digest(ids, texts))
    with store.lock(out):
        if out.is_file():
            record_stage(shard.cache_record, STAGE, computed=False)
            return out
        t0 = time.perf_counter()
        if engine is not None:
            logprobs = score_solutions(engine, prompts, texts)
        else:
            from evaldag.engines import engine_for

            with engine_for(plan.model, loss_workload(shard)) as got:
                logprobs = score_solutions(got.engine, prompts, texts)
        write_table(per_problem_losses(ids, logprobs), out, LOSS_SCHEMA)
        seconds = time.perf_counter() - t0
        store.write_json(shard.stats[STAGE], {"eval_loss_s": seconds, "peak_rss_mb": peak_rss_mb()})
        log.info("shard %d: reference solutions of %d problems scored in %.1f s", shard.index, len(ids), seconds)
    record_stage(shard.cache_record, STAGE, computed=True)
    return out


def read_losses(plan: EvalPlan, sample_ids: list[str]) -> pl.DataFrame | None:
    """The per-problem losses (LOSS_SCHEMA) of `sample_ids` from the shards' loss files, or None when the plan asks
    for none or some problem has none (a shard stopped early, evaldag.decisions.decide, scores nothing)."""
    from evaldag.scoring.eval_loss import LOSS_SCHEMA

    if not wanted(plan):
        return None
    paths = [loss_path(plan, shard) for shard in range(plan.num_shards)]
    found = [read_table(p, LOSS_SCHEMA) for p in paths if p.is_file()]
    losses = pl.concat(found).unique("sample_id", keep="first") if found else pl.DataFrame(schema=LOSS_SCHEMA)
    losses = losses.filter(pl.col("sample_id").is_in(sample_ids))
    if losses.height < len(set(sample_ids)):
        log.warning("%s: %d of %d problems have a scored reference solution; eval_loss left out",
                    plan.benchmark.name, losses.height, len(set(sample_ids)))
        return None
    return losses

"""The generate stage of a shard: its completions, made durable in chunks while they come (evaldag.pipeline.chunks)
by one of the two ways of running a shard on an engine (evaldag.pipeline.shard_runs), merged into the generations
file; a shard whose generations exist reuses them. With the same engine, where the plan asks for eval_loss, its
reference solutions are scored (evaldag.pipeline.eval_loss); then, where the plan names a reference model, the score
stage (evaldag.pipeline.score)."""

from __future__ import annotations

import logging
import time

from upath import UPath

from evaldag.pipeline.chunks import merge_chunks, tokens_of
from evaldag.pipeline.eval_loss import eval_loss_shard, loss_workload
from evaldag.pipeline.progress import ShardProgress
from evaldag.pipeline.records import peak_gpu_mb, peak_rss_mb, record_stage
from evaldag.pipeline.score import score_shard
from evaldag.pipeline.shard_runs import PerBatch, PerRequest, Progress, check_context
from evaldag.request.plan import EvalPlan
from evaldag.request.shard_plan import ShardPlan, shard_plan
from evaldag.storage import store
from evaldag.storage.schema import GENERATION_SCHEMA, write_table

log = logging.getLogger("evaldag")


def generate_shard(plan: EvalPlan, shard: int, progress: Progress | None = None) -> UPath | None:
    """Generate `n` completions for every problem of one shard; write and return the generations file, or None when
    the evaluation was decided early and its parent asked the shard to stop (evaldag.decisions.decide; what was generated
    stays in the shard's chunks for a later evaluation).

    When the plan names a reference model, also score the completions under both models (log-probs for KL).
    `progress`, when given, hears how many of the shard's samples are done and how many tokens were generated,
    while it generates (see Progress).
    """
    this = shard_plan(plan, shard)
    out = this.generations
    with store.lock(out):
        if out.is_file():
            log.info("shard %d: generations already in %s, reusing them", shard, out)
            record_stage(this.cache_record, "generate", computed=False)
            if progress is not None:     # its tokens too: a retried shard's count must not fall back to 0
                progress(ShardProgress(this.samples, this.samples, tokens_of(out), tokens_left=0, seconds_left=0.0,
                                       unit=this.unit))
        else:
            if not _generate(this, progress):
                return None
            record_stage(this.cache_record, "generate", computed=True)
    eval_loss_shard(this)     # generations found done: the reference solutions may not be scored yet
    if plan.reference is not None:
        score_shard(plan, shard)
    return out


def _generate(shard: ShardPlan, progress: Progress | None = None) -> bool:
    """Generate the shard's missing completions, made durable as parquet chunks while they come (a shard killed
    midway, by node loss, OOM or kill -9, resumes from its chunks and loses at most one chunk's worth), then merge
    the chunks into its generations file. An engine that reports per request (generate_requests: vLLM) gets every
    missing request at once and its rows are written in chunks of finished requests (PerRequest); a static-batch
    engine gets every missing batch (Engine.generate_batches) and each batch is written as it completes (PerBatch).
    Seeds are per request or per batch, never per chunk, so the resumed output equals an uninterrupted one. Returns
    False when it stopped on its parent's request (evaldag.decisions.decide) before the end: the chunks stay,
    nothing is merged."""
    from evaldag.engines import engine_for
    from evaldag.request.checkpoint import check_unchanged

    plan = shard.plan
    chunks = store.chunks_dir(shard.generations)
    t0 = time.perf_counter()
    check_unchanged(plan.model)          # before the tokenizer and the engine read the folder
    with engine_for(plan.model, workload(shard)) as got:
        load_s = time.perf_counter() - t0
        if got.loaded:      # and after: weights rewritten while the engine read them are caught here
            check_unchanged(plan.model)
        mode = PerRequest if hasattr(got.engine, "generate_requests") else PerBatch
        run = mode(shard, got.engine, chunks, progress)
        if run.todo:
            check_context(plan, got.engine, shard.prompts)
        run.generate()
        if not run.stopped:     # with the engine at hand (sized for it: workload), not a second load
            eval_loss_shard(shard, got.engine)
    if run.stopped:
        log.info("shard %d: stopped at its parent's request (the evaluation is decided); %d of %d problems "
                 "generated, kept in %s", shard.index, run.done, len(run.prompts), chunks)
        return False
    write_table(merge_chunks(chunks, shard.inputs, shard.runs, shard.index), shard.generations, GENERATION_SCHEMA)
    store.write_json(shard.stats["generate"], {
        "model_load_s": load_s, "engine_loads": int(got.loaded), "generation_s": run.seconds,
        "generation_tokens": float(run.tokens), **run.resumed,
        "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": peak_gpu_mb()})
    store.remove_tree(chunks)
    return True


def workload(shard: ShardPlan):
    """What generating this shard asks of the engine (an evaldag.engines.Workload), for engines that size themselves
    to it; None for the others."""
    from evaldag import engines

    need = engines.workload(shard.plan.model, shard.prompts, shard.plan.sampling, shard.samples)
    scoring = loss_workload(shard)        # the reference solutions, scored on the same load
    return need if scoring is None else scoring.covering(need)

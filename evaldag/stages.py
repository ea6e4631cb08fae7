"""The per-shard stages (generate, grade) and the reduce stage, as plain functions over plan and files.

Each stage reads the previous stage's file and writes its own; a stage whose output file already exists returns
it without recomputing (outputs are written atomically and their paths derive from the eval_key, so an existing
file is always a complete result of the same inputs).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path

import polars as pl

from evaldag import metrics as metricsmod
from evaldag.plan import EvalPlan
from evaldag.schema import GENERATION_SCHEMA, GRADED_SCHEMA, read_table, write_table

log = logging.getLogger("evaldag")


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the peak of this process, i.e. of this shard's flow run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _update_stats(plan: EvalPlan, shard: int, **fields: float) -> None:
    path = plan.stats_path(shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    stats = json.loads(path.read_text()) if path.is_file() else {"shard_index": shard}
    stats.update(fields)
    stats["peak_rss_mb"] = max(stats.get("peak_rss_mb", 0.0), _peak_rss_mb())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stats, indent=2))
    tmp.replace(path)


def generate_shard(plan: EvalPlan, shard: int) -> Path:
    """Generate `n` completions for every problem of one shard; write and return the generations file."""
    out = plan.generations_path(shard)
    if out.is_file():
        log.info("shard %d: generations already in %s, reusing them", shard, out)
        return out
    from evaldag.engines import load_engine

    inputs = plan.shard_inputs(shard)
    model = plan.resolved_model
    t0 = time.perf_counter()
    engine = load_engine(model.engine, model.path, model.dtype, model.batch_size)
    load_s = time.perf_counter() - t0

    def progress(done: int, total: int, tokens: int, secs: float) -> None:
        log.info("shard %d: %d/%d prompts, %d tokens, %.0f tok/s", shard, done, total, tokens,
                 tokens / secs if secs else 0.0)

    t1 = time.perf_counter()
    completions = engine.generate(inputs["prompt"].to_list(), plan.sampling, progress=progress)
    gen_s = time.perf_counter() - t1
    engine.close()
    rows = []
    for rec, comps in zip(inputs.iter_rows(named=True), completions):
        for k, c in enumerate(comps):
            rows.append({**rec, "sample_index": k, "shard_index": shard, "completion": c.text,
                         "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                         "finish_reason": c.finish_reason, "latency_s": c.latency_s, "batch_size": c.batch_size})
    df = pl.DataFrame(rows, schema=GENERATION_SCHEMA)
    _update_stats(plan, shard, model_load_s=load_s, generation_s=gen_s,
                  generation_tokens=float(df["completion_tokens"].sum()))
    return write_table(df, out, GENERATION_SCHEMA)


def grade_shard(plan: EvalPlan, shard: int, workers: int = 2) -> Path:
    """Grade one shard's generations; write and return the graded file."""
    out = plan.graded_path(shard)
    if out.is_file():
        log.info("shard %d: grades already in %s, reusing them", shard, out)
        return out
    from evaldag.grading import grade_table

    gens = read_table(plan.generations_path(shard), GENERATION_SCHEMA)
    t0 = time.perf_counter()
    graded = grade_table(gens, timeout_s=plan.benchmark.grading_timeout_s, workers=workers)
    _update_stats(plan, shard, grading_s=time.perf_counter() - t0)
    return write_table(graded, out, GRADED_SCHEMA)


def reduce_results(plan: EvalPlan, graded_paths: list[str | Path]) -> dict:
    """Merge the shards' graded files, check completeness, compute metrics; write samples.parquet + metrics.json."""
    t0 = time.perf_counter()
    graded = pl.concat([read_table(p, GRADED_SCHEMA) for p in graded_paths])
    expected = [sid for shard in plan.shards for sid in shard]
    metricsmod.check_complete(graded, expected, plan.sampling.n)
    graded = graded.sort(["sample_id", "sample_index"])
    stats = pl.DataFrame([json.loads(plan.stats_path(i).read_text()) for i in range(plan.num_shards)])
    for col in ("model_load_s", "generation_s", "generation_tokens", "grading_s", "peak_rss_mb"):
        if col not in stats.columns:
            stats = stats.with_columns(pl.lit(0.0).alias(col))
    result = {**metricsmod.task_metrics(graded), **metricsmod.system_metrics(stats)}
    result["reduce_s"] = time.perf_counter() - t0
    write_table(graded, plan.path("samples.parquet"), GRADED_SCHEMA)
    plan.path("metrics.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return result

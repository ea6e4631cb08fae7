"""The reduce stage: the shards' graded files merged and checked complete, every metric computed (adaptive rounds,
KL, eval_loss, plugins, the shard diagnostic, a sequential verdict's figures), samples.parquet and metrics.json written."""

from __future__ import annotations

import math
import time
from os import PathLike

import polars as pl

from evaldag.decisions import adaptive as adaptive_metrics
from evaldag.decisions import decide
from evaldag.decisions.verdicts import PROBLEM_SCORE
from evaldag.pipeline.eval_loss import read_losses
from evaldag.pipeline.grade import group_answers
from evaldag.pipeline.loss_files import STAGE as LOSS_STAGE
from evaldag.request.plan import EvalPlan, load_plan
from evaldag.request.second_round import second_round_path
from evaldag.scoring import metrics as metricsmod
from evaldag.storage import store
from evaldag.storage.schema import GRADED_SCHEMA, LOGPROB_SCHEMA, read_table


_STAT_COLUMNS = ("model_load_s", "engine_loads", "generation_s", "generation_tokens", "grading_s", "grading_samples", "scoring_s",
                 "eval_loss_s", "peak_rss_mb", "peak_gpu_mb")


def _stats_table(plan: EvalPlan) -> pl.DataFrame:
    """One row per shard with every stage's figures (missing figures are 0: e.g. no scoring without reference)."""
    rows = []
    for i in range(plan.num_shards):
        row: dict = {"shard_index": i, **dict.fromkeys(_STAT_COLUMNS, 0.0)}
        for stage in ("generate", "grade", "score", LOSS_STAGE):
            path = plan.stats_path(stage, i)
            if path.is_file():
                stats = store.read_json(path)
                row["peak_rss_mb"] = max(row["peak_rss_mb"], stats.pop("peak_rss_mb", 0.0))
                row.update(stats)
        rows.append(row)
    return pl.DataFrame(rows)


def _cache_hit_rate(*plans: EvalPlan) -> float:
    """Share of the stages of every shard of `plans` (an adaptive evaluation's rounds) found done."""
    states = [v for plan in plans for i in range(plan.num_shards) if plan.cache_record_path(i).is_file()
              for v in store.read_json(plan.cache_record_path(i)).values()]
    return sum(s == "reused" for s in states) / len(states) if states else 0.0


def _adaptive_figures(plan: EvalPlan, graded: pl.DataFrame) -> tuple[dict[str, float], pl.DataFrame]:
    """An adaptive evaluation's figures and per-problem estimates (evaldag.decisions.adaptive.evaluation_metrics);
    raises unless its rows are exactly what its rounds planned."""
    try:
        counts = adaptive_metrics.counts_from_samples(graded, plan.request.adaptive.n0)
        return adaptive_metrics.evaluation_metrics(counts, plan.request.adaptive)
    except ValueError as e:
        raise ValueError(f"{plan.benchmark.name}: the adaptive rounds' rows are not what their plans ask for "
                         f"({e}); a second-round shard's graded file is missing or counted twice") from None


def _second_round(plan: EvalPlan) -> list[EvalPlan]:
    """The second round's plan of an adaptive evaluation, where it drew one (evaldag.request.second_round)."""
    path = second_round_path(plan)
    return [load_plan(path)] if path.is_file() else []


def _rounds(plan: EvalPlan, graded: pl.DataFrame, expected: list[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the first round's rows, all rows), sorted, answer groups made per problem; raises unless the first round is
    complete. The first round is every row but where the evaluation is adaptive: then its n0 = sampling.n samples of
    every problem; the second round's (indices n0 on, evaldag.request.second_round) are checked by the estimate."""
    n = plan.sampling.n
    graded = graded.sort(["sample_id", "sample_index"])
    first = graded if plan.request.adaptive is None else graded.filter(pl.col("sample_index") < n)
    metricsmod.check_complete(first, expected, n)
    if plan.sample_runs is not None or plan.request.adaptive is not None:
        # a problem's samples come from several shards (or rounds), whose graders numbered answer groups each on
        # its own: maj@k must vote over groups of the whole problem, and samples.parquet's groups span it. Rows
        # are in sample order, so the first round's groups are the same whether the later rows are grouped or not.
        graded = group_answers(plan, graded.drop("answer_group"), workers=1)[0]
        first = graded if plan.request.adaptive is None else graded.filter(pl.col("sample_index") < n)
    return first, graded


def _kl_figures(plan: EvalPlan) -> dict:
    """The KL figures of an evaluation with a reference model, from its shards' log-probs."""
    from evaldag.scoring.kl import kl_metrics

    logprobs = pl.concat([read_table(plan.logprobs_path(i), LOGPROB_SCHEMA) for i in range(plan.num_shards)])
    return kl_metrics(logprobs, sampling=plan.sampling)


def _samples(plan: EvalPlan, graded: pl.DataFrame, scores: pl.DataFrame | None,
             losses: pl.DataFrame | None) -> pl.DataFrame:
    """samples.parquet's rows: the graded rows with their reward and, where there are, each problem's adaptive
    score and eval loss."""
    from evaldag.scoring.rewards import combined_reward

    samples = graded.with_columns(combined_reward(plan.benchmark.rewards).alias("reward"))
    if scores is not None:        # what paired verdicts compare per problem (evaldag.decisions.verdicts)
        samples = samples.join(scores, on="sample_id", how="left", maintain_order="left")
    if losses is not None:        # each problem's loss on its rows: what the job's eval_loss_jump pairs
        samples = samples.join(losses, on="sample_id", how="left", maintain_order="left")
    return samples


def reduce_results(plan: EvalPlan, graded_paths: list[str | PathLike], only: list[str] | None = None) -> dict:
    """Merge the shards' graded files, check completeness, compute every metric and the shard diagnostic;
    write samples.parquet (with per-sample rewards) and metrics.json; return the metrics. `only`: the problems the
    metrics are over when not all of the plan's (an evaluation stopped early: its prefix, evaldag.decisions.decide)."""
    from evaldag.scoring.diagnostics import shard_disagreement
    from evaldag.scoring.rewards import reward_metrics
    from evaldag.scoring.sampling_metrics import sampling_metrics

    t0 = time.perf_counter()
    graded = pl.concat([read_table(p, GRADED_SCHEMA) for p in graded_paths])
    expected = plan.sample_ids() if only is None else only
    adaptive = plan.request.adaptive
    first, graded = _rounds(plan, graded, expected)
    plans = [plan] if adaptive is None else [plan, *_second_round(plan)]
    # pass@k, maj@k, by subject and level, rewards: over the first round, where every problem has n samples alike
    result = {
        **metricsmod.task_metrics(first),
        **metricsmod.step_metrics(first),
        **sampling_metrics(first, plan.pass_k),
        **reward_metrics(first, plan.benchmark.rewards),
        **metricsmod.system_metrics(pl.concat([_stats_table(p) for p in plans]), graded),
        "cache_hit_rate": _cache_hit_rate(*plans),
    }
    n = plan.sampling.n    # accuracy is avg@n: give it avg@n's interval under its own name too
    result["accuracy_ci_low"], result["accuracy_ci_high"] = result[f"avg@{n}_ci_low"], result[f"avg@{n}_ci_high"]
    scores = None
    if adaptive is not None:      # accuracy is the adaptive estimate over both rounds
        figures, per_problem = _adaptive_figures(plan, graded)
        result.update(figures)
        # rewards are over the first round: their standard error is over its samples, not all of them
        result["reward/se"] = result.get("reward/std", float("nan")) / math.sqrt(first.height)
        scores = per_problem.rename({"estimate": PROBLEM_SCORE})
    if plan.reference is not None:
        result.update(_kl_figures(plan))
    losses = read_losses(plan, expected)        # None: no eval_loss asked for, or not every problem scored
    if losses is not None:
        from evaldag.scoring.eval_loss import eval_loss_metrics, with_loss

        result.update(eval_loss_metrics(losses))
        losses = with_loss(losses).select("sample_id", "eval_loss")
    if plan.benchmark.metrics:    # a team's own statistics (evaldag.scoring.plugins), over the first round too
        from evaldag.scoring.plugins import plugin_metrics

        taken = {*result, "reduce_s", "shard_disagreement_p"}
        result.update(plugin_metrics(first, plan.benchmark.metrics, taken=taken))
    diagnostic = shard_disagreement(first, num_shards=plan.num_shards) if plan.num_shards > 1 else None
    if diagnostic is not None:
        result["shard_disagreement_p"] = float(diagnostic.details.get("p_value", 1.0))
    samples = _samples(plan, graded, scores, losses)
    store.write_parquet(plan.path("samples.parquet"), samples.drop("completion_ids"))
    if plan.request.decide is not None and (decision := decide.Decision.load(plan)) is not None:
        # the sequential verdict's figures (decide.*): metrics.json holds all the MLflow run gets, so sync logs them
        result.update(decision.metrics())
    result["reduce_s"] = time.perf_counter() - t0
    store.write_json(plan.path("metrics.json"), result)
    if diagnostic is not None:
        store.write_json(plan.path("diagnostics.json"), {"shard_disagreement": diagnostic.__dict__})
    return result

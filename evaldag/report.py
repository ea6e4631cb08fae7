"""Human-readable summaries of an evaluation (Prefect markdown artifact, CLI output)."""

from __future__ import annotations

from evaldag.plan import EvalPlan


def summary_markdown(plan: EvalPlan, metrics: dict, mlflow_url: str | None) -> str:
    """A short markdown report: headline metrics, status breakdown, system figures, link to MLflow."""
    m = metrics
    lines = [
        f"# {plan.resolved_model.name} on {plan.benchmark.name} (step {plan.request.step})",
        "",
        f"**accuracy {m['accuracy']:.2%}** over {int(m['n_samples'])} samples of {int(m['n_problems'])} problems",
        "",
        "| status | rate |", "|---|---|",
        *(f"| {s} | {m[k]:.2%} |" for s, k in [("correct", "rate_correct"), ("wrong", "rate_wrong"),
                                               ("unparseable", "rate_unparseable"), ("timeout", "rate_timeout"),
                                               ("truncated", "truncation_rate")]),
        "",
        f"generation {m['generation_tokens_per_s']:.0f} tok/s, {m['generation_s']:.0f} s over {plan.num_shards} "
        f"shards; mean completion {m['mean_completion_tokens']:.0f} tokens; shard peak RSS "
        f"{m['shard_peak_rss_mb']:.0f} MB",
        "",
        f"eval_key `{plan.eval_key[:16]}`, results in `{plan.result_dir}`",
    ]
    if mlflow_url:
        lines.append(f"\n[MLflow run]({mlflow_url})")
    return "\n".join(lines)

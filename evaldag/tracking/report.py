"""Human-readable summaries of an evaluation (Prefect markdown and table artifacts, CLI output)."""

from __future__ import annotations

from evaldag.scoring.diagnostics import Diagnostic, to_markdown
from evaldag.request.plan import EvalPlan


def _fmt(m: dict, key: str, pct: bool = True) -> str:
    if key not in m:
        return "-"
    value = f"{m[key]:.2%}" if pct else f"{m[key]:.4g}"
    lo, hi = m.get(f"{key}_ci_low"), m.get(f"{key}_ci_high")
    if lo is not None and hi is not None:
        value += f" [{lo:.2%}, {hi:.2%}]" if pct else f" [{lo:.4g}, {hi:.4g}]"
    return value


def _reward(m: dict) -> str:
    """'mean ± std'; the mean alone where the std is undefined (one sample: evaldag.scoring.rewards leaves it out)."""
    mean = f"{m.get('reward/mean', 0):.4g}"
    return f"{mean} ± {m['reward/std']:.4g}" if "reward/std" in m else f"{mean} (one sample: no std)"


def summary_markdown(plan: EvalPlan, metrics: dict, mlflow_url: str | None,
                     diagnostics: list[Diagnostic] | None = None) -> str:
    """A short markdown report: headline metrics with intervals, status breakdown, system figures, diagnostics."""
    m = metrics
    n = plan.sampling.n
    lines = [
        f"# {plan.model.name} on {plan.benchmark.name} (run {plan.train_run}, step {plan.request.step})",
        "",
        f"**accuracy {m['accuracy']:.2%}** over {int(m['n_samples'])} samples of {int(m['n_problems'])} problems",
        "",
        "| metric | value [95% interval] |", "|---|---|",
        f"| avg@{n} | {_fmt(m, f'avg@{n}')} |",
        *(f"| pass@{k} | {_fmt(m, f'pass@{k}')} |" for k in plan.pass_k),
        *(f"| maj@{k} | {_fmt(m, f'maj@{k}')} |" for k in plan.pass_k if f"maj@{k}" in m),
        f"| reward (mean ± std) | {_reward(m)} |",
        *(f"| KL {e} (per token) | {m[f'kl/{e}/token_mean']:.4g} |" for e in ("k1", "k3")
          if f"kl/{e}/token_mean" in m),
        "",
        "| status | rate |", "|---|---|",
        *(f"| {s} | {m[k]:.2%} |" for s, k in [("correct", "rate_correct"), ("wrong", "rate_wrong"),
                                               ("unparseable", "rate_unparseable"), ("timeout", "rate_timeout"),
                                               ("truncated", "truncation_rate")]),
        "",
        f"generation {m['generation_tokens_per_s']:.0f} tok/s, {m['generation_s']:.0f} s over {plan.num_shards} "
        f"shards; grading {m['grading_samples_per_s']:.0f} samples/s; latency p50/p95/p99 "
        f"{m['latency_p50_s']:.1f}/{m['latency_p95_s']:.1f}/{m['latency_p99_s']:.1f} s; mean completion "
        f"{m['mean_completion_tokens']:.0f} tokens; shard peak RSS {m['shard_peak_rss_mb']:.0f} MB; "
        f"cache hit rate {m['cache_hit_rate']:.0%}",
        "",
        f"eval_key `{plan.eval_key[:16]}`, results in `{plan.result_dir}`",
    ]
    if diagnostics:
        lines += ["", "## Diagnostics", "", to_markdown(diagnostics)]
    if mlflow_url:
        lines.append(f"\n[MLflow run]({mlflow_url})")
    return "\n".join(lines)


def headline_table(plan: EvalPlan, metrics: dict, mlflow_url: str | None) -> list[dict]:
    """Rows for a Prefect table artifact: the headline figures and the link to the MLflow run."""
    keys = ["accuracy", *(f"pass@{k}" for k in plan.pass_k), *(f"maj@{k}" for k in plan.pass_k),
            "reward/mean", "truncation_rate", "generation_tokens_per_s",
            "adaptive_set_ci_width", "adaptive_samples_per_problem"]   # the last two: adaptive samples only
    rows = [{"metric": k, "value": round(float(metrics[k]), 6)} for k in keys if k in metrics]
    rows.append({"metric": "mlflow_run", "value": mlflow_url or "(MLflow tracking URI is not an http server)"})
    return rows

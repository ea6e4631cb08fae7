"""Paired verdicts of training jobs' evaluations (the statistics of one paired comparison: evaldag.decisions.paired).

`pair_job_evaluations` compares every evaluation of each training job with the job's previous checkpoint, its best
checkpoint so far (evaldag.decisions.best: one definition of both, and a verdict against the best that accounts for
its selection) and an optional named baseline; `evaldag compare --verdicts` prints it.
`job_verdicts` does the same for one evaluation as it is tracked (evaldag.tracking.write calls it once the run's
metrics are logged), and `log_verdicts` writes the result as MLflow tags and metrics; `logged_verdict_lines` reads them
back for `evaldag run`. The margin and level of those come from EVALDAG_VERDICT_MARGIN and EVALDAG_VERDICT_ALPHA.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping

import polars as pl

from evaldag.decisions import best
from evaldag.decisions.paired import (PROBLEM_SCORE, VERDICTS, PairedVerdict, compare_scores, paired_differences,
                                      paired_test, per_problem_scores, read_scored_samples, sign_flip_p_value,
                                      verdict_from_interval)

# The evaluations a tracked run is compared with, in the order they are logged and printed.
REFERENCES = ("previous", "best", "baseline")
MARGIN_ENV, ALPHA_ENV = "EVALDAG_VERDICT_MARGIN", "EVALDAG_VERDICT_ALPHA"
DEFAULT_MARGIN, DEFAULT_ALPHA = 0.02, 0.05


# --------------------------------------------------------------------------------------------------------------
# Pairing the evaluations of training jobs
# --------------------------------------------------------------------------------------------------------------

def evaluations(benchmarks: list[str] | None = None, train_run: str | list[str] | None = None,
                client=None) -> pl.DataFrame:
    """Finished evaluation runs from MLflow: run_id, train_run, step, benchmark, comparison_key, checkpoint, model,
    start (ms). The latest run per (job, step, benchmark, comparison key) is kept: a re-evaluation supersedes."""
    from evaldag.tracking.client import all_runs
    from evaldag.tracking.names import COMPARISON_TAG, EXPERIMENT_PREFIX, stopped_early

    if client is None:
        from mlflow import MlflowClient

        client = MlflowClient()
    exps = [e for e in client.search_experiments() if e.name.startswith(f"{EXPERIMENT_PREFIX}-")]
    if benchmarks:
        exps = [e for e in exps if e.name.removeprefix(f"{EXPERIMENT_PREFIX}-") in benchmarks]
    jobs = [train_run] if isinstance(train_run, str) else list(train_run or [])
    rows = []
    if exps:
        for r in all_runs(client, [e.experiment_id for e in exps],
                          filter_string="tags.kind = 'ckpt_eval' and attributes.status = 'FINISHED'"):
            t = r.data.tags
            # the baseline may belong to another job, so every job is read and the filter applies to the rows
            rows.append({"run_id": r.info.run_id, "stopped": stopped_early(t),
                         "train_run": t.get("train_run", t.get("model", "?")),
                         "step": int(t.get("step", "0") or 0), "benchmark": t.get("benchmark", "?"),
                         "comparison_key": t.get(COMPARISON_TAG), "checkpoint": t.get("checkpoint"),
                         "model": t.get("model"), "start": r.info.start_time,
                         "asked": not jobs or t.get("train_run") in jobs})
    schema = {"run_id": pl.Utf8, "stopped": pl.Boolean, "train_run": pl.Utf8, "step": pl.Int64, "benchmark": pl.Utf8,
              "comparison_key": pl.Utf8, "checkpoint": pl.Utf8, "model": pl.Utf8, "start": pl.Int64,
              "asked": pl.Boolean}
    df = pl.DataFrame(rows, schema=schema)
    # a full evaluation supersedes one that stopped early (evaldag.decisions.decide), else the latest
    return (df.sort(["stopped", "start"], descending=[False, True])
            .unique(["train_run", "step", "benchmark", "comparison_key"], keep="first")
            .sort("train_run", "benchmark", "comparison_key", "step"))


def _find_baseline(runs: pl.DataFrame, baseline: str, benchmark: str, key: str | None) -> dict | None:
    """The run named by `baseline` (a run id, a checkpoint path, a model name, or JOB@STEP) among the runs of
    `benchmark` with comparison key `key`; the latest such run when several match."""
    same = runs.filter((pl.col("benchmark") == benchmark) & (pl.col("comparison_key") == key))
    job, _, step = baseline.rpartition("@")
    named = (pl.col("run_id") == baseline) | (pl.col("checkpoint") == baseline) | (pl.col("model") == baseline)
    if job and step.isdigit():
        named = named | ((pl.col("train_run") == job) & (pl.col("step") == int(step)))
    hit = same.filter(named).sort("start", descending=True)
    return hit.row(0, named=True) if hit.height else None


def pair_job_evaluations(runs: pl.DataFrame, load: Callable[[str], pl.DataFrame], margin: float = 0.02,
                         alpha: float = 0.05, baseline: str | None = None) -> pl.DataFrame:
    """Every asked-for evaluation of each training job against the job's previous checkpoint, its best checkpoint
    so far (evaldag.decisions.best: the verdict accounts for the best's selection; an evaluation stopped early is
    never the best) and the optional `baseline`, each only within the same comparison key. `runs` as `evaluations`
    returns; `load(run_id)` gives a run's per-sample table.

    Returns one row per comparison: train_run, benchmark, step, accuracy, vs (previous / best / baseline),
    other (JOB@STEP), other_accuracy, and the PairedVerdict fields. Runs without a comparison key (logged by an
    older evaldag) are not paired: nothing says they measured the same thing."""
    cache: dict[str, pl.DataFrame] = {}

    def scores(run_id: str) -> pl.DataFrame:
        if run_id not in cache:
            cache[run_id] = per_problem_scores(load(run_id))
        return cache[run_id]

    out = []
    keyed = runs.filter(pl.col("comparison_key").is_not_null())
    for (job, bench, key), group in keyed.filter(pl.col("asked")).group_by(
            ["train_run", "benchmark", "comparison_key"], maintain_order=True):
        group = group.sort("step")
        base = _find_baseline(runs, baseline, bench, key) if baseline else None
        earlier: list[dict] = []        # the steps before, each with its accuracy (evaldag.decisions.best)
        for run in group.iter_rows(named=True):
            mine = scores(run["run_id"])
            accuracy = float(mine["score"].mean())
            refs = best.references(earlier)
            others = [(vs, refs[vs]) for vs in ("previous", "best") if vs in refs]
            if base is not None and base["run_id"] != run["run_id"]:
                others.append(("baseline", base))
            for vs, other in others:
                theirs = scores(other["run_id"])
                v = (best.compare_with_best(mine, [scores(e["run_id"]) for e in best.candidates(earlier)], margin,
                                            alpha) if vs == "best" else compare_scores(mine, theirs, margin, alpha))
                out.append({"train_run": job, "benchmark": bench, "step": run["step"], "run_id": run["run_id"],
                            "accuracy": accuracy, "vs": vs, "other": f"{other['train_run']}@{other['step']}",
                            "other_accuracy": float(theirs["score"].mean()), **v.as_dict()})
            earlier.append({**run, "accuracy": accuracy})
    schema = {"train_run": pl.Utf8, "benchmark": pl.Utf8, "step": pl.Int64, "run_id": pl.Utf8,
              "accuracy": pl.Float64, "vs": pl.Utf8, "other": pl.Utf8, "other_accuracy": pl.Float64,
              "n_problems": pl.Int64, "diff": pl.Float64, "se": pl.Float64, "ci_low": pl.Float64,
              "ci_high": pl.Float64, "p_value": pl.Float64, "p_method": pl.Utf8, "verdict": pl.Utf8,
              "margin": pl.Float64, "alpha": pl.Float64}
    return pl.DataFrame(out, schema=schema)


def render(df: pl.DataFrame):
    """A rich table of `pair_job_evaluations`: one row per (evaluation, comparison)."""
    from rich.table import Table

    colours = {"better": "green", "worse": "red", "equivalent": "cyan", "undecided": "yellow"}
    margin = df["margin"][0] if df.height else float("nan")
    alpha = df["alpha"][0] if df.height else float("nan")
    table = Table(title=f"paired verdicts on common problems: accuracy difference [{1 - alpha:.0%} t interval], "
                        f"sign-flip p-value, equivalence margin +-{margin * 100:.1f} points")
    for col, justify in (("train run", "left"), ("benchmark", "left"), ("step", "right"), ("accuracy", "right"),
                         ("vs", "left"), ("other", "left"), ("problems", "right"), ("difference", "right"),
                         ("p", "right"), ("verdict", "left")):
        table.add_column(col, justify=justify)
    for r in df.iter_rows(named=True):
        diff = "-" if math.isnan(r["diff"]) else f"{r['diff'] * 100:+.1f}"
        if not math.isnan(r["ci_low"]):
            diff += f" [{r['ci_low'] * 100:+.1f}, {r['ci_high'] * 100:+.1f}]"
        colour = colours.get(r["verdict"], "white")
        table.add_row(r["train_run"], r["benchmark"], str(r["step"]), f"{r['accuracy']:.1%}", r["vs"], r["other"],
                      str(r["n_problems"]), diff, f"{r['p_value']:.3g}", f"[{colour}]{r['verdict']}[/]")
    return table


def log_verdicts(client, run_id: str, verdicts: dict[str, PairedVerdict], step: int = 0,
                 others: Mapping[str, str] | None = None) -> None:
    """Write a run's verdicts to MLflow: tag `verdict.vs_<name>` (better/worse/equivalent/undecided) and metrics
    `verdict.vs_<name>.diff|.ci_low|.ci_high|.p_value|.n_problems` at `step` for each `name` (best, previous,
    baseline...); with `others`, the tag `verdict.vs_<name>.other` names the evaluation compared with (JOB@STEP)."""
    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    metrics, tags = [], []
    for name, v in verdicts.items():
        prefix = f"verdict.vs_{name}"
        tags.append(RunTag(prefix, v.verdict))
        if others and name in others:
            tags.append(RunTag(f"{prefix}.other", others[name]))
        for field in ("diff", "ci_low", "ci_high", "p_value", "n_problems"):
            value = getattr(v, field)
            if not math.isnan(value):
                metrics.append(Metric(f"{prefix}.{field}", float(value), now, step))
    client.log_batch(run_id, metrics=metrics, tags=tags)


# --------------------------------------------------------------------------------------------------------------
# Verdicts of one evaluation at track time
# --------------------------------------------------------------------------------------------------------------

def verdict_settings(environ: Mapping[str, str] | None = None) -> tuple[float, float]:
    """(margin, alpha) of the verdicts logged at track time: EVALDAG_VERDICT_MARGIN (default 0.02, an accuracy
    difference: 2 points) and EVALDAG_VERDICT_ALPHA (default 0.05). Raises ValueError naming a bad value."""
    env = os.environ if environ is None else environ
    out = []
    for name, default in ((MARGIN_ENV, DEFAULT_MARGIN), (ALPHA_ENV, DEFAULT_ALPHA)):
        raw = env.get(name, "").strip()
        try:
            out.append(float(raw) if raw else default)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None
    margin, alpha = out
    if not (0 <= margin < 1 and 0 < alpha < 1):
        raise ValueError(f"{MARGIN_ENV} must lie in [0, 1) and {ALPHA_ENV} in (0, 1); got {margin} and {alpha}")
    return margin, alpha


def earlier_evaluations(client, experiment_id: str, train_run: str, comparison: str, step: int) -> list[dict]:
    """The job's finished evaluations with comparison key `comparison` at steps before `step`, oldest step first:
    run_id, step, accuracy (the logged metric), label (JOB@STEP) and stopped (an evaluation that stopped early,
    evaldag.decisions.decide). The latest run per step: a re-evaluation supersedes, as in
    `evaluations`; a full evaluation supersedes one that stopped early whatever their order."""
    from evaldag.tracking.client import all_runs
    from evaldag.tracking.names import COMPARISON_TAG, full_first, stopped_early

    runs = all_runs(client, [experiment_id], filter_string=(
        f"tags.train_run = '{train_run}' and tags.`{COMPARISON_TAG}` = '{comparison}' and tags.kind = 'ckpt_eval' "
        "and attributes.status = 'FINISHED'"), order_by=["attributes.start_time DESC"])
    by_step: dict[int, dict] = {}
    for r in full_first(runs):
        their_step = int(r.data.tags.get("step", "0") or 0)
        if their_step < step and their_step not in by_step and "accuracy" in r.data.metrics:
            by_step[their_step] = {"run_id": r.info.run_id, "step": their_step,
                                   "accuracy": float(r.data.metrics["accuracy"]), "label": f"{train_run}@{their_step}",
                                   "stopped": stopped_early(r.data.tags)}
    return [by_step[s] for s in sorted(by_step)]


def download_samples(client, run_id: str) -> pl.DataFrame:
    """sample_id and correct of a run's samples/samples.parquet artifact, through `client`."""
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, "samples/samples.parquet", tmp)
        return read_scored_samples(local)


def job_verdicts(client, experiment_id: str, *, run_id: str, benchmark: str, train_run: str, comparison: str,
                 step: int, samples: pl.DataFrame, margin: float = DEFAULT_MARGIN, alpha: float = DEFAULT_ALPHA,
                 baseline: str | None = None, load: Callable[[str], pl.DataFrame] | None = None
                 ) -> dict[str, tuple[PairedVerdict, str]]:
    """This evaluation (`samples`, its per-sample table) against the job's previous and best-so-far evaluations
    with the same comparison key (earlier = smaller step; evaldag.decisions.best, which reads every candidate for
    the best) and, given `baseline` (a run id, checkpoint path, model
    name or JOB@STEP, as `evaldag compare --baseline`), that evaluation with the same benchmark and comparison key.
    Returns {name: (verdict, JOB@STEP compared with)}; an empty dict when there is nothing to compare with.
    `load(run_id)` gives another run's per-sample table (default: its artifact through `client`)."""
    load = load or (lambda other: download_samples(client, other))
    earlier = earlier_evaluations(client, experiment_id, train_run, comparison, step)
    others = dict(best.references(earlier))
    if baseline:
        runs = evaluations([benchmark], client=client)
        base = _find_baseline(runs, baseline, benchmark, comparison)
        if base is not None and base["run_id"] != run_id:
            others["baseline"] = {"run_id": base["run_id"], "label": f"{base['train_run']}@{base['step']}"}
    mine = per_problem_scores(samples)
    cache: dict[str, pl.DataFrame] = {}

    def scores(other: Mapping) -> pl.DataFrame:     # previous and best are often the same run: one download
        if other["run_id"] not in cache:
            cache[other["run_id"]] = per_problem_scores(load(other["run_id"]))
        return cache[other["run_id"]]

    out = {}
    for name in (n for n in REFERENCES if n in others):
        # against the best: against every candidate, so that picking the best on these problems costs no error
        v = (best.compare_with_best(mine, [scores(e) for e in best.candidates(earlier)], margin, alpha)
             if name == "best" else compare_scores(mine, scores(others[name]), margin, alpha))
        out[name] = (v, others[name]["label"])
    return out


def logged_verdict_lines(tags: Mapping[str, str], metrics: Mapping[str, float]) -> list[str]:
    """One line per verdict logged on a run (`log_verdicts`), for `evaldag run`: whom it was compared with, the
    difference in accuracy points with its interval, the p-value and the number of common problems."""
    lines = []
    if tags.get("decide.status") in ("stopped", "completed"):
        text = f"decide vs best ({tags.get('decide.vs', '')}): {tags.get('decide.verdict', 'undecided')}"
        if "decide.problems" in metrics and "decide.n_problems" in metrics:
            text += f" after {int(metrics['decide.problems'])} of {int(metrics['decide.n_problems'])} problems"
        if tags["decide.status"] == "stopped":
            text += ", stopped early"
            if "decide.tokens_saved_est" in metrics:
                text += f" (about {int(metrics['decide.tokens_saved_est'])} tokens saved)"
        lines.append(text)
    elif tags.get("decide.status") == "no_incumbent":
        lines.append("decide vs best: nothing earlier in this job to compare with; evaluated in full")
    if tags.get("decide.note"):         # what decide could not reach on this benchmark (evaldag.decisions.reach)
        lines.append(f"decide: {tags['decide.note']}")
    for name in REFERENCES:
        verdict = tags.get(f"verdict.vs_{name}")
        if verdict is None:
            continue
        prefix = f"verdict.vs_{name}"
        diff = metrics.get(f"{prefix}.diff")
        text = f"vs {name}"
        if tags.get(f"{prefix}.other"):
            text += f" ({tags[f'{prefix}.other']})"
        text += f": {verdict}"
        if diff is not None:
            text += f", {diff * 100:+.1f} points"
            if f"{prefix}.ci_low" in metrics and f"{prefix}.ci_high" in metrics:
                text += f" [{metrics[f'{prefix}.ci_low'] * 100:+.1f}, {metrics[f'{prefix}.ci_high'] * 100:+.1f}]"
        if f"{prefix}.p_value" in metrics:
            text += f", p = {metrics[f'{prefix}.p_value']:.3g}"
        if f"{prefix}.n_problems" in metrics:
            text += f", {int(metrics[f'{prefix}.n_problems'])} common problems"
        lines.append(text)
    return lines


__all__ = [
    "PROBLEM_SCORE",
    "REFERENCES",
    "VERDICTS",
    "PairedVerdict",
    "compare_scores",
    "download_samples",
    "earlier_evaluations",
    "evaluations",
    "job_verdicts",
    "log_verdicts",
    "logged_verdict_lines",
    "pair_job_evaluations",
    "paired_differences",
    "paired_test",
    "per_problem_scores",
    "read_scored_samples",
    "render",
    "sign_flip_p_value",
    "verdict_from_interval",
    "verdict_settings",
]

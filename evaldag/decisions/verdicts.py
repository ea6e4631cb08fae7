"""Paired verdicts: is a checkpoint better than, worse than, or equivalent to another one on the same problems?

Two evaluations that measured the same thing (same `evaldag.comparison_key`: benchmark, problem set, sampling,
grader, dtype) are compared problem by problem. Each problem's score is its mean correctness over its n samples
(avg@n, whose mean over problems is the run's `accuracy`), and the unit of the analysis is the problem: the n
samples of one problem are not independent observations of the checkpoint's skill, so they are averaged first
(clustering by problem). On the common problem ids, d_i = score_a(i) - score_b(i) and

- the estimate is mean(d), its standard error sd(d) / sqrt(m) (m problems, ddof 1);
- the interval is Student's t interval on the d_i (the paired t test, scipy.stats.ttest_rel's interval). The d_i
  are bounded in [-1, 1], so with the hundreds of problems of MATH-500 or GSM8K the central limit theorem makes it
  accurate; on a 30-problem set (AIME24) it is an approximation, hence the p-value below;
- the p-value is the exact two-sided sign-flip permutation test: under H0 "the two checkpoints are the same model",
  swapping the two scores of a problem changes nothing, so each d_i is +|d_i| or -|d_i| with probability 1/2
  independently. Its null distribution is computed exactly (a convolution on the grid of 1/n, the per-problem
  scores being multiples of 1/n), for any number of problems, with no large-sample assumption; a Monte Carlo
  estimate is used only when the scores are not on a common grid (unequal n);
- the verdict at level alpha with a margin (TOST-style equivalence):
  `equivalent` when the interval lies inside [-margin, margin]; otherwise `better` when the interval lies above 0
  and the exact p-value is below alpha (both, so that a too-narrow t interval on a small set cannot decide alone),
  `worse` likewise below 0; else `undecided`. Equivalence is read on the same (1 - alpha) interval, which is
  conservative (the textbook TOST uses the (1 - 2 alpha) interval) and keeps one interval on screen. Fewer than
  `min_problems` common problems are always `undecided`: a few identical scores would give a zero-width interval.

`pair_job_evaluations` applies this to every evaluation of each training job against the previous checkpoint, the
best checkpoint so far (by accuracy) and an optional named baseline; `evaldag compare --verdicts` prints it.
`job_verdicts` does the same for one evaluation as it is tracked (evaldag.tracking.write calls it once the run's
metrics are logged), and `log_verdicts` writes the result as MLflow tags and metrics; `logged_verdict_lines` reads them
back for `evaldag run`. The margin and level of those come from EVALDAG_VERDICT_MARGIN and EVALDAG_VERDICT_ALPHA.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

VERDICTS = ("better", "worse", "equivalent", "undecided")
# Exact null distributions are computed on an integer grid of at most this many cells (sum of |d_i| x grid);
# MATH-500 at n = 64 is 2 x 500 x 64 = 64,000.
_MAX_GRID_CELLS = 5_000_000
_MC_DRAWS = 100_000
# The evaluations a tracked run is compared with, in the order they are logged and printed.
REFERENCES = ("previous", "best", "baseline")
MARGIN_ENV, ALPHA_ENV = "EVALDAG_VERDICT_MARGIN", "EVALDAG_VERDICT_ALPHA"
DEFAULT_MARGIN, DEFAULT_ALPHA = 0.02, 0.05


@dataclass(frozen=True)
class PairedVerdict:
    """The paired comparison of evaluation a against evaluation b (difference a - b of the primary metric)."""

    n_problems: int          # common problem ids
    diff: float              # mean of d_i = score_a - score_b
    se: float                # standard error of the mean difference (problems as the unit)
    ci_low: float
    ci_high: float
    p_value: float           # two-sided sign-flip permutation p-value (exact unless p_method says otherwise)
    p_method: str            # "exact" or "monte-carlo"
    verdict: str             # one of VERDICTS
    margin: float
    alpha: float

    def as_dict(self) -> dict:
        """Plain fields, for tables and JSON."""
        return asdict(self)


# A per-problem score column of samples.parquet, where an evaluation has one other than the mean of its samples:
# adaptive samples' two-stage estimate (evaldag.decisions.adaptive.problem_estimates), the same on each of its rows.
PROBLEM_SCORE = "problem_score"


def per_problem_scores(samples: pl.DataFrame) -> pl.DataFrame:
    """One row per problem of a per-sample table (samples.parquet): sample_id, n, score = mean correctness, or the
    table's PROBLEM_SCORE where it has one (an adaptive evaluation's unbiased estimate)."""
    if "correct" not in samples.columns or "sample_id" not in samples.columns:
        raise ValueError(f"a per-sample table needs sample_id and correct, got columns {samples.columns}")
    score = (pl.col(PROBLEM_SCORE).first() if PROBLEM_SCORE in samples.columns
             else pl.col("correct").cast(pl.Float64).mean())
    return samples.group_by("sample_id").agg(n=pl.len(), score=score.cast(pl.Float64)).sort("sample_id")


def read_scored_samples(path: str) -> pl.DataFrame:
    """What per_problem_scores needs of a samples.parquet file: sample_id, correct, and PROBLEM_SCORE if present."""
    present = pl.read_parquet_schema(path)
    return pl.read_parquet(path, columns=[c for c in ("sample_id", "correct", PROBLEM_SCORE) if c in present])


def paired_differences(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Join two per-problem score tables on their common sample ids: sample_id, score_a, score_b, n_a, n_b, d."""
    return (a.select("sample_id", score_a="score", n_a="n")
            .join(b.select("sample_id", score_b="score", n_b="n"), on="sample_id", how="inner")
            .with_columns(d=pl.col("score_a") - pl.col("score_b"))
            .sort("sample_id"))


def _null_on_grid(units: np.ndarray) -> np.ndarray:
    """Exact distribution of S = sum_i eps_i * units_i (eps_i = +-1 fair coins, units_i >= 0 integers), as
    probabilities on -K..K (K = sum units)."""
    total = int(units.sum())
    probs = np.zeros(2 * total + 1)
    probs[total] = 1.0
    span = 0   # the support so far is total-span .. total+span: only that part is shifted
    for k in units[units > 0]:
        k = int(k)
        lo, hi = total - span, total + span + 1
        new = np.zeros_like(probs)
        new[lo - k:hi - k] += 0.5 * probs[lo:hi]
        new[lo + k:hi + k] += 0.5 * probs[lo:hi]
        probs = new
        span += k
    return probs


def sign_flip_p_value(d: np.ndarray, grid: int | None = None, seed: int = 0) -> tuple[float, str]:
    """Two-sided p-value of H0 "each d_i is symmetric about 0" for the statistic |sum d_i|: (p, method).

    With `grid` (the d_i are multiples of 1/grid, e.g. the common number of samples per problem n, or the lcm of
    the two evaluations' n) the null distribution is exact; otherwise, or when the grid would be too large, it is
    estimated from sign-flips drawn at random (p = (1 + hits) / (1 + draws), never 0)."""
    d = np.asarray(d, dtype=np.float64)
    if d.size == 0 or not np.any(d):
        return 1.0, "exact"
    if grid is not None:
        units = np.rint(np.abs(d) * grid).astype(np.int64)
        on_grid = np.allclose(units, np.abs(d) * grid, atol=1e-6)
        if on_grid and 2 * units.sum() + 1 <= _MAX_GRID_CELLS:
            probs = _null_on_grid(units)
            total = int(units.sum())
            observed = abs(int(np.rint(d.sum() * grid)))
            support = np.abs(np.arange(-total, total + 1))
            return float(min(1.0, probs[support >= observed].sum())), "exact"
    rng = np.random.default_rng(seed)
    observed = abs(d.sum()) - 1e-12 * max(1.0, np.abs(d).sum())   # ties count as at least as extreme
    hits, rows = 0, max(1, 2_000_000 // d.size)
    for start in range(0, _MC_DRAWS, rows):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(rows, _MC_DRAWS - start), d.size))
        hits += int((np.abs(signs @ np.abs(d)) >= observed).sum())
    return (1 + hits) / (1 + _MC_DRAWS), "monte-carlo"


def verdict_from_interval(ci_low: float, ci_high: float, margin: float, p_value: float | None = None,
                          alpha: float = 0.05) -> str:
    """The decision rule: `equivalent` if [ci_low, ci_high] lies inside [-margin, margin]; else `better` if it lies
    above 0 (and p_value, when given, is below alpha), `worse` if below 0 (idem); else `undecided`."""
    if any(map(math.isnan, (ci_low, ci_high))):
        return "undecided"
    significant = p_value is None or p_value < alpha
    if margin > 0 and -margin <= ci_low and ci_high <= margin:
        return "equivalent"
    if ci_low > 0 and significant:
        return "better"
    if ci_high < 0 and significant:
        return "worse"
    return "undecided"


def paired_test(d: Iterable[float], margin: float = 0.02, alpha: float = 0.05, grid: int | None = None,
                min_problems: int = 10) -> PairedVerdict:
    """Mean paired difference with its t interval, the exact sign-flip p-value and the verdict (module docstring).

    `d`: one difference per problem (per-problem mean of a minus that of b), each in [-1, 1]; `grid`: the d_i are
    multiples of 1/grid (the samples per problem n when both evaluations have n), for the exact p-value."""
    from scipy.stats import t as student_t

    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    d = np.asarray(list(d) if not isinstance(d, np.ndarray) else d, dtype=np.float64)
    m = d.size
    if m == 0:
        nan = float("nan")
        return PairedVerdict(0, nan, nan, nan, nan, 1.0, "exact", "undecided", margin, alpha)
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(m)) if m > 1 else float("nan")
    if m > 1:
        half = float(student_t.ppf(1 - alpha / 2, m - 1)) * se
        lo, hi = mean - half, mean + half
    else:
        lo = hi = float("nan")
    p, method = sign_flip_p_value(d, grid)
    verdict = verdict_from_interval(lo, hi, margin, p, alpha) if m >= min_problems else "undecided"
    return PairedVerdict(m, mean, se, lo, hi, p, method, verdict, margin, alpha)


def compare_scores(a: pl.DataFrame, b: pl.DataFrame, margin: float = 0.02, alpha: float = 0.05,
                   min_problems: int = 10) -> PairedVerdict:
    """`paired_test` of two per-problem score tables (per_problem_scores) on their common problem ids."""
    pairs = paired_differences(a, b)
    ns = set(pairs["n_a"].unique().to_list()) | set(pairs["n_b"].unique().to_list())
    grid = math.lcm(*ns) if ns else None
    return paired_test(pairs["d"].to_numpy(), margin, alpha, grid, min_problems)


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
    so far (highest accuracy among the earlier steps) and the optional `baseline`, each only within the same
    comparison key. `runs` as `evaluations` returns; `load(run_id)` gives a run's per-sample table.

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
        earlier: list[tuple[dict, float]] = []       # (run, accuracy) of the steps before
        for run in group.iter_rows(named=True):
            mine = scores(run["run_id"])
            accuracy = float(mine["score"].mean())
            others = []
            if earlier:
                others.append(("previous", earlier[-1][0]))
                # ties go to the earlier checkpoint: the best is the first to reach the highest accuracy
                others.append(("best", max(earlier, key=lambda e: (e[1], -e[0]["step"]))[0]))
            if base is not None and base["run_id"] != run["run_id"]:
                others.append(("baseline", base))
            for vs, other in others:
                theirs = scores(other["run_id"])
                v = compare_scores(mine, theirs, margin, alpha)
                out.append({"train_run": job, "benchmark": bench, "step": run["step"], "run_id": run["run_id"],
                            "accuracy": accuracy, "vs": vs, "other": f"{other['train_run']}@{other['step']}",
                            "other_accuracy": float(theirs["score"].mean()), **v.as_dict()})
            earlier.append((run, accuracy))
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
    run_id, step, accuracy (the logged metric), label (JOB@STEP), stopped and verdict (of an evaluation that
    stopped early, evaldag.decisions.decide). The latest run per step: a re-evaluation supersedes, as in
    `evaluations`; a full evaluation supersedes one that stopped early whatever their order."""
    from evaldag.tracking.client import all_runs
    from evaldag.tracking.names import COMPARISON_TAG, DECIDE_VERDICT_TAG, full_first, stopped_early

    runs = all_runs(client, [experiment_id], filter_string=(
        f"tags.train_run = '{train_run}' and tags.`{COMPARISON_TAG}` = '{comparison}' and tags.kind = 'ckpt_eval' "
        "and attributes.status = 'FINISHED'"), order_by=["attributes.start_time DESC"])
    by_step: dict[int, dict] = {}
    for r in full_first(runs):
        their_step = int(r.data.tags.get("step", "0") or 0)
        if their_step < step and their_step not in by_step and "accuracy" in r.data.metrics:
            by_step[their_step] = {"run_id": r.info.run_id, "step": their_step,
                                   "accuracy": float(r.data.metrics["accuracy"]), "label": f"{train_run}@{their_step}",
                                   "stopped": stopped_early(r.data.tags),
                                   "verdict": r.data.tags.get(DECIDE_VERDICT_TAG)}
    return [by_step[s] for s in sorted(by_step)]


def references(earlier: list[dict]) -> dict[str, dict]:
    """The previous evaluation (highest earlier step) and the best so far (highest accuracy; a tie goes to the
    earlier checkpoint, the first to reach it, as in `pair_job_evaluations`) among `earlier` (oldest first).

    An evaluation that stopped early may be the best only if it was decided `better` than the best before it: one
    decided worse or equivalent was shown not to beat it on paired problems, and its accuracy, over a prefix of
    the problems, is too noisy to outrank full evaluations by chance (the largest of noisy figures is biased up)."""
    if not earlier:
        return {}
    eligible = [e for e in earlier if not e.get("stopped") or e.get("verdict") == "better"]
    out = {"previous": earlier[-1]}
    if eligible:
        out["best"] = max(eligible, key=lambda e: (e["accuracy"], -e["step"]))
    return out


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
    with the same comparison key (earlier = smaller step) and, given `baseline` (a run id, checkpoint path, model
    name or JOB@STEP, as `evaldag compare --baseline`), that evaluation with the same benchmark and comparison key.
    Returns {name: (verdict, JOB@STEP compared with)}; an empty dict when there is nothing to compare with.
    `load(run_id)` gives another run's per-sample table (default: its artifact through `client`)."""
    load = load or (lambda other: download_samples(client, other))
    others = references(earlier_evaluations(client, experiment_id, train_run, comparison, step))
    if baseline:
        runs = evaluations([benchmark], client=client)
        base = _find_baseline(runs, baseline, benchmark, comparison)
        if base is not None and base["run_id"] != run_id:
            others["baseline"] = {"run_id": base["run_id"], "label": f"{base['train_run']}@{base['step']}"}
    mine = per_problem_scores(samples)
    cache: dict[str, pl.DataFrame] = {}
    out = {}
    for name in REFERENCES:
        if name not in others:
            continue
        other = others[name]
        if other["run_id"] not in cache:   # previous and best are often the same run: one download
            cache[other["run_id"]] = per_problem_scores(load(other["run_id"]))
        out[name] = (compare_scores(mine, cache[other["run_id"]], margin, alpha), other["label"])
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
    "references",
    "render",
    "sign_flip_p_value",
    "verdict_from_interval",
    "verdict_settings",
]

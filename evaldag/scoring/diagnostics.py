"""Diagnostics: statistical checks that say when a number should not be trusted, or needs a look.

Each check returns a `Diagnostic`: whether it fired, an explanation with the numbers behind it, the action to
take, and the raw details. Every check is a significance test at a stated `alpha`, so on pure noise it fires at
rate about alpha (or less: the tests are chosen conservative, never liberal), and a fired diagnostic means
"this is larger than sampling noise explains", not "this looks different".

- `shard_disagreement`: do the shards of one evaluation disagree on accuracy beyond chance?
- `reward_fluctuation`: does the reward jump between consecutive checkpoints beyond sampling noise?
- `eval_loss_jump`: does the loss on the reference solutions jump between consecutive checkpoints beyond what
  its per-problem spread explains (a paired test)?
- `accuracy_reward_divergence`: do accuracy and reward trend in opposite directions over a training job?

scipy (for the chi-square and t distributions) is imported on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np
import polars as pl


@dataclass(frozen=True)
class Diagnostic:
    """The outcome of one check."""

    name: str
    fired: bool
    explanation: str
    action: str
    details: dict[str, Any] = field(default_factory=dict)


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


def _require(df: pl.DataFrame, cols: list[str], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{what} needs columns {missing}; the table has {df.columns}")


# --------------------------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------------------------

def _design_effect(graded: pl.DataFrame) -> float:
    """How much the samples of one problem share (>= 1): the variance of a shard's accuracy over its binomial one.

    With n samples per problem, a shard's accuracy varies with its problems' difficulty as well as with sampling,
    so a plain chi-square on samples would fire on problem mix alone. Cluster-robust (per problem within shard)
    variance over binomial variance, pooled over shards, is the first-order Rao-Scott correction of the
    statistic. One sample per problem gives exactly 1. Floored at 1: never more liberal than the plain test.
    """
    clusters = (graded.group_by("shard_index", "sample_id")
                .agg(n=pl.len(), y=pl.col("correct").cast(pl.Float64).mean())
                .with_columns(ybar=((pl.col("n") * pl.col("y")).sum() / pl.col("n").sum()).over("shard_index")))
    row = clusters.select(
        num=(pl.col("n").pow(2) * (pl.col("y") - pl.col("ybar")).pow(2)).sum(),
        den=(pl.col("n") * pl.col("ybar") * (1 - pl.col("ybar"))).sum(),
    ).row(0, named=True)
    if not row["den"]:
        return 1.0
    return max(1.0, row["num"] / row["den"])


PERMUTATIONS = 2000   # p-value resolution 1/2001; Monte Carlo error at p = 0.01 about 0.002


def _permutation_p(correct: np.ndarray, shard: np.ndarray, n_shards: int, n_perm: int, seed: int) -> float:
    """p-value of the between-shard spread of correct counts, over reassignments of whole problems to shards.

    `correct[i]` is problem i's number of correct samples and `shard[i]` its shard. With the same n per problem, the
    chi-square statistic of the shards x {correct, not} table is, up to constant factors, sum_s (C_s - m_s c̄)^2 / m_s
    (C_s: correct samples of shard s, m_s: its problems), and permuting problems keeps every m_s. Under "no shard
    effect" the problems' counts are exchangeable between shards, so this p-value is exact up to Monte Carlo error
    whatever the problems' difficulties and however few problems a shard has.
    """
    m = np.bincount(shard, minlength=n_shards).astype(np.float64)
    mean = correct.mean()

    def stat(counts: np.ndarray) -> np.ndarray:        # counts: (..., problems) -> (...)
        onehot = np.zeros((correct.size, n_shards))
        onehot[np.arange(correct.size), shard] = 1.0
        per_shard = counts @ onehot
        return (((per_shard - m * mean) ** 2) / m).sum(axis=-1)

    observed = stat(correct.astype(np.float64))
    rng = np.random.default_rng(seed)
    shuffled = rng.permuted(np.broadcast_to(correct.astype(np.float64), (n_perm, correct.size)), axis=1)
    as_extreme = int(np.sum(stat(shuffled) >= observed * (1 - 1e-12)))
    return (1 + as_extreme) / (1 + n_perm)


def _within_problem_p(graded: pl.DataFrame, present: list[int], n_perm: int, seed: int,
                      block: int = 100) -> float:
    """p-value of the between-shard spread of correct samples, over reshufflings of each problem's samples among the
    shards that hold them: the test for plans that split problems' samples over shards (evaldag.request.plan.
    plan_split_shards), where whole problems cannot be dealt out. Statistic sum_s (C_s - E_s)^2 / m_s, with C_s the
    correct samples of shard s, m_s its samples and E_s = sum_p m_ps * ybar_p what its share of each problem predicts.
    Shuffling keeps every m_ps, and under "no shard effect" a problem's samples are exchangeable between shards, so
    the p-value is exact up to Monte Carlo error whatever the problems' difficulties."""
    df = (graded.select("sample_id", "shard_index", y=pl.col("correct").fill_null(False).cast(pl.Float64))
          .sort("sample_id", "shard_index"))
    problem = df["sample_id"].rank("dense").to_numpy().astype(np.float64) - 1.0
    index = {s: i for i, s in enumerate(present)}
    onehot = np.zeros((df.height, len(present)))
    onehot[np.arange(df.height), [index[s] for s in df["shard_index"].to_list()]] = 1.0
    y = df["y"].to_numpy()
    ybar = df.select(pl.col("y").mean().over("sample_id"))["y"].to_numpy()
    m, expected = onehot.sum(axis=0), ybar @ onehot

    def stat(ys: np.ndarray) -> np.ndarray:         # ys: (..., samples) -> (...)
        return (((ys @ onehot - expected) ** 2) / m).sum(axis=-1)

    observed = stat(y)
    rng = np.random.default_rng(seed)
    as_extreme = 0
    for start in range(0, n_perm, block):       # blocks bound the memory: block x samples
        k = min(block, n_perm - start)
        order = np.argsort(problem + rng.random((k, df.height)), axis=1)   # a shuffle within each problem
        as_extreme += int(np.sum(stat(y[order]) >= observed * (1 - 1e-12)))
    return (1 + as_extreme) / (1 + n_perm)


def _untestable(by: pl.DataFrame) -> str | None:
    """Why the per-shard table `by` cannot show a shard effect, or None when it can be tested."""
    total, correct = int(by["n"].sum()), int(by["correct"].sum())
    if by.height < 2:
        return f"Only {by.height} shard with samples: nothing to compare."
    if correct in (0, total):
        return f"Every sample is {'correct' if correct else 'wrong'}: the shards cannot disagree."
    if int(by["problems"].max()) <= 1:
        return ("Not tested: every shard holds one problem, so a shard's accuracy is its problem's and a shard "
                "effect cannot be told apart from problem difficulty (plan at least 2 problems per shard to test it).")
    return None


def _problem_scores(graded: pl.DataFrame, present: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each problem's correct count (its accuracy when problems have unequal sample counts) and the position of its
    shard in `present`: what the permutation test deals out."""
    problems = (graded.group_by("sample_id")
                .agg(shard=pl.col("shard_index").first(), c=pl.col("correct").fill_null(False).sum(), n=pl.len())
                .sort("sample_id"))
    index = {s: i for i, s in enumerate(present)}
    shard_of = np.array([index[s] for s in problems["shard"].to_list()])
    counts = problems["c"].to_numpy().astype(np.float64)
    if problems["n"].n_unique() > 1:   # unequal n per problem: compare accuracies, each problem weighted equally
        counts = counts / problems["n"].to_numpy()
    return counts, shard_of


def _shard_p(graded: pl.DataFrame, by: pl.DataFrame, present: list[int], permutations: int, seed: int,
             details: dict[str, Any]) -> float:
    """shard_disagreement's permutation p-value (over problems, or over samples within problems where the plan
    split problems over shards); the chi-square figures go into `details` for reference."""
    from scipy.stats import chi2, chi2_contingency

    table = np.column_stack([by["correct"].to_numpy(), (by["n"] - by["correct"]).to_numpy()])
    stat, p_iid, dof, _ = chi2_contingency(table, correction=False)
    deff = _design_effect(graded)
    if graded.select(pl.col("shard_index").n_unique().over("sample_id").max()).item() > 1:
        details["test"] = "permutation of samples within problems"   # the plan split problems over shards
        p = _within_problem_p(graded, present, permutations, seed)
    else:
        counts, shard_of = _problem_scores(graded, present)
        p = _permutation_p(counts, shard_of, len(present), permutations, seed)
    details.update(chi2=float(stat), dof=int(dof), design_effect=deff, p_value=p, p_value_iid=float(p_iid),
                   p_value_design_effect=float(chi2.sf(stat / deff, dof)), permutations=permutations)
    return p


def shard_disagreement(graded: pl.DataFrame, alpha: float = 0.01, num_shards: int | None = None,
                       permutations: int = PERMUTATIONS, seed: int = 0) -> Diagnostic:
    """Do the shards' accuracies differ more than their problems' difficulties explain?

    A permutation test over problems (`_permutation_p`): the shards' spread of correct counts against the spread when
    whole problems are dealt to the shards at random, keeping each shard's number of problems (where the plan split
    problems' samples over shards, each problem's samples are shuffled among its shards instead:
    `_within_problem_p`). It needs no assumption about how the samples of a problem cluster, so it holds its false-alarm rate (about alpha) with 5
    problems per shard as with 500. With one problem per shard a shard effect cannot be told apart from problem
    difficulty, and the diagnostic says so instead of testing. Fires when p < alpha. The plain and the
    design-effect-corrected chi-square p-values are kept in the details for reference. All-correct or all-wrong
    tables have nothing to compare (p = 1, quiet). With `num_shards`, shards that have no samples are named in the
    explanation; they are left out of the test (a missing shard is `evaldag.scoring.metrics.check_complete`'s error, not a
    disagreement).
    """
    _check_alpha(alpha)
    _require(graded, ["shard_index", "sample_id", "correct"], "shard_disagreement")
    name = "shard_disagreement"
    action = ("Compare the outlying shards' settings and logs (worker, engine, dtype, batch size, checkpoint "
              "fingerprint) and their truncation/unparseable rates; re-run the shard if it differs.")
    by = (graded.group_by("shard_index")
          .agg(n=pl.len(), correct=pl.col("correct").fill_null(False).sum(), problems=pl.col("sample_id").n_unique())
          .sort("shard_index")
          .with_columns(accuracy=pl.col("correct") / pl.col("n")))
    present = by["shard_index"].to_list()
    empty = sorted(set(range(num_shards)) - set(present)) if num_shards else []
    details: dict[str, Any] = {
        "alpha": alpha, "n_shards": len(present), "empty_shards": empty, "test": "permutation of problems",
        "accuracy_by_shard": dict(zip(present, by["accuracy"].to_list())),
        "n_by_shard": dict(zip(present, by["n"].to_list())),
        "problems_by_shard": dict(zip(present, by["problems"].to_list())),
    }
    note = f" Shards {empty} have no samples and were left out of the test." if empty else ""
    untestable = _untestable(by)
    if untestable is not None:
        details["p_value"] = 1.0
        return Diagnostic(name, False, untestable + note, "None.", details)

    p = _shard_p(graded, by, present, permutations, seed, details)
    accs = ", ".join(f"{s}: {a:.3f} (n={n}, {k} problems)" for s, a, n, k in
                     by.select("shard_index", "accuracy", "n", "problems").iter_rows())
    floor = f" (the smallest p-value {permutations} permutations can give)" if p <= 1 / (1 + permutations) else ""
    if p < alpha:
        lo, hi = by.row(by["accuracy"].arg_min(), named=True), by.row(by["accuracy"].arg_max(), named=True)
        text = (f"Shard accuracies differ more than their problems' difficulties explain: permutation p = {p:.2g}"
                f"{floor} < alpha = {alpha}; lowest shard {lo['shard_index']} at {lo['accuracy']:.3f}, highest "
                f"shard {hi['shard_index']} at {hi['accuracy']:.3f}. By shard: {accs}.{note}")
        return Diagnostic(name, True, text, action, details)
    text = (f"Shard accuracies agree within what their problems' difficulties explain: permutation p = {p:.2g} >= "
            f"alpha = {alpha}. By shard: {accs}.{note}")
    return Diagnostic(name, False, text, "None.", details)


# --------------------------------------------------------------------------------------------------------------
# Training history
# --------------------------------------------------------------------------------------------------------------

def _history(history: pl.DataFrame, cols: list[str], what: str, min_rows: int) -> pl.DataFrame:
    _require(history, ["step", *cols], what)
    if history.height < min_rows:
        raise ValueError(f"{what} needs at least {min_rows} checkpoints, got {history.height}")
    dup = history.filter(pl.col("step").is_duplicated())["step"].unique().sort().to_list()
    if dup:
        raise ValueError(f"{what}: steps {dup} appear more than once; one row per checkpoint")
    return history.sort("step")


def _standard_error(history: pl.DataFrame, metric: str) -> np.ndarray | None:
    """The standard error of `metric` per checkpoint: `<metric>_se`, else std / sqrt(n_samples) for the reward and
    sqrt(a(1-a)/n_samples) for accuracy; None when the table has neither."""
    prefix = metric.removesuffix("_mean")
    if f"{prefix}_se" in history.columns:
        return history[f"{prefix}_se"].cast(pl.Float64).to_numpy()
    if "n_samples" not in history.columns:
        return None
    n = history["n_samples"].cast(pl.Float64).to_numpy()
    if f"{prefix}_std" in history.columns:
        return history[f"{prefix}_std"].cast(pl.Float64).to_numpy() / np.sqrt(n)
    if metric == "accuracy":
        a = history["accuracy"].cast(pl.Float64).to_numpy()
        return np.sqrt(a * (1 - a) / n)
    return None


def reward_fluctuation(history: pl.DataFrame, alpha: float = 0.01, bonferroni: bool = True) -> Diagnostic:
    """Fires when the reward changes between consecutive checkpoints by more than sampling noise explains.

    `history`: one row per checkpoint with step, reward_mean and reward_se (or reward_std and n_samples). A jump
    is significant when |delta| > z * sqrt(se1^2 + se2^2), z the two-sided normal quantile of alpha, divided by
    the number of jumps when `bonferroni` (so a long job is not bound to fire on noise somewhere).
    """
    _check_alpha(alpha)
    name = "reward_fluctuation"
    h = _history(history, ["reward_mean"], name, 2)
    se = _standard_error(h, "reward_mean")
    if se is None:
        raise ValueError(f"{name} needs reward_se, or reward_std and n_samples, per checkpoint")
    steps, mean = h["step"].to_list(), h["reward_mean"].cast(pl.Float64).to_numpy()
    delta = np.diff(mean)
    se_delta = np.sqrt(se[1:] ** 2 + se[:-1] ** 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(delta == 0, 0.0, np.abs(delta) / se_delta)   # se 0 with a real change: infinitely significant
    level = alpha / len(delta) if bonferroni else alpha
    z_crit = NormalDist().inv_cdf(1 - level / 2)
    jumps = [{"step_from": steps[i], "step_to": steps[i + 1], "delta": float(delta[i]), "z": float(z[i])}
             for i in range(len(delta))]
    big = sorted((j for j in jumps if j["z"] > z_crit), key=lambda j: -j["z"])
    details = {"alpha": alpha, "bonferroni": bonferroni, "z_critical": z_crit, "jumps": jumps,
               "max_z": float(z.max())}
    if big:
        listed = "; ".join(f"step {j['step_from']} -> {j['step_to']}: {j['delta']:+.4g} ({j['z']:.1f} SE)"
                           for j in big[:3])
        text = (f"{len(big)} of {len(jumps)} checkpoint-to-checkpoint reward changes exceed sampling noise "
                f"(|delta| > {z_crit:.2f} standard errors of the difference): {listed}.")
        action = ("Inspect the samples of the checkpoints around the largest jump: a drop suggests training "
                  "instability (learning rate, a bad data batch, reward hacking); a rise is a real improvement.")
        return Diagnostic(name, True, text, action, details)
    text = (f"All {len(jumps)} reward changes between consecutive checkpoints are within sampling noise "
            f"(largest {z.max():.1f} SE, threshold {z_crit:.2f}).")
    return Diagnostic(name, False, text, "None.", details)


def _paired_jump(a: pl.DataFrame, b: pl.DataFrame) -> dict[str, Any]:
    """Paired t-test of the per-problem losses of two checkpoints over the problems both scored: delta (mean of
    b - a), its standard error, t, the two-sided p-value (m - 1 degrees of freedom) and m."""
    from scipy.stats import t as student_t

    d = (b.join(a, on="sample_id", suffix="_a").select(pl.col("loss") - pl.col("loss_a"))
         .drop_nulls()["loss"].to_numpy())
    m = d.size
    if m < 2:
        return {"delta": float(d.mean()) if m else float("nan"), "se": float("nan"), "t": 0.0, "p": 1.0, "m": m}
    delta, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(m))
    if delta == 0.0:
        return {"delta": delta, "se": se, "t": 0.0, "p": 1.0, "m": m}
    if se == 0.0:                       # every problem moved by exactly delta: no noise explains it
        return {"delta": delta, "se": se, "t": math.inf, "p": 0.0, "m": m}
    t = abs(delta) / se
    return {"delta": delta, "se": se, "t": t, "p": float(2 * student_t.sf(t, m - 1)), "m": m}


def eval_loss_jump(per_problem: pl.DataFrame, alpha: float = 0.01, bonferroni: bool = True) -> Diagnostic:
    """Fires when eval_loss changes between consecutive checkpoints by more than its per-problem spread explains.

    `per_problem`: step, sample_id and loss (a problem's mean nll per reference token, evaldag.scoring.eval_loss),
    one row per checkpoint and problem. Each pair of consecutive steps is a paired t-test over the problems both
    scored: eval_loss's change is the mean of the per-problem differences, and most of a loss's spread over
    problems (how hard each solution is to predict) cancels in the pairing, so the test sees small real moves that
    the two checkpoints' separate standard errors would hide. Tested at alpha, divided by the number of jumps
    when `bonferroni` (so a long job is not bound to fire on noise somewhere), as reward_fluctuation does.
    """
    _check_alpha(alpha)
    name = "eval_loss_jump"
    _require(per_problem, ["step", "sample_id", "loss"], name)
    steps = per_problem["step"].unique().sort().to_list()
    if len(steps) < 2:
        raise ValueError(f"{name} needs at least 2 checkpoints, got {len(steps)}")
    by_step = {s: per_problem.filter(pl.col("step") == s).select("sample_id", "loss") for s in steps}
    for s, table in by_step.items():
        if table["sample_id"].is_duplicated().any():
            raise ValueError(f"{name}: step {s} has a problem more than once; one row per checkpoint and problem")
    jumps = [{"step_from": s0, "step_to": s1, **_paired_jump(by_step[s0], by_step[s1])}
             for s0, s1 in zip(steps, steps[1:])]
    level = alpha / len(jumps) if bonferroni else alpha
    big = sorted((j for j in jumps if j["p"] < level), key=lambda j: j["p"])
    details = {"alpha": alpha, "bonferroni": bonferroni, "level": level, "test": "paired t over problems",
               "jumps": jumps, "min_p": min(j["p"] for j in jumps)}
    if big:
        listed = "; ".join(f"step {j['step_from']} -> {j['step_to']}: {j['delta']:+.4g} nats/token "
                           f"({j['t']:.1f} SE of the paired differences, p = {j['p']:.2g}, {j['m']} problems)"
                           for j in big[:3])
        text = (f"{len(big)} of {len(jumps)} checkpoint-to-checkpoint eval_loss changes exceed what the per-problem "
                f"spread explains (paired t-test, p < {level:.2g}): {listed}.")
        action = ("Look at the training steps between these checkpoints (learning rate, a bad data batch, a loss "
                  "spike in the trainer's log) and compare both checkpoints' samples: a rise is the model moving "
                  "away from the reference solutions' text (expected under RL to a degree; check KL and accuracy), "
                  "a sudden rise with falling accuracy is instability.")
        return Diagnostic(name, True, text, action, details)
    text = (f"All {len(jumps)} eval_loss changes between consecutive checkpoints are within what the per-problem "
            f"spread explains (smallest paired p = {details['min_p']:.2g}, level {level:.2g}).")
    return Diagnostic(name, False, text, "None.", details)


def _trend(step: np.ndarray, y: np.ndarray, se: np.ndarray | None) -> tuple[float, float, float]:
    """Slope over step, its standard error and two-sided p-value: a weighted least-squares line (weights 1/se^2).

    With known errors, the slope's error is scaled up by sqrt(reduced chi^2) when the points scatter more than
    their errors say (a curve, or underestimated errors); without them, it comes from the residuals alone.
    Either way the p-value uses a t distribution with m - 2 degrees of freedom: conservative for few checkpoints.
    """
    from scipy.stats import t as student_t

    m = len(step)
    known = se is not None and bool(np.all(se > 0))   # a zero or missing error cannot weight a point
    w = 1.0 / se ** 2 if known else np.ones(m)
    xw = np.sum(w * step) / np.sum(w)
    yw = np.sum(w * y) / np.sum(w)
    sxx = np.sum(w * (step - xw) ** 2)
    slope = float(np.sum(w * (step - xw) * (y - yw)) / sxx)
    resid = y - (yw + slope * (step - xw))
    chi2_red = float(np.sum(w * resid ** 2) / (m - 2))
    scale = max(1.0, chi2_red) if known else chi2_red
    slope_se = math.sqrt(scale / sxx)
    if slope == 0.0:
        return slope, slope_se, 1.0
    if slope_se == 0.0:
        return slope, slope_se, 0.0
    return slope, slope_se, float(2 * student_t.sf(abs(slope) / slope_se, m - 2))


def accuracy_reward_divergence(history: pl.DataFrame, alpha: float = 0.01) -> Diagnostic:
    """Fires when accuracy and reward both trend significantly over the job, in opposite directions.

    `history`: one row per checkpoint with step, accuracy, reward_mean, and optionally accuracy_se / reward_se
    (or n_samples, with reward_std). Each trend is a weighted least-squares slope over step (`_trend`), tested
    at alpha; a rise in one and a fall in the other, both significant, usually means the reward no longer
    measures what accuracy does (reward hacking, a format or length term dominating).
    """
    _check_alpha(alpha)
    name = "accuracy_reward_divergence"
    h = _history(history, ["accuracy", "reward_mean"], name, 3)
    step = h["step"].cast(pl.Float64).to_numpy()
    fits = {metric: _trend(step, h[metric].cast(pl.Float64).to_numpy(), _standard_error(h, metric))
            for metric in ("accuracy", "reward_mean")}
    details: dict[str, Any] = {"alpha": alpha, "n_checkpoints": h.height}
    for metric, (slope, slope_se, p) in fits.items():
        details.update({f"{metric}_slope": slope, f"{metric}_slope_se": slope_se, f"{metric}_p_value": p})
    (a_slope, _, a_p), (r_slope, _, r_p) = fits["accuracy"], fits["reward_mean"]
    per_1k = (f"accuracy {a_slope * 1000:+.3g} (p = {a_p:.2g}), reward {r_slope * 1000:+.3g} (p = {r_p:.2g}) "
              "per 1000 steps")
    span = f"steps {h['step'][0]}..{h['step'][-1]}"
    if a_p < alpha and r_p < alpha and (a_slope > 0) != (r_slope > 0):
        text = (f"Accuracy and reward trend in opposite directions over {span}, both significant at "
                f"alpha = {alpha}: {per_1k}.")
        action = ("Check which reward component moves (reward/<name>/mean): a format or length term can rise "
                  "while correctness falls. Read samples from the first and last checkpoints.")
        return Diagnostic(name, True, text, action, details)
    text = f"No significant opposite trends over {span}: {per_1k}."
    return Diagnostic(name, False, text, "None.", details)


# --------------------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(diags: list[Diagnostic]) -> str:
    """A markdown table (diagnostic, status, explanation, action), fired ones first."""
    lines = ["| diagnostic | status | explanation | action |", "|---|---|---|---|"]
    for d in sorted(diags, key=lambda d: not d.fired):
        status = "**fired**" if d.fired else "ok"
        lines.append(f"| {_cell(d.name)} | {status} | {_cell(d.explanation)} | {_cell(d.action)} |")
    return "\n".join(lines) + "\n"


def to_tags(diags: list[Diagnostic]) -> dict[str, str]:
    """MLflow tags: {"diagnostic.<name>": "fired" | "ok"}."""
    return {f"diagnostic.{d.name}": "fired" if d.fired else "ok" for d in diags}

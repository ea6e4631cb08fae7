"""Forecasts of a training job's accuracy at its planned final step, from its curve so far; and whether a job is
falling behind another at the same step.

Model: the saturating sigmoid of RL scaling curves (ScaleRL, arXiv 2510.13786), with the training step in place of
compute:

    acc(s) = A - (A - R0) / (1 + (s / s_mid)^B)

R0 is the accuracy at step 0, A the asymptote, s_mid the step at which half the gain A - R0 is made, B the
steepness. Fitted by weighted least squares (scipy.optimize.leastsq, bounded by a change of variables: R0 and A in
[0, 1], B in [B_MIN, B_MAX], s_mid within a factor S_MID_RANGE of the steps), each point weighted by 1 / se^2 with
se its binomial standard error (`standard_errors`: accuracy and n_samples).

The band is a prediction interval for the accuracy the evaluation of the final checkpoint will measure, by the delta
method: var = scale * (g' (J'WJ)^-1 g + se_final^2), g the gradient of acc(final_step) in the parameters, J the
Jacobian of the fit, se_final the binomial error of an evaluation the size of the job's last one. `scale` is the
reduced chi-square of the fit when the points scatter more than binomial noise explains (checkpoint-to-checkpoint
variation of the policy), else 1, with a t quantile on m - 4 degrees of freedom either way (the scale is
estimated). So the band widens with fewer points, noisier points and a longer extrapolation.

What it refuses (`Forecast.made` False, `Forecast.reason` says why and what would allow it): fewer than MIN_POINTS
evaluated steps (four parameters need at least one more point), a final step more than MAX_EXTRAPOLATION times the
last evaluated step (the asymptote is then a guess whatever the band says).

bench/bench_forecast.py measures the band on simulated sigmoid curves (500 problems, checkpoint-to-checkpoint noise):
coverage 76-85 % for the nominal 80 % from a quarter of the run on; the band is wide early (median 0.57 at 4x
extrapolation, 0.19 at 2x, 0.10 at 1.3x), and the point forecast beats the last measured value only from about half
the run on. A job whose curve is not of this shape (a collapse, a second rise) is outside what the band promises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np
import polars as pl

from evaldag.scoring.diagnostics import Diagnostic

MIN_POINTS = 5
MAX_EXTRAPOLATION = 4.0     # final_step / last evaluated step; beyond it no forecast (bench_forecast.py: coverage)
# Steepness bounds: below 0.3 the curve is nearly flat in log step, above 8 a step function; a fit out there chases
# noise between two checkpoints rather than describing a trend.
B_MIN, B_MAX = 0.3, 8.0
# s_mid within [first evaluated step / 20, max(final, last step) * 20]: further out, A and s_mid trade off exactly
# (the curve is a power law over the evaluated steps) and only their combination is determined.
S_MID_RANGE = 20.0
LEVEL = 0.8


def sigmoid(step: np.ndarray | float, A: float, R0: float, s_mid: float, B: float) -> np.ndarray:
    """acc(s) = A - (A - R0) / (1 + (s / s_mid)^B), for steps s >= 0 (acc(0) = R0)."""
    with np.errstate(divide="ignore", over="ignore"):    # log 0 = -inf gives the limit R0; a huge power gives A
        return _value(np.log(np.asarray(step, dtype=np.float64)), np.array([A, R0, math.log(s_mid), B]))


def _value(logs: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """acc at log-steps `logs` for theta = (A, R0, log s_mid, B) (the fit's inner loop: no Jacobian)."""
    A, R0, c, B = theta
    return A - (A - R0) / (1.0 + np.exp(B * (logs - c)))


def _model(step: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """acc at `step` and its Jacobian in theta = (A, R0, log s_mid, B): the log keeps s_mid's scale out of the
    solver's way (steps span 1e1..1e5)."""
    from scipy.special import expit

    A, R0, c, B = theta
    with np.errstate(divide="ignore"):
        logs = np.log(step)
    z = B * (logs - c)
    lo, hi = expit(-z), expit(z)                      # 1/(1+u), u/(1+u) with u = (s/s_mid)^B
    f = A - (A - R0) * lo
    dz = (A - R0) * lo * hi                           # d f / d z
    # at step 0 z = -inf and d f / d B = dz * (log s - c) is 0 * inf: its limit is 0 (dz is 0 there)
    d_b = dz * np.where(np.isfinite(logs), logs - c, 0.0)
    jac = np.column_stack([hi, lo, -B * dz, d_b])
    return f, jac


def standard_errors(accuracy: np.ndarray, n_samples: np.ndarray) -> np.ndarray:
    """Binomial standard error of each accuracy measured on `n_samples` samples, with the accuracy shrunk to
    (k + 0.5) / (n + 1) so that a 0 % or 100 % point still has an error (and a weight that is not infinite).

    With n > 1 samples per problem this is an upper bound on the sampling error given the problems (samples of one
    problem vary less than independent draws), so it never makes the band narrower than the noise."""
    a = np.asarray(accuracy, dtype=np.float64)
    n = np.asarray(n_samples, dtype=np.float64)
    if np.any(~np.isfinite(a)) or np.any((a < 0) | (a > 1)):
        raise ValueError(f"accuracy must be in [0, 1] at every step, got {a.tolist()}")
    if np.any(~np.isfinite(n)) or np.any(n < 1):
        raise ValueError(f"n_samples must be >= 1 at every step, got {n.tolist()}")
    p = (a * n + 0.5) / (n + 1)
    return np.sqrt(p * (1 - p) / n)


@dataclass(frozen=True)
class CurveFit:
    """A fitted sigmoid: parameters, their covariance (unscaled: (J'WJ)^-1 in (A, R0, log s_mid, B)), the
    scale of the errors (reduced chi-square, or 1) and the degrees of freedom left."""

    A: float
    R0: float
    s_mid: float
    B: float
    cov: np.ndarray
    scale: float
    dof: int
    chi2: float

    @property
    def theta(self) -> np.ndarray:
        return np.array([self.A, self.R0, math.log(self.s_mid), self.B])

    def predict(self, step: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """The fitted accuracy at `step` and its standard error (delta method, scaled): the curve's own
        uncertainty, without the noise of a new evaluation."""
        s = np.atleast_1d(np.asarray(step, dtype=np.float64))
        f, g = _model(s, self.theta)
        var = np.einsum("ij,jk,ik->i", g, self.cov, g) * self.scale
        return f, np.sqrt(np.maximum(var, 0.0))

    def quantile(self, level: float) -> float:
        """The two-sided quantile of a `level` interval: t with the fit's degrees of freedom, since the error scale
        is estimated (training noise between checkpoints is not known in advance) even when it comes out at 1."""
        from scipy.stats import t as student_t

        return float(student_t.ppf((1 + level) / 2, self.dof))


def fit_sigmoid(step: np.ndarray, accuracy: np.ndarray, se: np.ndarray, final_step: float | None = None) -> CurveFit:
    """Weighted least-squares fit of `sigmoid` to (step, accuracy) with standard errors `se` (see the module
    docstring for the bounds). Several starting points; the lowest chi-square wins."""
    from scipy.optimize import leastsq
    from scipy.special import expit

    s = np.asarray(step, dtype=np.float64)
    y = np.asarray(accuracy, dtype=np.float64)
    w = 1.0 / np.asarray(se, dtype=np.float64)
    if len(s) < MIN_POINTS:
        raise ValueError(f"fit_sigmoid needs at least {MIN_POINTS} points (4 parameters), got {len(s)}")
    if np.any(s < 0) or len(np.unique(s)) != len(s):
        raise ValueError(f"steps must be distinct and >= 0, got {s.tolist()}")
    if np.any(~np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("every point needs a finite standard error > 0 (see standard_errors)")
    positive = s[s > 0]
    c_lo = math.log(positive.min() / S_MID_RANGE)
    c_hi = math.log(max(float(final_step or 0), s.max()) * S_MID_RANGE)
    lower, upper = np.array([0.0, 0.0, c_lo, B_MIN]), np.array([1.0, 1.0, c_hi, B_MAX])
    span = upper - lower

    # Bounds by a logistic change of variables, theta = lower + span * expit(phi), so that MINPACK's unbounded
    # Levenberg-Marquardt (compiled: ~10x faster than a bounded solver) does the work.
    def theta_of(phi):
        return lower + span * expit(phi)

    with np.errstate(divide="ignore"):
        logs = np.log(s)

    def resid(phi):
        with np.errstate(over="ignore"):
            return (_value(logs, theta_of(phi)) - y) * w

    def jac(phi):
        e = expit(phi)
        return _model(s, theta_of(phi))[1] * w[:, None] * (span * e * (1 - e))

    def phi_of(theta):
        q = np.clip((np.asarray(theta) - lower) / span, 1e-6, 1 - 1e-6)
        return np.log(q / (1 - q))

    first, best = y[np.argmin(s)], None
    top = float(np.clip(y.max() + 0.05, 0.02, 0.98))
    # the fit has local minima (early points fit a slow curve or the start of a steep one): a few starts
    for c0 in np.log([float(np.median(positive)), 2.0 * float(positive.max())]):
        for b0 in (1.0, 2.5):
            # full_output: a start that runs out of evaluations is not warned about; it loses to a better one
            phi, *_ = leastsq(resid, phi_of([top, float(np.clip(first, 0.02, 0.98)), c0, b0]), Dfun=jac,
                              full_output=True)
            cost = float(np.sum(resid(phi) ** 2))
            if best is None or cost < best[0]:
                best = (cost, phi)
    chi2, theta = best[0], theta_of(best[1])
    _, J = _model(s, theta)
    Jw = J * w[:, None]
    cov = np.linalg.pinv(Jw.T @ Jw)
    dof = len(s) - len(theta)
    scale = max(1.0, chi2 / dof) if dof > 0 else math.inf
    return CurveFit(float(theta[0]), float(theta[1]), float(math.exp(theta[2])), float(theta[3]), cov, scale, dof,
                    chi2)


@dataclass(frozen=True)
class Forecast:
    """The forecast accuracy at `final_step` with its `level` band, or, when `made` is False, why there is none."""

    final_step: int
    made: bool
    reason: str
    value: float = math.nan
    low: float = math.nan
    high: float = math.nan
    level: float = LEVEL
    n_points: int = 0
    last_step: int = 0
    params: dict[str, float] = field(default_factory=dict)

    @property
    def width(self) -> float:
        return self.high - self.low

    def describe(self) -> str:
        """One line for people: the forecast and its band, or why there is none."""
        if not self.made:
            return f"no forecast for step {self.final_step}: {self.reason}"
        return (f"forecast at step {self.final_step}: {self.value:.1%} [{self.low:.1%}, {self.high:.1%}] "
                f"({self.level:.0%} band; {self.n_points} evaluations up to step {self.last_step})")


def _curve(history: pl.DataFrame) -> pl.DataFrame:
    """step, accuracy, n_samples of a job's history with its accuracy known, one row per step."""
    missing = [c for c in ("step", "accuracy", "n_samples") if c not in history.columns]
    if missing:
        raise ValueError(f"a forecast needs columns {missing}; the history has {history.columns} "
                         "(evaldag.tracking.history.job_history gives them)")
    h = history.select("step", "accuracy", "n_samples").drop_nulls().filter(pl.col("accuracy").is_not_nan())
    dup = h.filter(pl.col("step").is_duplicated())["step"].unique().sort().to_list()
    if dup:
        raise ValueError(f"steps {dup} appear more than once; one evaluation per step (the latest, as job_history "
                         "keeps)")
    return h.sort("step")


def forecast(history: pl.DataFrame, final_step: int, level: float = LEVEL,
             max_extrapolation: float = MAX_EXTRAPOLATION) -> Forecast:
    """Forecast of the accuracy the job's evaluation at `final_step` will measure, from `history` (one row per
    step: step, accuracy, n_samples, as evaldag.tracking.history.job_history gives for one comparison key).

    No forecast (made=False, with the reason) below MIN_POINTS evaluated steps or beyond `max_extrapolation` times
    the last evaluated step. A final step already evaluated is forecast all the same (the band then says how well
    the curve describes it)."""
    if isinstance(final_step, bool) or not isinstance(final_step, (int, np.integer)) or final_step < 1:
        raise ValueError(f"final_step must be an int >= 1 (the job's planned last step), got {final_step!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.8 for an 80 % band, got {level!r}")
    final_step = int(final_step)
    h = _curve(history)
    m = h.height
    last = int(h["step"].max()) if m else 0
    if m < MIN_POINTS:
        return Forecast(final_step, False, f"needs at least {MIN_POINTS} evaluated steps of this job measured "
                        f"alike (4 parameters to fit); {m} so far", level=level, n_points=m, last_step=last)
    if final_step > max_extrapolation * last:
        return Forecast(final_step, False, f"step {final_step} is {final_step / last:.1f}x the last evaluated "
                        f"step {last}; the curve supports at most {max_extrapolation:g}x, so evaluate later "
                        "checkpoints first", level=level, n_points=m, last_step=last)
    step, acc, n = (h[c].cast(pl.Float64).to_numpy() for c in ("step", "accuracy", "n_samples"))
    fit = fit_sigmoid(step, acc, standard_errors(acc, n), final_step)
    value, curve_se = fit.predict(final_step)
    p = float(np.clip(value[0], 0.0, 1.0))
    # the final evaluation's own noise, as large as the last one's: the band is for what it will measure
    noise = standard_errors(np.array([p]), n[-1:])[0]
    half = fit.quantile(level) * math.sqrt(curve_se[0] ** 2 + fit.scale * noise ** 2)
    return Forecast(final_step, True, "", p, max(0.0, p - half), min(1.0, p + half), level, m, last,
                    {"A": fit.A, "R0": fit.R0, "s_mid": fit.s_mid, "B": fit.B, "scale": fit.scale})


# --------------------------------------------------------------------------------------------------------------
# Falling behind
# --------------------------------------------------------------------------------------------------------------

def value_at(history: pl.DataFrame, step: int) -> tuple[float, float, str] | None:
    """A job's accuracy at `step` with its standard error and how it was obtained: its own evaluation there, else
    its fitted curve (MIN_POINTS or more evaluations), else the straight line between the two evaluations around
    it; None when `step` lies outside the evaluated steps (no extrapolation)."""
    h = _curve(history)
    if h.is_empty():
        return None
    steps = h["step"].to_numpy()
    acc = h["accuracy"].cast(pl.Float64).to_numpy()
    se = standard_errors(acc, h["n_samples"].cast(pl.Float64).to_numpy())
    hit = np.flatnonzero(steps == step)
    if hit.size:
        return float(acc[hit[0]]), float(se[hit[0]]), "evaluated"
    if not steps.min() < step < steps.max():
        return None
    if h.height >= MIN_POINTS:
        fit = fit_sigmoid(steps, acc, se)
        f, f_se = fit.predict(step)
        return float(f[0]), float(f_se[0]), "fitted"
    j = int(np.searchsorted(steps, step))
    t = (step - steps[j - 1]) / (steps[j] - steps[j - 1])
    return (float((1 - t) * acc[j - 1] + t * acc[j]), float(math.hypot((1 - t) * se[j - 1], t * se[j])),
            "interpolated")


def falling_behind(job: str, history: pl.DataFrame, others: dict[str, pl.DataFrame],
                   alpha: float = 0.05) -> Diagnostic:
    """Is `job` significantly below another job of `others` (same benchmark, same comparison key) at its latest
    evaluated step?

    Each other job's accuracy at that step is its own evaluation there, else read off its curve (`value_at`: only
    between its evaluated steps). The difference is tested one-sided at alpha / (number of jobs compared)
    (Bonferroni: more jobs to compare with must not mean more false alarms), with the two evaluations taken as
    independent: jobs evaluated on the same problems are positively correlated, so the test is conservative."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    name = "falling_behind"
    h = _curve(history)
    if h.is_empty():
        return Diagnostic(name, False, f"{job} has no evaluation to compare.", "None.", {})
    step = int(h["step"].max())
    own, own_se, _ = value_at(h, step)
    rows = []
    for other, oh in others.items():
        if other == job:
            continue
        found = value_at(oh, step)
        if found is None:
            continue
        value, se, how = found
        diff, diff_se = own - value, math.hypot(own_se, se)
        rows.append({"other": other, "other_accuracy": value, "how": how, "difference": diff,
                     "z": diff / diff_se if diff_se > 0 else (-math.inf if diff < 0 else 0.0)})
    details: dict[str, Any] = {"job": job, "step": step, "accuracy": own, "alpha": alpha, "compared": rows}
    if not rows:
        return Diagnostic(name, False, f"No other job has evaluations around {job}'s step {step} to compare with.",
                          "None.", details)
    z_crit = NormalDist().inv_cdf(1 - alpha / len(rows))
    behind = sorted((r for r in rows if r["z"] < -z_crit), key=lambda r: r["z"])
    details["z_critical"] = z_crit
    if behind:
        worst = behind[0]
        text = (f"{job} at step {step}: {own:.1%}, below {worst['other']} at the same step "
                f"({worst['other_accuracy']:.1%}, {worst['how']}) by {-worst['difference'] * 100:.1f} points "
                f"(z = {worst['z']:.1f}, threshold {-z_crit:.2f}).")
        action = (f"Compare {job}'s settings with {worst['other']}'s (learning rate, data, reward) and read samples "
                  "of both at this step; stop or fix the job if the gap persists.")
        return Diagnostic(name, True, text, action, details)
    text = (f"{job} at step {step} ({own:.1%}) is not significantly behind "
            f"{', '.join(r['other'] for r in rows)} at the same step.")
    return Diagnostic(name, False, text, "None.", details)


__all__ = ["LEVEL", "MAX_EXTRAPOLATION", "MIN_POINTS", "CurveFit", "Forecast", "falling_behind", "fit_sigmoid",
           "forecast", "sigmoid", "standard_errors", "value_at"]

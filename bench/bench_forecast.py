"""Simulation of the forecast (evaldag.decisions.forecast) of a job's accuracy at its planned final step, against a naive
"last value" forecast.

Curve model (stated, not fitted): each simulated job's true accuracy follows the sigmoid that evaldag fits,
acc(s) = A - (A - R0) / (1 + (s / s_mid)^B), with R0 ~ U(0.05, 0.40) (the base model), A = R0 + U(0.10, 0.50)
capped at 0.95, s_mid = T * exp(U(log 0.1, 0)) (half the gain made between 10 % and 100 % of the run: fast and slow
learners), B ~ U(0.8, 3). The job runs T = 2000 steps and is evaluated every T / 20 = 100 steps (20 checkpoints, the
last at T) on a 500-problem benchmark with one greedy sample per problem. Each checkpoint sits off the curve by a
checkpoint effect N(0, tau^2), tau ~ U(0, 0.02) per job (the checkpoint-to-checkpoint variation of an RL policy),
and its measured accuracy is Binomial(500, acc + effect) / 500. The target is the accuracy measured at step T (the
final evaluation, checkpoint effect and binomial noise included): what the user will see.

Regimes: the forecast is made after the first K checkpoints (K = 4: too few, no forecast; 5: 25 % of the run,
4x extrapolation, the most evaldag allows; 8, 10, 15). Printed per regime: forecasts made, coverage of the 80 % band
(goal 70-90 %), its median width, the mean absolute error of the point forecast; and for the naive forecast (the
last measured value, with its own 80 % binomial interval) the same three. Fewer curves with --curves.
Run: .venv/bin/python bench/bench_forecast.py   (about 40 s on 2 cores)
"""

from __future__ import annotations

import argparse
import math
import time

import _common  # noqa: F401  (puts the project on sys.path)
import numpy as np
import polars as pl

from evaldag.decisions.forecast import forecast, sigmoid

T, EVERY, N = 2000, 100, 500
Z80 = 1.2816


def simulate(rng: np.random.Generator, curves: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, measured accuracies (curves, 20)) of `curves` simulated jobs (see the module docstring)."""
    steps = np.arange(EVERY, T + 1, EVERY)
    acc = np.empty((curves, steps.size))
    for i in range(curves):
        R0 = rng.uniform(0.05, 0.40)
        A = min(0.95, R0 + rng.uniform(0.10, 0.50))
        truth = sigmoid(steps, A, R0, T * math.exp(rng.uniform(math.log(0.1), 0.0)), rng.uniform(0.8, 3.0))
        effect = rng.normal(0.0, rng.uniform(0.0, 0.02), steps.size)
        acc[i] = rng.binomial(N, np.clip(truth + effect, 0.0, 1.0)) / N
    return steps, acc


def regime(steps: np.ndarray, acc: np.ndarray, k: int) -> dict:
    """The forecast and the naive one after k checkpoints, scored against the measured final value."""
    final = acc[:, -1]
    made, cover, width, err = [], [], [], []
    for row in acc:
        f = forecast(pl.DataFrame({"step": steps[:k], "accuracy": row[:k], "n_samples": [float(N)] * k}), T)
        made.append(f.made)
        if f.made:
            cover.append(f.low <= row[-1] <= f.high)
            width.append(f.width)
            err.append(abs(f.value - row[-1]))
    last = acc[:, k - 1]
    half = Z80 * np.sqrt(last * (1 - last) / N)
    return {"K": k, "share of run": k / steps.size, "extrapolation": T / steps[k - 1], "made": np.mean(made),
            "coverage": np.mean(cover) if cover else math.nan, "width": np.median(width) if width else math.nan,
            "abs error": np.mean(err) if err else math.nan,
            "naive coverage": np.mean(np.abs(final - last) <= half), "naive width": np.median(2 * half),
            "naive abs error": np.mean(np.abs(final - last))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--curves", type=int, default=500, help="simulated jobs per regime")
    parser.add_argument("--seed", type=int, default=20261203)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    rows = []
    for k in (4, 5, 8, 10, 15):
        steps, acc = simulate(rng, args.curves)
        rows.append(regime(steps, acc, k))
    print(f"{args.curves} simulated jobs per regime, 500 problems per evaluation, final step {T}; "
          f"{time.perf_counter() - t0:.0f} s")
    head = (f"{'K':>3} {'run':>5} {'extrap':>6} {'made':>5} | {'cover80':>7} {'width':>6} {'|err|':>6} | "
            f"{'naive cover':>11} {'width':>6} {'|err|':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['K']:>3} {r['share of run']:>5.0%} {r['extrapolation']:>5.1f}x {r['made']:>5.0%} | "
              f"{r['coverage']:>7.1%} {r['width']:>6.3f} {r['abs error']:>6.3f} | "
              f"{r['naive coverage']:>11.1%} {r['naive width']:>6.3f} {r['naive abs error']:>6.3f}")
    print("cover80: share of jobs whose measured final accuracy lies in the 80 % band (goal 70-90 %); width: median "
          "band width; |err|: mean absolute error of the point forecast. naive: the last measured value with its "
          "80 % binomial interval.")


if __name__ == "__main__":
    main()

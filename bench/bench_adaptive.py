"""Simulation of adaptive samples (evaldag.decisions.adaptive) against fixed n = 32 samples per problem.

Difficulty models (stated, not fitted):
- AIME-like, 30 problems: 30 % never solved (p = 0), 10 % always solved (p = 1), the rest p ~ Beta with mean 0.45
  and concentration 1.5 (U-shaped, as bench/bench_decide.py's levels); mean accuracy ~0.37. The point masses stand
  for what pass@k curves of RL-trained models show on AIME: pass@k flattens near 70 % by k = 64-256, so about a
  third of the problems are out of reach at any n one would run; a few are solved every time.
- AIME-like without point masses ("AIME, Beta only"): all 30 problems p ~ Beta(mean 0.37, concentration 1.5).
- MATH-500-like: bench/bench_decide.py's model, 500 problems in MATH-500's five levels, Beta means
  (0.85, 0.70, 0.55, 0.40, 0.20), concentration 1.5; mean accuracy ~0.47.
A fresh problem set is drawn for every simulated evaluation; samples are Bernoulli(p) given p. The target of the
estimate and of the interval is the drawn set's mean solve rate (the problem set held fixed).

Printed per model, for two adaptive designs (at most 64 samples per problem): n0 = 12, floor = 4 (the default, the
best of bench/study_adaptive.py's design study) and n0 = 4, floor = 4 (the earlier default):
- oracle: the fraction of fixed n = 32's samples that Neyman's allocation with the solve rates known would need for
  the same standard error (mean sqrt(p(1-p)))^2 / mean p(1-p): no design that allocates by problem does better;
- for budgets of 0.35 to 1.0 x fixed n = 32's samples: the root mean squared error of the adaptive estimate over
  fixed n = 32's (1.0 = as precise), the mean reported interval width over fixed n = 32's (same interval method),
  the bias of the estimate in percentage points (with its standard error), and the coverage of the 95 % interval;
- samples needed to match fixed n = 32's precision: the budget where the mean width ratio crosses 1 (interpolated;
  the RMSE ratio is far noisier at these run counts: bench/study_adaptive.py has 4000-run figures);
- for contrast, the bias of the naive estimate (each problem's mean of all its samples) on the same runs;
- target_ci_width mode: with the target set to fixed n = 32's width on the same set, the samples spent and the width
  reached.
Run: .venv/bin/python bench/bench_adaptive.py   (about 150 s on 2 cores)
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (puts the project on sys.path)
import numpy as np
import polars as pl

from evaldag.decisions.adaptive import AdaptiveSettings, estimate, next_round

FIXED_N = 32
DESIGNS = {"n0=12 (default)": {"n0": 12, "floor": 4, "max_per_problem": 64},
           "n0=4 (earlier default)": {"n0": 4, "floor": 4, "max_per_problem": 64}}
LEVEL_COUNTS = (43, 90, 105, 128, 134)      # bench_decide.py's MATH-500 model
LEVEL_MEANS = (0.85, 0.70, 0.55, 0.40, 0.20)
KAPPA = 1.5


def beta(rng: np.random.Generator, mean: float, size: int) -> np.ndarray:
    return rng.beta(mean * KAPPA, (1 - mean) * KAPPA, size)


def aime_like(rng: np.random.Generator) -> np.ndarray:
    u = rng.random(30)
    return np.where(u < 0.3, 0.0, np.where(u < 0.4, 1.0, beta(rng, 0.45, 30)))


def aime_beta_only(rng: np.random.Generator) -> np.ndarray:
    return beta(rng, 0.37, 30)


def math500_like(rng: np.random.Generator) -> np.ndarray:
    return np.concatenate([beta(rng, mu, k) for mu, k in zip(LEVEL_MEANS, LEVEL_COUNTS)])


def evaluate(p: np.ndarray, settings: AdaptiveSettings, rng: np.random.Generator) -> tuple[object, float]:
    """One simulated evaluation driven round by round through the API: (estimate, naive pooled estimate)."""
    m = p.size
    counts = pl.DataFrame({"sample_id": np.arange(m), "n": np.zeros(m, np.int64), "correct": np.zeros(m, np.int64),
                           "first_correct": np.zeros(m, np.int64)})
    while True:
        more = next_round(counts, settings)["more"].to_numpy()
        if more.sum() == 0:
            break
        first = counts["n"].to_numpy() < settings.n0
        got = rng.binomial(more, p)
        counts = counts.with_columns(n=pl.col("n") + more, correct=pl.col("correct") + got,
                                     first_correct=pl.col("first_correct") + np.where(first, got, 0))
    naive = float((counts["correct"] / counts["n"]).mean())
    return estimate(counts, settings), naive


def fixed(m: int) -> AdaptiveSettings:
    """Fixed n = 32 as the degenerate design: a first round of 32 and nothing after (the same interval method)."""
    return AdaptiveSettings(n0=FIXED_N, floor=0, max_per_problem=FIXED_N, budget=FIXED_N * m)


def scenario(name: str, draw, runs: int, fractions: tuple[float, ...], rng: np.random.Generator) -> None:
    sets = [draw(rng) for _ in range(runs)]
    m = sets[0].size
    pq = np.array([p * (1 - p) for p in sets])
    oracle = float(np.mean(np.sqrt(pq).mean(axis=1) ** 2 / np.maximum(pq.mean(axis=1), 1e-12)))
    truth = np.array([p.mean() for p in sets])
    ref = [evaluate(p, fixed(m), rng)[0] for p in sets]
    ref_err = np.array([e.mean for e in ref]) - truth
    ref_rmse = float(np.sqrt(np.mean(ref_err ** 2)))
    ref_width = np.array([e.ci_high - e.ci_low for e in ref])
    ref_cover = np.mean([e.ci_low <= t <= e.ci_high for e, t in zip(ref, truth)])
    print(f"\n{name}: {m} problems, {runs} simulated evaluations, mean accuracy {truth.mean():.3f}; "
          f"oracle Neyman allocation needs {oracle:.2f} x fixed n=32's samples")
    print(f"  fixed n=32: RMSE {ref_rmse * 100:.2f} points, mean width {ref_width.mean() * 100:.2f} points, "
          f"bias {ref_err.mean() * 100:+.3f} pp, coverage {ref_cover:.1%}")
    for label, design in DESIGNS.items():
        print(f"  adaptive {label}: {design}")
        print(f"  {'budget':>7} {'RMSE/fixed':>10} {'width/fixed':>11} {'bias pp':>16} {'coverage':>9} "
              f"{'naive bias pp':>13}")
        ratios = []
        usable = [f for f in fractions if f * FIXED_N >= design["n0"] + design["floor"]]   # pays round 1 + floor
        for frac in usable:
            settings = AdaptiveSettings(**design, budget=int(frac * FIXED_N * m))
            out = [evaluate(p, settings, rng) for p in sets]
            err = np.array([e.mean for e, _ in out]) - truth
            naive = np.array([n for _, n in out]) - truth
            width = np.array([e.ci_high - e.ci_low for e, _ in out])
            cover = np.mean([e.ci_low <= t <= e.ci_high for (e, _), t in zip(out, truth)])
            rmse = float(np.sqrt(np.mean(err ** 2)))
            ratios.append(width.mean() / ref_width.mean())
            bias_se = err.std(ddof=1) / np.sqrt(runs)
            print(f"  {frac:>6.2f}x {rmse / ref_rmse:>10.2f} {width.mean() / ref_width.mean():>11.2f} "
                  f"{err.mean() * 100:>+8.3f} +- {bias_se * 100:.3f} {cover:>9.1%} {naive.mean() * 100:>+13.2f}")
        above = [i for i, r in enumerate(ratios) if r <= 1.0]
        if not above:
            need = f"more than {usable[-1]:.2f}x"
        elif above[0] == 0:
            need = f"at most {usable[0]:.2f}x"
        else:   # linear interpolation of the width ratio between the two budgets around 1
            i = above[0]
            f0, f1, r0, r1 = usable[i - 1], usable[i], ratios[i - 1], ratios[i]
            need = f"{f0 + (r0 - 1) / (r0 - r1) * (f1 - f0):.2f}x"
        print(f"  samples to match fixed n=32's interval width: {need} (goal <= 0.5x)")
        target_runs = sets[: max(runs // 4, 50)]
        spent, reached = [], []
        for p, e in zip(target_runs, ref):
            settings = AdaptiveSettings(**design, target_ci_width=e.ci_high - e.ci_low)
            got, _ = evaluate(p, settings, rng)
            spent.append(got.samples / (FIXED_N * m))
            reached.append((got.ci_high - got.ci_low) / (e.ci_high - e.ci_low))
        print(f"  target_ci_width = fixed n=32's width: median samples {np.median(spent):.2f}x, median width reached "
              f"{np.median(reached):.2f}x the target ({len(target_runs)} runs; the plan caps at "
              f"{design['max_per_problem']} per problem)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=500, help="simulated evaluations per AIME-like scenario")
    ap.add_argument("--math-runs", type=int, default=30, help="simulated evaluations of the MATH-500-like set")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    print(f"fixed: n={FIXED_N}; intervals at 95 % for the drawn problem set")
    scenario("AIME-like", aime_like, args.runs, (0.35, 0.5, 0.75, 0.85, 1.0), rng)
    scenario("AIME, Beta only", aime_beta_only, args.runs // 2, (0.5, 0.75, 0.9, 1.0), rng)
    scenario("MATH-500-like", math500_like, args.math_runs, (0.5, 0.75, 0.9, 1.0), rng)
    print(f"\nwall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

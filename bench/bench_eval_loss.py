"""What eval_loss costs: scoring a benchmark's reference solutions against generating its completions, one engine.

Loads the default model once on the engine asked for (default: the deployment's default engine), sized for both the
generation and the scoring, then times the generation of the first `--problems` problems with the benchmark's own
sampling, and the scoring of their reference solutions (evaldag.scoring.eval_loss), in the same process. Prints both
times (wall and this process's CPU seconds), the cost of scoring as a share of generation + scoring, and the
eval_loss. Usage:
  .venv/bin/python bench/bench_eval_loss.py [--benchmark math500] [--problems 20] [--engine vllm|hf]
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: E402,F401  (the project on sys.path, EVALDAG_DATA_DIR)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--benchmark", default="math500")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--engine", default=None, help="vllm or hf (default: the deployment's default engine)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias or checkpoint folder")
    args = ap.parse_args()

    from dataclasses import replace

    from evaldag import engines
    from evaldag.engines.workload import Workload
    from evaldag.request.checkpoint import resolve_model
    from evaldag.request.config import load_benchmark
    from evaldag.request.datasets import load_benchmark_rows, load_solutions
    from evaldag.scoring.eval_loss import eval_loss_metrics, per_problem_losses, reference_text, score_solutions

    bench = load_benchmark(args.benchmark)
    inputs = load_benchmark_rows(bench, limit=args.problems).inputs
    prompts, ids = inputs["prompt"].to_list(), inputs["sample_id"].to_list()
    solutions = [reference_text(s, bench.gold_format) for s in load_solutions(bench, ids)]
    model = resolve_model(args.model)
    if args.engine:
        model = replace(model, engine=args.engine, engine_args={})
    gen = engines.workload(model, prompts, bench.sampling)
    tok_lens = None
    t0 = time.perf_counter()
    if gen is not None:     # an engine that sizes itself: sized for the longest prompt + solution too
        from transformers import AutoTokenizer

        from evaldag.engines.base import chat_text
        tok = AutoTokenizer.from_pretrained(model.path)
        tok_lens = [len(tok(chat_text(tok, p) + s, add_special_tokens=False)["input_ids"])
                    for p, s in zip(prompts, solutions)]
        gen = gen.covering(Workload(max(tok_lens) + 1, len(prompts), True))
    engine = engines.load_engine(model.engine, model.path, model.dtype, model.batch_size, model.engine_args,
                                 workload=gen)
    load_s = time.perf_counter() - t0
    print(f"{args.benchmark}, {len(prompts)} problems, {model.engine} ({model.dtype}), load {load_s:.1f} s",
          flush=True)
    # scoring first: its figure comes out even when a slow generation is cut short
    t2, c2 = time.perf_counter(), time.process_time()
    logprobs = score_solutions(engine, prompts, solutions)
    score_s, score_cpu = time.perf_counter() - t2, time.process_time() - c2
    metrics = eval_loss_metrics(per_problem_losses(ids, logprobs))
    print(f"eval_loss scoring: {score_s:.2f} s wall, {score_cpu:.2f} s CPU "
          f"({int(metrics['eval_loss_tokens'])} solution tokens)", flush=True)
    t1, c1 = time.perf_counter(), time.process_time()
    out = engine.generate(prompts, bench.sampling)
    gen_s, gen_cpu = time.perf_counter() - t1, time.process_time() - c1
    tokens = sum(c[0].completion_tokens for c in out)
    print(f"generation: {gen_s:.2f} s wall, {gen_cpu:.2f} s CPU ({tokens} tokens, max_new_tokens "
          f"{bench.sampling.max_new_tokens})")
    # CPU seconds of this process (its threads, vLLM's in-process engine included) as well as wall seconds: on a
    # shared machine the wall figures move with the other load, the CPU ones much less
    for what, s, g in (("wall", score_s, gen_s), ("CPU", score_cpu, gen_cpu)):
        print(f"cost ({what}): {100 * s / (g + s):.1f} % of generation + scoring "
              f"({100 * s / g:.1f} % of generation alone)")
    print(f"eval_loss {metrics['eval_loss']:.4f} (se {metrics.get('eval_loss_se', float('nan')):.4f}), "
          f"token-weighted {metrics['eval_loss/token_weighted']:.4f}")
    engine.close()


if __name__ == "__main__":
    main()

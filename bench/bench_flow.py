"""Orchestration figures on the real local stack, each a ratio of two runs measured in this one command.

  1. cached re-run / first run: the same request again, every stage found in the result store
  2. full flow / engine only: the first run's wall against loading the engine and generating the same batches of
     the same prompts in this process (what orchestration, per-shard model loads, grading and MLflow cost)
  3. 1 worker / 2 workers makespan: the same evaluation from scratch with one gpu-pool worker, then with two
     (on this CPU box the two share its cores; each worker's torch uses cores / workers threads)

It starts its own stack (temporary home, free ports) and stops it at the end.

    .venv/bin/python bench/bench_flow.py [--benchmark gsm8k] [--limit 32] [--shards 4] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from _common import free_ports  # noqa: E402  (also: the project on sys.path, EVALDAG_DATA_DIR)



def _run(benchmark: str, params: dict) -> tuple[float, dict]:
    from prefect.deployments import run_deployment

    from evaldag.runtime.deployments import eval_deployment

    t0 = time.perf_counter()
    fr = run_deployment(eval_deployment(benchmark), parameters=params, timeout=None, poll_interval=1)
    wall = time.perf_counter() - t0
    if not fr.state.is_completed():
        raise SystemExit(f"evaluation ended {fr.state.type.value}: {fr.state.message}")
    return wall, fr.state.result()


def _engine_only(plan) -> float:
    """Load the engine once per shard (as the shards do) and generate the same batches of the same prompts."""
    from evaldag.engines import load_engine

    m = plan.model
    t0 = time.perf_counter()
    for shard in range(plan.num_shards):
        prompts = plan.shard_inputs(shard)["prompt"].to_list()
        engine = load_engine(m.engine, m.path, m.dtype, m.batch_size, m.engine_args)
        for b, idx in enumerate(engine.plan_batches(prompts, plan.sampling)):
            engine.generate_batch([prompts[i] for i in idx], plan.sampling, b)
        engine.close()
    return time.perf_counter() - t0


def _forget(plan) -> None:
    """Delete the evaluation's stage outputs and folder, so the next run computes everything again."""
    from evaldag.storage import store

    store.remove_tree(store.as_path(plan.stage_dir))
    store.remove_tree(store.as_path(plan.result_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="evaldag-bench-flow-"))
    os.environ["EVALDAG_HOME"] = str(home)
    os.environ.pop("EVALDAG_RESULTS_URL", None)
    os.environ.pop("EVALDAG_RESULTS_DIR", None)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from evaldag.request.plan import load_plan
    from evaldag.runtime.stack import Stack, StackSettings

    prefect_port, mlflow_port = free_ports(2)
    settings = dict(home=home / "stack", prefect_port=prefect_port, mlflow_port=mlflow_port)
    stack = Stack(StackSettings(**settings, num_gpus=1))
    params = {"limit": args.limit, "num_shards": args.shards, "train_run": "bench-flow",
              "sampling": {"max_new_tokens": args.max_new_tokens}}
    figures: dict[str, float] = {}
    try:
        stack.up(deploy=True)
        os.environ.update({"PREFECT_API_URL": stack.settings.prefect_api_url, "MLFLOW_TRACKING_URI": stack.mlflow_url,
                           "EVALDAG_HOME": str(stack.home)})
        with temporary_settings(updates={PREFECT_API_URL: stack.settings.prefect_api_url}):
            first, summary = _run(args.benchmark, {**params, "step": 1})
            plan = load_plan(Path(stack.home) / "results" / args.benchmark / summary["eval_key"][:24] / "plan.json")
            cached, again = _run(args.benchmark, {**params, "step": 1})
            assert again["metrics"]["cache_hit_rate"] == 1.0, again["metrics"]["cache_hit_rate"]
            engine = _engine_only(plan)

            _forget(plan)
            one, _ = _run(args.benchmark, {**params, "step": 1})
            stack = Stack(StackSettings(**settings, num_gpus=2))
            stack.up(deploy=False)
            _forget(plan)
            two, _ = _run(args.benchmark, {**params, "step": 1})
    finally:
        Stack(StackSettings(**settings)).down()

    figures = {"first_run_s": first, "cached_rerun_s": cached, "engine_only_s": engine,
               "makespan_1_worker_s": one, "makespan_2_workers_s": two,
               "cached_over_first": cached / first, "flow_over_engine_only": first / engine,
               "speedup_2_workers_over_1": one / two}
    print(f"workload: {args.benchmark}, {plan.n_problems} problems in {plan.num_shards} shards, "
          f"{args.max_new_tokens} new tokens, greedy, {os.cpu_count()} CPUs")
    print(f"  first run                 {first:8.1f} s")
    print(f"  cached re-run             {cached:8.1f} s   ratio cached/first        {cached / first:6.3f}")
    print(f"  engine only, same batches {engine:8.1f} s   ratio flow/engine-only    {first / engine:6.2f}")
    print(f"  makespan, 1 worker        {one:8.1f} s")
    print(f"  makespan, 2 workers       {two:8.1f} s   ratio 1 worker/2 workers  {one / two:6.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

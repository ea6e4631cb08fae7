"""A shard's generation against the bare engine's under a low-priority CPU-bound neighbour (issue 40), in one command.

    .venv/bin/python bench/bench_contention.py [--limit 40] [--max-new-tokens 256]

Two ways to generate the first `--limit` MATH-500 problems, each a fresh process timed from start to end (imports,
engine load, generation):
  - bare engine: a script that loads evaldag's engine and generates the prompts, started as a user starts a script
    (in this command's session);
  - shard: `generate_shard` on a resolved plan, started through evaldag's flow-run launcher
    (`evaldag.runtime.flow_run_launcher.launch`), as the local stack's workers start every flow run.
Each runs quiet, then beside `nice -n 19 python -c "while True: pass"` started in this command's session, then
beside the same neighbour started in a session of its own (as from another terminal or login). Printed: each wall
and its slowdown against the quiet one.

Why the session matters: with the kernel's autogroup scheduling on (`/proc/sys/kernel/sched_autogroup_enabled`, the
default of most desktop and server kernels), CPU time is shared fairly between sessions first and by nice only
within a session, so a nice 19 process in another session gets as much CPU as the engine's whole session.
docs/performance.md has the figures and what an operator can do about it.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import _common

NEIGHBOUR = ["nice", "-n", "19", sys.executable, "-c", "while True: pass"]

BARE = """\
from evaldag.request.config import load_benchmark
from evaldag.request.datasets import load_benchmark_rows
from evaldag.engines import engine_for, workload
from evaldag.request.checkpoint import resolve_model
if __name__ == "__main__":
    bench = load_benchmark("math500")
    sampling = bench.sampling.model_copy(update={{"max_new_tokens": {tokens}}})
    prompts = load_benchmark_rows(bench, {limit}).inputs["prompt"].to_list()
    model = resolve_model("smollm2-135m-instruct")
    with engine_for(model, workload(model, prompts, sampling)) as got:
        got.engine.generate(prompts, sampling)
"""

SHARD = """\
from pathlib import Path
from evaldag.pipeline.generate import generate_shard
from evaldag.request.plan import EvalRequest, resolve
if __name__ == "__main__":
    plan = resolve(EvalRequest(benchmark="math500", limit={limit}, num_shards=1, engine="vllm",
                               sampling={{"max_new_tokens": {tokens}}}), Path({results!r}))
    generate_shard(plan, 0)
"""


def autogroup() -> str:
    try:
        return "on" if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1" else "off"
    except OSError:
        return "not in this kernel"


def timed(code: str, launched: bool, limit_s: float | None) -> float:
    """The wall of a fresh process running `code` (`launched`: through the flow-run launcher), or infinity if it
    ran past `limit_s` (then it is stopped with everything it started)."""
    env = {**os.environ, "EVALDAG_DATA_DIR": os.environ["EVALDAG_DATA_DIR"]}
    argv = [sys.executable, "-c", code]
    if launched:
        argv = [sys.executable, "-c", "import sys; from evaldag.runtime.flow_run_launcher import launch; "
                f"sys.exit(launch({argv!r}))"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=_common.REPO, process_group=0)
    try:
        _, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return math.inf
    if proc.returncode != 0:
        raise SystemExit(f"the measured process failed:\n{err[-3000:]}")
    return time.perf_counter() - t0


def _times(x: float, give_up: float) -> str:
    return f"x{x:.2f}" if math.isfinite(x) else f"> x{give_up:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--give-up", type=float, default=6.0,
                    help="stop a run after this many times its quiet wall and print it as longer (default 6)")
    args = ap.parse_args()

    print(f"autogroup scheduling: {autogroup()}; {os.cpu_count()} CPUs; {args.limit} MATH-500 problems, "
          f"{args.max_new_tokens} tokens, the default model")
    with tempfile.TemporaryDirectory(prefix="evaldag-bench-") as tmp:
        runners = {"bare engine": (BARE.format(limit=args.limit, tokens=args.max_new_tokens), False)}
        walls: dict[tuple[str, str], float] = {}
        for condition in ("quiet", "neighbour in this session", "neighbour in its own session"):
            neighbour = None
            if condition != "quiet":
                neighbour = subprocess.Popen(NEIGHBOUR, start_new_session=condition.endswith("own session"))
            try:
                for k, name in enumerate(("bare engine", "shard")):
                    if name == "shard":   # a new results folder each time: a shard reuses its generations
                        runners[name] = (SHARD.format(limit=args.limit, tokens=args.max_new_tokens,
                                                      results=f"{tmp}/{condition}"), True)
                    code, launched = runners[name]
                    quiet = walls.get((name, "quiet"))
                    wall = timed(code, launched, None if quiet is None else args.give_up * quiet)
                    walls[name, condition] = wall
                    quiet = quiet or wall
                    shown = (f"{wall:6.1f} s  x{wall / quiet:.2f}" if math.isfinite(wall)
                             else f"> {args.give_up * quiet:.0f} s  > x{args.give_up:g} (stopped)")
                    print(f"  {name:<12} {condition:<29} {shown}", flush=True)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    for condition in ("neighbour in this session", "neighbour in its own session"):
        bare = walls["bare engine", condition] / walls["bare engine", "quiet"]
        shard = walls["shard", condition] / walls["shard", "quiet"]
        ratio = f"{shard / bare:.2f}" if math.isfinite(shard) and math.isfinite(bare) else "n/a: a run was stopped"
        print(f"contention, {condition}: bare engine {_times(bare, args.give_up)}, shard {_times(shard, args.give_up)}"
              f" (shard / bare {ratio})")


if __name__ == "__main__":
    main()

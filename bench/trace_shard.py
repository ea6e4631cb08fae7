"""How often following a shard's generation enters each module of evaldag (issue 42): the reading path a newcomer takes
from the generate task's `plan_path` down (tasks/shard_stages.py: load the plan, generate the shard), as the code
really runs it.

    .venv/bin/python bench/trace_shard.py                     # 4 MATH-500 problems, 16 tokens, vLLM (~1 min)
    .venv/bin/python bench/trace_shard.py --engine hf --path  # the transformers engine; print every stop

The trace: one shard's generation runs under a profiler hook (`sys.setprofile`, every thread) that records each
function of evaldag/ the first time it is called, in call order: a stop. Read once, a function is not a stop again
(loops, retries and later calls are the same code). Entering a module is a stop in it after a stop in another
module; a module entered three times is read in three separate visits. Nested code (lambdas, comprehensions,
generator expressions) belongs to the function around it. Printed: the stops, the modules entered more than once with
their count, and the largest count; with `--path`, the stops in order.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import _common

PACKAGE = str(_common.REPO / "evaldag")


def handed(frame, follow: tuple) -> bool:
    """Whether a call's arguments (self included) hold one of the objects followed, the plan path, or an object made
    from the plan that carries it (a ShardPlan's `plan`, a ShardRun's): following the plan follows those too."""
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(n) for n in names]
    values += [_plan_of(v) for v in values if not isinstance(v, str)]
    return any(v is x or (isinstance(v, str) and isinstance(x, str) and v == x) for v in values for x in follow)


def _plan_of(value: object) -> object:
    """`value.plan` where it has one (any object passes here: a failing attribute lookup is not one)."""
    try:
        return getattr(value, "plan", None)
    except Exception:
        return None


def trace(run, follow: tuple = ()) -> list[tuple[str, str]]:
    """Run `run()` and return its stops: (module path under evaldag/, function name), first calls in order; with
    `follow`, only the calls handed one of those objects."""
    seen: set = set()
    stops: list[tuple[str, str]] = []
    lock = threading.Lock()

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code in seen or not code.co_filename.startswith(PACKAGE) or code.co_name.startswith("<"):
            return
        if follow and not handed(frame, follow):
            return
        with lock:
            if code not in seen:
                seen.add(code)
                stops.append((str(Path(code.co_filename).relative_to(_common.REPO)), code.co_qualname))

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return stops


def entries(stops: list[tuple[str, str]]) -> Counter:
    """How many times the path enters each module: its runs of consecutive stops."""
    count: Counter = Counter()
    previous = None
    for module, _ in stops:
        if module != previous:
            count[module] += 1
        previous = module
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmark", default="math500")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--path", action="store_true", help="print every stop in order")
    ap.add_argument("--handed", action="store_true",
                    help="only the functions handed the plan or its path (what the issue followed), not every call")
    args = ap.parse_args()

    from evaldag.pipeline.generate import generate_shard
    from evaldag.request.plan import EvalRequest, load_plan, resolve

    with tempfile.TemporaryDirectory(prefix="evaldag-trace-") as tmp:
        plan = resolve(EvalRequest(benchmark=args.benchmark, limit=args.limit, num_shards=1, engine=args.engine,
                                   sampling={"max_new_tokens": args.max_new_tokens}), Path(tmp) / "results")
        plan_path = str(plan.path("plan.json"))
        # generate_task's body, less the Prefect progress artifact (a callback that publishes what it is handed)
        # --handed follows the plan: load_plan keeps one object per file version, so this one is the one handed on
        follow = (load_plan(plan_path), plan_path) if args.handed else ()
        stops = trace(lambda: generate_shard(load_plan(plan_path), 0, lambda p: None), follow)
    if args.path:
        for k, (module, name) in enumerate(stops, 1):
            print(f"{k:4d}  {module}:{name}")
    count = entries(stops)
    print(f"a shard's generation ({args.engine}): {len(stops)} stops in {len(count)} modules")
    for module, n in count.most_common():
        if n > 1:
            print(f"  {module}: entered {n} times")
    module, n = count.most_common(1)[0]
    print(f"most entered: {module}, {n} times")


if __name__ == "__main__":
    main()

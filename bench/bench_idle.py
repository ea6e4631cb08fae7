"""CPU an idle local stack uses, by component, at given worker poll intervals (issue 40: the Prefect server idle under
5 % of a core).

For each interval: a stack of its own (temporary EVALDAG_HOME, free ports, deployed as `evaldag up` does), `--settle`
seconds after `up`, then the CPU times of each component's process tree over `--window` seconds, as % of one core. The workers are
the stack's own (evaldag.runtime.wake_worker: woken by the server's events, polling at the interval), so the
intervals differ only in the poll. Keep the box quiet: anything else running is counted in nobody's figure but
slows the server's answers.

Run: .venv/bin/python bench/bench_idle.py --polls 2,10   (about 2.5 min per interval)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil

from evaldag.runtime.stack import Stack, StackSettings


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its children now."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return total


def window_use(stack: Stack, window: float) -> dict[str, float]:
    """% of a core per component of `stack` over the next `window` seconds."""
    pids = {row.component: row.pid for row in stack.status()}
    before = {name: _tree_cpu(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - t0
    return {name: 100 * (_tree_cpu(pid) - before[name]) / elapsed for name, pid in pids.items()}


def measure(poll: float, settle: float, window: float, deploy: bool = True, home: Path | None = None
            ) -> dict[str, float]:
    """% of a core per component of an idle stack polling every `poll` seconds (a fresh one, or the one of
    EVALDAG_HOME `home` on the default ports, with its history)."""
    with tempfile.TemporaryDirectory() as fresh:
        prefect_port, mlflow_port = (4200, 5000) if home else _free_ports(2)
        stack = Stack(StackSettings(home=home or Path(fresh), prefect_port=prefect_port, mlflow_port=mlflow_port,
                                    num_gpus=1, worker_query_seconds=poll))
        try:
            stack.up(deploy=deploy)
            time.sleep(settle)
            return window_use(stack, window)
        finally:
            stack.down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--polls", default="2,10", help="worker poll intervals, seconds, comma-separated")
    ap.add_argument("--settle", type=float, default=90.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--no-deploy", action="store_true", help="a stack without its deployments and automations")
    ap.add_argument("--home", type=Path, default=None, help="measure the stack of this EVALDAG_HOME (its database "
                    "with what earlier evaluations left) instead of a fresh one; it is stopped at the end")
    ap.add_argument("--attach", action="store_true", help="measure the running stack of --home as it is (its "
                    "own poll interval; nothing started or stopped), e.g. minutes after an evaluation")
    args = ap.parse_args()
    if args.attach:
        stack = Stack(StackSettings.from_env().model_copy(update={"home": args.home} if args.home else {}))
        use = window_use(stack, args.window)
        parts = ", ".join(f"{k} {v:.1f} %" for k, v in sorted(use.items()))
        print(f"idle stack as it runs: all {sum(use.values()):.1f} % of a core ({parts}; {args.window:.0f} s "
              f"window)", flush=True)
        return
    for poll in (float(p) for p in args.polls.split(",")):
        use = measure(poll, args.settle, args.window, not args.no_deploy, args.home)
        server = next((v for k, v in use.items() if "prefect" in k), float("nan"))
        parts = ", ".join(f"{k} {v:.1f} %" for k, v in sorted(use.items()))
        print(f"idle stack, workers polling every {poll:g} s: Prefect server {server:.1f} % of a core, "
              f"all {sum(use.values()):.1f} % ({parts}; {args.window:.0f} s window, {args.settle:.0f} s after up"
              f"{', no deployments' if args.no_deploy else ''}{f', home {args.home}' if args.home else ', fresh'})",
              flush=True)


if __name__ == "__main__":
    main()

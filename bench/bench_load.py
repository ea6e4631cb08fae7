"""Load on the Prefect server: 16 shards through 4 gpu workers at once, with the server on SQLite, then PostgreSQL.

For each database a fresh stack (temporary home, free ports; a private PostgreSQL cluster for the second, as
`evaldag up --postgres` starts it) with 4 unpinned gpu workers runs one evaluation of 16 shards (gsm8k, one problem
per shard, few new tokens: the model work is small, the orchestration is not: 17 flow runs, their task runs, logs,
heartbeats, GPU-slot leases). While it runs, a probe sends what clients send (read flow runs, read the gpu pool's
workers, write a log line, read task runs) every 0.2 s and times each request. Failures are requests that erred
plus flow runs that did not complete. Printed per database: wall, runs completed, failures, API latency p50/p95/max;
then the PostgreSQL/SQLite ratios.

    .venv/bin/python bench/bench_load.py [--shards 16] [--workers 4] [--max-new-tokens 8] [--only sqlite|postgres]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from _common import free_ports  # noqa: E402  (also: the project on sys.path, EVALDAG_DATA_DIR)



class Probe(threading.Thread):
    """Sends a client's mix of requests every `every` s until stopped; keeps each latency and each failure."""

    def __init__(self, api: str, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.api, self.every = api, every
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._halt = threading.Event()

    def _requests(self, flow_run_id: str | None):
        yield "POST", "/flow_runs/filter", {"limit": 50, "sort": "START_TIME_DESC"}
        yield "POST", "/work_pools/gpu/workers/filter", {}
        yield "POST", "/task_runs/filter", {"limit": 50}
        if flow_run_id:
            yield "POST", "/logs/", [{"name": "bench-load", "level": 20, "message": "probe",
                                      "timestamp": datetime.now(timezone.utc).isoformat(),
                                      "flow_run_id": flow_run_id}]

    def run(self) -> None:
        import httpx

        with httpx.Client(base_url=self.api, timeout=30) as client:
            while not self._halt.is_set():
                for method, path, body in self._requests(getattr(self, "flow_run_id", None)):
                    t0 = time.perf_counter()
                    try:
                        r = client.request(method, path, json=body)
                        if r.status_code >= 400:
                            self.errors.append(f"{method} {path}: HTTP {r.status_code}")
                    except httpx.HTTPError as e:
                        self.errors.append(f"{method} {path}: {type(e).__name__}")
                    self.latencies.append(time.perf_counter() - t0)
                self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def measure(database: str, shards: int, workers: int, max_new_tokens: int) -> dict:
    """One stack on `database`, one evaluation of `shards` shards through `workers` gpu workers."""
    home = Path(tempfile.mkdtemp(prefix=f"evaldag-bench-load-{database}-"))
    pg_root = None
    prefect_port, mlflow_port, pg_port = free_ports(3)
    extra: dict = {}
    if database == "postgres":
        pg_root = Path(tempfile.mkdtemp(prefix="evaldag-bench-load-pg-"))
        pg_root.chmod(0o755)  # under root the cluster runs as `postgres`, which must reach its folder
        extra = {"postgres": True, "postgres_port": pg_port, "postgres_dir": pg_root / "cluster"}
    os.environ["EVALDAG_HOME"] = str(home)
    from evaldag.runtime.deployments import eval_deployment
    from evaldag.runtime.stack import Stack, StackSettings

    stack = Stack(StackSettings(home=home, prefect_port=prefect_port, mlflow_port=mlflow_port, num_gpus=workers,
                                **extra))
    try:
        t_up = time.perf_counter()
        stack.up(deploy=True)
        up_s = time.perf_counter() - t_up
        os.environ["PREFECT_API_URL"] = stack.settings.prefect_api_url
        os.environ["MLFLOW_TRACKING_URI"] = stack.mlflow_url
        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: stack.settings.prefect_api_url}):
            probe = Probe(stack.settings.prefect_api_url)
            probe.start()
            t0 = time.perf_counter()
            fr = run_deployment(eval_deployment("gsm8k"), timeout=0, parameters={
                "limit": shards, "num_shards": shards, "step": 1, "train_run": f"load-{database}",
                "sampling": {"max_new_tokens": max_new_tokens}})
            probe.flow_run_id = str(fr.id)
            with get_client(sync_client=True) as client:
                while not (state := client.read_flow_run(fr.id).state) or not state.is_final():
                    time.sleep(1)
                wall = time.perf_counter() - t0
                from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

                runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[fr.id])))
            probe.stop()
        completed = sum(1 for r in runs if r.state and r.state.is_completed())
        return {"database": database, "stack_up_s": round(up_s, 1), "wall_s": round(wall, 1),
                "parent": state.type.value, "shard_runs": len(runs), "shard_runs_completed": completed,
                "failed_runs": (len(runs) - completed) + (0 if state.is_completed() else 1),
                "requests": len(probe.latencies), "failed_requests": len(probe.errors),
                "errors": sorted(set(probe.errors))[:5],
                "api_p50_ms": round(1000 * statistics.median(probe.latencies), 1),
                "api_p95_ms": round(1000 * _percentile(probe.latencies, 0.95), 1),
                "api_max_ms": round(1000 * max(probe.latencies), 1)}
    finally:
        stack.down()
        shutil.rmtree(home, ignore_errors=True)
        if pg_root:
            shutil.rmtree(pg_root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--only", choices=["sqlite", "postgres"])
    args = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    results = {}
    for database in [args.only] if args.only else ["sqlite", "postgres"]:
        results[database] = r = measure(database, args.shards, args.workers, args.max_new_tokens)
        print(f"{database:9s} wall {r['wall_s']:6.1f} s  runs completed {r['shard_runs_completed']}/{r['shard_runs']} "
              f"(parent {r['parent']})  failures: {r['failed_runs']} runs, {r['failed_requests']} of "
              f"{r['requests']} requests  API p50 {r['api_p50_ms']} ms  p95 {r['api_p95_ms']} ms  "
              f"max {r['api_max_ms']} ms", flush=True)
    if len(results) == 2:
        s, p = results["sqlite"], results["postgres"]
        print(f"postgres/sqlite: wall {p['wall_s'] / s['wall_s']:.2f}x  "
              f"API p95 {p['api_p95_ms'] / s['api_p95_ms']:.2f}x")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

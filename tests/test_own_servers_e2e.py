"""A team's own servers (issue 53, docs/own-servers.md): a plain `prefect server start` and an `mlflow server` with
basic auth, both with passwords, stand for the team's; `evaldag deploy` registers evaldag there, one
`evaldag worker --foreground` per pool serves it, `evaldag run` evaluates 4 problems through it, and the run is in
that MLflow while the embedded stack's state folder holds nothing of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from conftest import free_ports
from evaldag.runtime.stack.components import Components
from evaldag.tracking.names import experiment_name

pytestmark = [pytest.mark.stack, pytest.mark.model]

BIN = Path(sys.executable).parent
PREFECT_AUTH = "team:prefect-password-123"
MLFLOW_USER, MLFLOW_PASSWORD = "admin", "mlflow-password-456"


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process in its own group with SIGINT at its default (a worker stops on SIGTERM only then: the notes, 1.5)."""
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=open(log, "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, process_group=0,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"{url} exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not healthy after {timeout} s: {log.read_text()[-3000:]}")


@pytest.fixture
def team_servers(tmp_path):
    """The team's Prefect and MLflow servers, each with its own password, on ports of their own; yields the client
    environment a team member would have (no local stack: EVALDAG_HOME is an empty folder)."""
    prefect_port, mlflow_port = free_ports(2)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false")
    server_env = {**base, "PREFECT_HOME": str(tmp_path / "team-prefect"),
                  "PREFECT_SERVER_API_AUTH_STRING": PREFECT_AUTH}
    mlflow_dir = tmp_path / "team-mlflow"
    mlflow_env = {**base, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                  **Components._mlflow_auth_env(mlflow_dir, f"{MLFLOW_USER}:{MLFLOW_PASSWORD}")}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [_start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                    server_env, logs / "prefect.log"),
             _start([str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{mlflow_dir / 'mlflow.db'}",
                     "--artifacts-destination", str(mlflow_dir / "artifacts"), "--host", "127.0.0.1", "--port",
                     str(mlflow_port), "--workers", "1", "--app-name", "basic-auth"], mlflow_env, logs / "mlflow.log")]
    try:
        _wait_healthy(f"http://127.0.0.1:{prefect_port}/api/health", procs[0], logs / "prefect.log")
        _wait_healthy(f"http://127.0.0.1:{mlflow_port}/health", procs[1], logs / "mlflow.log")
        client_env = {**base, "PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}",
                      "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
                      "PREFECT_API_AUTH_STRING": PREFECT_AUTH,
                      "PREFECT_HOME": str(tmp_path / "client-prefect"),
                      "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
                      "MLFLOW_TRACKING_USERNAME": MLFLOW_USER, "MLFLOW_TRACKING_PASSWORD": MLFLOW_PASSWORD,
                      "EVALDAG_HOME": str(tmp_path / "evaldag-home"),
                      # workers on several hosts share one result store; here, a folder
                      "EVALDAG_RESULTS_URL": str(tmp_path / "results"),
                      "EVALDAG_WORKER_QUERY_SECONDS": "1"}
        yield client_env, logs
    finally:
        _stop(procs)


def _evaldag(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "evaldag"), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_deploy_workers_and_run_on_a_teams_own_servers(team_servers):
    env, logs = team_servers
    done = _evaldag(env, "deploy", "--gpus", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    workers = [_start([str(BIN / "evaldag"), "worker", "--foreground", "--pool", pool], env, logs / f"{pool}.log")
               for pool in ("cpu", "gpu")]
    try:
        run = _evaldag(env, "run", "math500", "--limit", "4", "--num-shards", "1", "--max-new-tokens", "16")
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""   # bytes, even with text=True
        run = subprocess.CompletedProcess(e.cmd, -9, out, f"timed out after {e.timeout} s")
    finally:
        _stop(workers)
    worker_logs = "".join(f"\n--- {p}:\n" + (logs / f"{p}.log").read_text()[-3000:] for p in ("cpu", "gpu"))
    assert run.returncode == 0, f"{run.stdout}{run.stderr}{worker_logs}"
    prefect_ui = env["PREFECT_API_URL"].removesuffix("/api")
    assert f"Prefect UI: {prefect_ui}/runs/flow-run/" in run.stdout, run.stdout
    assert f"MLflow UI:  {env['MLFLOW_TRACKING_URI']}/#/experiments/" in run.stdout, run.stdout

    # the run is in the team's MLflow, which lets nobody in without the password
    assert httpx.get(f"{env['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search",
                     params={"max_results": 10}, timeout=10).status_code == 401
    os.environ.update(MLFLOW_TRACKING_USERNAME=MLFLOW_USER, MLFLOW_TRACKING_PASSWORD=MLFLOW_PASSWORD)
    try:
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        exp = client.get_experiment_by_name(experiment_name("math500"))
        [evaluation] = client.search_runs([exp.experiment_id], filter_string="tags.benchmark = 'math500'")
    finally:
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(k, None)
    assert evaluation.data.metrics["n_samples"] == 4

    # nothing of an embedded stack: no state, no servers' databases, no MLflow store
    home = Path(env["EVALDAG_HOME"])
    assert not (home / "stack").exists() and not (home / "mlflow").exists()
    assert not [p for p in home.rglob("*.db")], sorted(home.rglob("*.db"))

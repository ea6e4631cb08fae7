"""The local stack against real processes: Prefect server, workers, MLflow server (started once for the module).

Everything runs under a temporary EVALDAG_HOME on free ports, so a stack a developer runs on this machine (other
home, other ports) is never touched. The fixture always stops what it started, and the last test checks with psutil
that no process of this stack is left. Tests that start nothing (settings, a port refused before start-up) carry no
`stack` mark, so `pytest -m "not stack"` runs them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from cluster_helpers import alive
from conftest import TEST_WORKER_QUERY_S, free_ports
from evaldag.cli import app
from evaldag.errors import ConfigError, StackError
from evaldag.request.gpus import GPU_LIMIT
from evaldag.runtime import cluster
from evaldag.runtime.stack import (CPU_WORKER, MLFLOW_SERVER, PREFECT_SERVER, STACK_ID_ENV, Stack, StackSettings)

GPU_WORKER = "gpu-worker-0"
ALL = [PREFECT_SERVER, MLFLOW_SERVER, CPU_WORKER, GPU_WORKER]


def _ours(home: Path, ports: list[int] = ()) -> list[psutil.Process]:
    """Processes whose command line names this test's home (or one of its ports), or whose EVALDAG_HOME is it."""
    needles = [str(home), *(f"--port {p}" for p in ports), *(f":{p}" for p in ports)]
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.info["cmdline"] or [])
            if any(n in cmd for n in needles) or p.environ().get("EVALDAG_HOME") == str(home):
                found.append(p)
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("evaldag-home").resolve()
    prefect_port, mlflow_port = free_ports(2)
    settings = StackSettings(home=home, prefect_port=prefect_port, mlflow_port=mlflow_port, num_gpus=1,
                             worker_query_seconds=TEST_WORKER_QUERY_S)
    saved = os.environ.get("EVALDAG_DATA_DIR")
    os.environ["EVALDAG_DATA_DIR"] = str(home / "data")  # must reach the workers
    st = Stack(settings)
    # Start it the way a non-interactive shell would: SIGINT ignored, which children inherit unless the stack resets
    # it (a worker that ignores SIGINT never stops on SIGTERM; docs/notes/prefect-mlflow.md 1.5).
    old_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        try:
            st.first_report = st.up(deploy=False)
        finally:
            signal.signal(signal.SIGINT, old_sigint)
        yield st
    finally:
        with contextlib.suppress(Exception):
            st.down()
        for p in _ours(home):  # safety net (by home path only): test_down_leaves_nothing is the real check
            with contextlib.suppress(psutil.Error):
                p.kill()
        if saved is None:
            os.environ.pop("EVALDAG_DATA_DIR", None)
        else:
            os.environ["EVALDAG_DATA_DIR"] = saved


def test_settings_from_env_and_gpu_pinning(monkeypatch, tmp_path):
    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path))
    monkeypatch.setenv("EVALDAG_PREFECT_PORT", "4999")
    monkeypatch.setenv("EVALDAG_MLFLOW_PORT", "5999")
    monkeypatch.setenv("EVALDAG_GPUS", "0,1")
    s = StackSettings.from_env()
    assert (s.home, s.prefect_port, s.mlflow_port, s.num_gpu_workers, s.gpus) == (tmp_path, 4999, 5999, 2, ("0", "1"))
    assert StackSettings.from_env(gpus=["3"]).num_gpu_workers == 1
    specs = Stack(s)._desired_specs("x")
    assert [specs[f"gpu-worker-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["0", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in specs[CPU_WORKER].env
    monkeypatch.delenv("EVALDAG_GPUS")
    monkeypatch.setenv("EVALDAG_MLFLOW_PORT", "4999")
    with pytest.raises(StackError, match="both 4999"):
        StackSettings.from_env()


def test_production_keeps_the_real_waits(monkeypatch, tmp_path):
    """The tests' stack shortens some waits (conftest); production's values are these, and reach the workers."""
    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path))
    for var in ("EVALDAG_MLFLOW_TIMEOUT_S", "EVALDAG_HEARTBEAT_S", "EVALDAG_WORKER_QUERY_SECONDS",
                "EVALDAG_MISSED_HEARTBEATS"):
        monkeypatch.delenv(var, raising=False)
    s = StackSettings.from_env()
    assert (s.mlflow_timeout_s, s.heartbeat_s, s.stop_timeout_s, s.start_timeout_s) == (30, 30, 10, 180)
    assert s.worker_query_seconds == 10
    assert s.missed_heartbeats == 3 and cluster.crash_automation(s.heartbeat_s).trigger.within.total_seconds() == 90
    env = Stack(s)._desired_specs("x")[GPU_WORKER].env
    assert env["PREFECT_WORKER_QUERY_SECONDS"] == "10"
    assert (env["MLFLOW_HTTP_REQUEST_TIMEOUT"], env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) == ("30", "2")
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    monkeypatch.setenv("EVALDAG_MLFLOW_TIMEOUT_S", "12")
    assert Stack(StackSettings.from_env())._desired_specs("x")[GPU_WORKER].env["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "12"


def test_the_lost_run_window_is_a_setting_of_at_least_two_periods(monkeypatch, tmp_path):
    """EVALDAG_MISSED_HEARTBEATS sets the automation's window (the tests use 2); one period is refused by name."""
    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path))
    monkeypatch.setenv("EVALDAG_MISSED_HEARTBEATS", "2")
    s = StackSettings.from_env(heartbeat_s=45)
    assert cluster.crash_automation(s.heartbeat_s, s.missed_heartbeats).trigger.within.total_seconds() == 90
    monkeypatch.setenv("EVALDAG_MISSED_HEARTBEATS", "1")
    with pytest.raises(StackError, match="missed_heartbeats"):
        StackSettings.from_env()


def test_busy_server_answers_are_retried():
    """503 is Prefect's "SQLite busy, retry" (e.g. just after a restart): the stack's own API calls re-send."""
    from evaldag.runtime.stack import _RetryBusy

    answers = [503, 503, 200]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return httpx.Response(answers.pop(0))

    with httpx.Client(base_url="http://x", transport=_RetryBusy(httpx.MockTransport(handler), delays=(0, 0, 0))) as c:
        assert c.post("/v2/concurrency_limits/", json={"limit": 2}).status_code == 200
    assert seen == [b'{"limit":2}'] * 3                       # the same body each time
    answers[:] = [503] * 4
    with httpx.Client(base_url="http://x", transport=_RetryBusy(httpx.MockTransport(handler), delays=(0, 0, 0))) as c:
        assert c.get("/health").status_code == 503            # gives up after its delays, with the last answer
    assert answers == []


def _pids(st: Stack) -> dict[str, int]:
    return {row.component: row.pid for row in st.status()}


def _cli_env(st: Stack) -> dict[str, str]:
    s = st.settings
    return {"EVALDAG_HOME": str(st.home), "EVALDAG_PREFECT_PORT": str(s.prefect_port),
            "EVALDAG_MLFLOW_PORT": str(s.mlflow_port)}


@pytest.mark.stack
def test_up_starts_servers_pools_and_workers(stack):
    assert sorted(stack.first_report.started) == sorted(ALL)
    s = stack.settings
    assert httpx.get(f"{s.prefect_api_url}/health", timeout=5).json() is True
    assert httpx.get(f"{s.mlflow_url}/health", timeout=5).status_code == 200
    for pool in ("cpu", "gpu"):
        r = httpx.get(f"{s.prefect_api_url}/work_pools/{pool}", timeout=5)
        assert r.status_code == 200 and r.json()["type"] == "process", r.text
    workers = httpx.post(f"{s.prefect_api_url}/work_pools/gpu/workers/filter", json={}, timeout=5).json()
    assert [w["name"] for w in workers if w["status"] == "ONLINE"] == [GPU_WORKER]
    assert (stack.home / "prefect" / "prefect.db").exists()
    assert (stack.home / "mlflow" / "mlflow.db").exists()
    assert (stack.home / "stack" / "state.json").exists()
    # Prefect's database (flow runs' parameters and logs, the key of the cluster's encrypted credentials), MLflow's
    # stores, the logs and the state: this user's alone
    for folder in ("prefect", "mlflow", "logs", "stack"):
        assert (stack.home / folder).stat().st_mode & 0o077 == 0, folder
    assert (stack.home / "stack" / "state.json").stat().st_mode & 0o077 == 0


def test_the_stacks_folders_and_state_are_made_private(tmp_path):
    """Folders an older version left world-readable are made this user's alone, and the state file is written
    0600 from its first byte, whatever the umask and a leftover temporary file's mode."""
    home = tmp_path / "home"
    for folder in ("prefect", "logs"):
        (home / folder).mkdir(parents=True, mode=0o755)
        (home / folder).chmod(0o755)
    st = Stack(StackSettings(home=home))
    st._make_private()
    for folder in ("prefect", "mlflow", "logs", "stack"):
        assert (home / folder).stat().st_mode & 0o777 == 0o700, folder
    st.state_path.with_suffix(".tmp").write_text("{}")
    st.state_path.with_suffix(".tmp").chmod(0o644)
    old = os.umask(0o022)
    try:
        st._save_state(st._new_state())
    finally:
        os.umask(old)
    assert st.state_path.stat().st_mode & 0o777 == 0o600


@pytest.mark.stack
def test_workers_get_env_and_default_sigint(stack):
    procs = {row.component: psutil.Process(row.pid) for row in stack.status()}
    for name in (CPU_WORKER, GPU_WORKER):
        env = procs[name].environ()
        assert env["PREFECT_API_URL"] == stack.settings.prefect_api_url
        assert env["MLFLOW_TRACKING_URI"] == stack.settings.mlflow_url
        assert env["EVALDAG_HOME"] == str(stack.home)
        assert env["EVALDAG_DATA_DIR"] == str(stack.home / "data")
        assert env["PREFECT_WORKER_QUERY_SECONDS"] == f"{stack.settings.worker_query_seconds:g}"
        assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] == os.environ.get(
            "CUDA_VISIBLE_DEVICES")
    for name, p in procs.items():
        assert os.getpgid(p.pid) == p.pid, f"{name} must lead its own process group"
        # in the caller's session, not one of its own: autogroup scheduling shares CPU between sessions first, so a
        # session of its own would make a user's nice 19 job an equal of the flow runs (docs/performance.md)
        assert os.getsid(p.pid) == os.getsid(0), f"{name} must stay in the session that started the stack"
        # SIGINT is not ignored (the test session starts the stack with SIGINT ignored in the parent, which a
        # child would inherit): `down`'s first SIGINT must reach every component
        ignored = int(next(line for line in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                           if line.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGINT - 1)), f"{name} ignores SIGINT"
    assert procs[MLFLOW_SERVER].environ()["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"


WAKE_PROBE = """
import asyncio, sys, time
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate

async def main():
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name="wake-probe", type="process"))
        flow_id = await client.create_flow_from_name("wake-probe")
        deployment = await client.create_deployment(flow_id=flow_id, name="probe", work_pool_name="wake-probe",
                                                    entrypoint="nowhere.py:f")
        print("ready", flush=True)
        sys.stdin.readline()                      # the worker is up
        t0 = time.monotonic()
        run = await client.create_flow_run_from_deployment(deployment)
        while time.monotonic() - t0 < 20:
            state = (await client.read_flow_run(run.id)).state.type.value
            if state != "SCHEDULED":
                break
            await asyncio.sleep(0.05)
        print(state, round(time.monotonic() - t0, 2), flush=True)

asyncio.run(main())
"""


@pytest.mark.stack
def test_a_worker_starts_a_run_when_it_is_scheduled_not_at_its_next_poll(stack, tmp_path):
    """The stack's worker (evaldag.runtime.wake_worker) on a pool of its own, polling every 300 s: a run of that
    pool leaves Scheduled within seconds, woken by the server's event (Prefect's own worker leaves it there until
    its next poll); and it stops on the first SIGINT."""
    env = {**os.environ, "PREFECT_API_URL": stack.settings.prefect_api_url, "PREFECT_HOME": str(tmp_path),
           "PREFECT_WORKER_QUERY_SECONDS": "300"}
    probe = subprocess.Popen([sys.executable, "-c", WAKE_PROBE], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        assert probe.stdout.readline().strip() == "ready"
        worker = subprocess.Popen([sys.executable, "-m", "evaldag.runtime.wake_worker", "--pool", "wake-probe",
                                   "--name", "wake-probe-0"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        time.sleep(6)                               # its first poll and sync are behind it
        probe.stdin.write("go\n")
        probe.stdin.flush()
        state, took = probe.stdout.readline().split()
        assert state != "SCHEDULED" and float(took) < 5, (state, took)
        worker.send_signal(signal.SIGINT)
        out, _ = worker.communicate(timeout=20)
        assert "Worker 'wake-probe-0' stopped!" in out and worker.returncode == 0
    finally:
        for p in (probe, worker):
            if p is not None and p.poll() is None:
                p.kill()


@pytest.mark.stack
def test_second_up_starts_nothing(stack, monkeypatch):
    before = _pids(stack)
    report = stack.up(deploy=False)
    assert report.started == []
    assert sorted(report.kept) == sorted(ALL)
    assert _pids(stack) == before
    # from another shell without the EVALDAG_* exports: the remembered settings keep the workers as they are
    monkeypatch.delenv("EVALDAG_DATA_DIR")
    report = stack.up(deploy=False)
    assert report.started == [] and _pids(stack) == before


@pytest.mark.stack
def test_a_wall_clock_step_does_not_disown_the_running_stack(stack, monkeypatch):
    """The wall clock jumps (NTP, a VM resumed after a pause): psutil's create times move with the boot time the
    kernel derives from it. The stack must still recognise its own processes: all alive and healthy, nothing
    restarted (before, `up` took the servers for dead and tried to start them again on their own busy ports)."""
    import psutil._pslinux as pslinux
    before = _pids(stack)
    real_boot_time = pslinux.boot_time
    monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot_time() + 3600.0)
    assert psutil.Process(before[PREFECT_SERVER]).create_time() > time.time()   # the step is visible to psutil
    rows = stack.status()
    assert all(r.alive and r.healthy for r in rows), rows
    report = stack.up(deploy=False)
    assert report.started == [] and sorted(report.kept) == sorted(ALL)
    assert _pids(stack) == before


@pytest.mark.stack
def test_status_and_cli_status(stack):
    rows = stack.status()
    assert [r.component for r in rows] == ALL
    assert all(r.alive and r.healthy for r in rows), rows
    urls = {r.component: r.url for r in rows}
    assert urls[PREFECT_SERVER] == stack.settings.prefect_url
    assert urls[MLFLOW_SERVER] == stack.settings.mlflow_url
    result = CliRunner().invoke(app, ["status"], env=_cli_env(stack))
    assert result.exit_code == 0, result.output
    assert GPU_WORKER in result.output and stack.settings.prefect_url in result.output


@pytest.mark.stack
def test_env_lines(stack):
    s = stack.settings
    expected = [f"export PREFECT_API_URL=http://127.0.0.1:{s.prefect_port}/api",
                f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{s.mlflow_port}",
                f"export EVALDAG_HOME={stack.home}"]
    assert stack.env_lines() == expected
    result = CliRunner().invoke(app, ["env"], env=_cli_env(stack))
    assert result.exit_code == 0 and result.output.splitlines() == expected


@pytest.mark.stack
def test_dead_worker_is_restarted(stack):
    before = _pids(stack)
    os.killpg(before[GPU_WORKER], signal.SIGKILL)
    psutil.Process(before[GPU_WORKER]).wait(10)
    assert {r.component: r.alive for r in stack.status()}[GPU_WORKER] is False
    report = stack.up(deploy=False)
    assert report.started == [GPU_WORKER]
    after = _pids(stack)
    assert after[GPU_WORKER] != before[GPU_WORKER]
    assert {k: v for k, v in after.items() if k != GPU_WORKER} == {k: v for k, v in before.items() if k != GPU_WORKER}
    assert all(r.healthy for r in stack.status())


@pytest.mark.stack
def test_server_that_does_not_answer_is_replaced(stack):
    """A server process that is alive but does not answer (here hung: SIGSTOP; also one still shutting down after
    a restart began) is not "kept": `up` replaces it and waits until the new one is healthy."""
    before = _pids(stack)
    os.killpg(before[MLFLOW_SERVER], signal.SIGSTOP)
    try:
        report = stack.up(deploy=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(before[MLFLOW_SERVER], signal.SIGCONT)
    assert report.started == [MLFLOW_SERVER]
    after = _pids(stack)
    assert after[MLFLOW_SERVER] != before[MLFLOW_SERVER] and not psutil.pid_exists(before[MLFLOW_SERVER])
    assert {k: v for k, v in after.items() if k != MLFLOW_SERVER} == \
        {k: v for k, v in before.items() if k != MLFLOW_SERVER}
    assert all(r.healthy for r in stack.status())


def _gpu_limit(st: Stack) -> dict:
    r = httpx.get(f"{st.settings.prefect_api_url}/v2/concurrency_limits/{GPU_LIMIT}", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.stack
def test_gpu_concurrency_limit_blocks_a_second_occupant(stack):
    """`up` made the limit (one slot per GPU); a TP=2 shard on a 2-GPU pool holds both slots, so nothing else
    gets one until it is done, and a TP=3 shard fails at once instead of waiting forever."""
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.gpu_slots import hold_gpus

    s = stack.settings
    limit = _gpu_limit(stack)
    assert (limit["limit"], limit["active"], limit["active_slots"]) == (s.num_gpus, True, 0) == (1, True, 0)
    Stack(s.model_copy(update={"num_gpus": 2}))._ensure_gpu_limit()  # what `up --gpus 2` does to it
    try:
        assert _gpu_limit(stack)["limit"] == 2
        with temporary_settings(updates={PREFECT_API_URL: s.prefect_api_url}):
            with hold_gpus(2):
                assert _gpu_limit(stack)["active_slots"] == 2
                t0 = time.monotonic()
                with pytest.raises(TimeoutError), concurrency(GPU_LIMIT, occupy=1, timeout_seconds=2):
                    pytest.fail("a second shard got a GPU slot while a TP=2 shard held both GPUs")
                assert time.monotonic() - t0 < 10
            assert _gpu_limit(stack)["active_slots"] == 0
            with pytest.raises(ConfigError, match="needs 3 GPUs"), hold_gpus(3):
                pytest.fail("a TP=3 shard must not run on a 2-GPU pool")
            with concurrency(GPU_LIMIT, occupy=2, timeout_seconds=10):  # free again
                pass
    finally:
        stack._ensure_gpu_limit(reset_slots=True)
    assert (_gpu_limit(stack)["limit"], _gpu_limit(stack)["active_slots"]) == (1, 0)


@pytest.mark.stack
def test_deploy_failure_shows_log_tail(stack, tmp_path, monkeypatch):
    bad = tmp_path / "prefect.yaml"
    bad.write_text("deployments:\n  - name: broken\n    entrypoint: no_such_file.py:nothing\n"
                   "    work_pool: {name: cpu}\n")
    monkeypatch.setattr(Stack, "deployments_file", property(lambda self: bad))
    with pytest.raises(StackError, match="prefect deploy` failed") as exc:
        stack.deploy()
    assert str(stack.logs_dir / "deploy.log") in str(exc.value)
    assert "no_such_file" in str(exc.value)


_EXITING_SERVER = """
import ctypes, socket, sys, threading, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
threading.Thread(target=time.sleep, args=(2.0,)).start()   # outlives the main thread, and holds the socket
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_whose_threads_are_still_exiting_is_waited_for(tmp_path):
    """A server whose main thread has exited shows as a zombie while its other threads wind down, and still holds
    its port: stopping it waits for them, so that its replacement can bind the port (CI saw `up` replace a hung
    MLflow server, then find the port busy, or the old process still there)."""
    from evaldag.runtime.stack.processes import _bind_error

    proc = subprocess.Popen([sys.executable, "-c", _EXITING_SERVER], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    p = psutil.Process(proc.pid)
    deadline = time.monotonic() + 5
    while p.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.status() == psutil.STATUS_ZOMBIE and proc.poll() is None  # the state the old check took for "gone"
    assert _bind_error("127.0.0.1", port) is not None
    st = Stack(StackSettings(home=tmp_path))
    assert st._wait_gone([p], 10) == []
    assert _bind_error("127.0.0.1", port) is None
    assert proc.wait(5) == 0


def test_a_port_still_being_released_is_waited_for_after_a_stop_only(tmp_path):
    """A port blocked by a socket no process listens on is waited for, briefly, after `up` stopped the
    component that used it; before starting, a blocked port fails at once, naming the port."""
    import threading

    from evaldag.runtime.stack.processes import _Spec

    blocker = socket.socket()          # bound, not listening, no SO_REUSEADDR: blocks the bind, holder unknown
    blocker.bind(("127.0.0.1", 0))
    port = blocker.getsockname()[1]
    st = Stack(StackSettings(home=tmp_path))
    spec = _Spec(name=MLFLOW_SERVER, kind="server", argv=[], env={}, cwd=tmp_path, port=port)
    t0 = time.monotonic()
    with pytest.raises(StackError, match=f"port {port} .* busy"):
        st._check_port_free(spec)
    assert time.monotonic() - t0 < 3
    timer = threading.Timer(1.0, blocker.close)
    timer.start()
    t0 = time.monotonic()
    st._wait_port_released(spec, timeout_s=10)
    assert 0.9 < time.monotonic() - t0 < 5
    st._check_port_free(spec)
    timer.join()


def test_busy_port_is_reported_before_anything_starts(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    (mlflow_port,) = free_ports(1)
    try:
        st = Stack(StackSettings(home=tmp_path, prefect_port=port, mlflow_port=mlflow_port))
        with pytest.raises(StackError) as exc:
            st.up(deploy=False)
        msg = str(exc.value)
        assert f"port {port}" in msg and "EVALDAG_PREFECT_PORT" in msg
        assert f"pid {os.getpid()}" in msg  # psutil names the holder: this test process
        assert st.status() == [] and not st.state_path.exists()
        assert _ours(tmp_path, [port, mlflow_port]) == []

        # The CLI prints the same error as one red line, no traceback, exit code 1.
        env = {"EVALDAG_HOME": str(tmp_path), "EVALDAG_PREFECT_PORT": str(port),
               "EVALDAG_MLFLOW_PORT": str(mlflow_port)}
        result = CliRunner().invoke(app, ["up", "--no-deploy"], env=env)
        assert result.exit_code == 1
        assert f"error: port {port}" in result.output and "Traceback" not in result.output
    finally:
        holder.close()


SLEEPY = """
import time
from prefect import flow

@flow(name="sleepy")
def sleepy(seconds: float = 600):
    time.sleep(seconds)
"""

START_RUN = """
import sys, time
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

src = sys.argv[1]
flow.from_source(source=src, entrypoint="sleepy.py:sleepy").deploy(
    name="sleepy", work_pool_name="gpu", build=False, push=False, print_next_steps=False, ignore_warnings=True)
run = run_deployment("sleepy/sleepy", timeout=0)
with get_client(sync_client=True) as client:
    deadline = time.monotonic() + 60
    while not client.read_flow_run(run.id).state.is_running():
        assert time.monotonic() < deadline, "flow run did not start"
        time.sleep(0.3)
"""


def _flow_run_processes(stack_id: str) -> list[psutil.Process]:
    """A flow run's engine is `python -c ...prefect.engine` (evaldag.runtime.flow_run_launcher.module_command)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.environ().get(STACK_ID_ENV) == stack_id and "prefect.engine" in " ".join(p.info["cmdline"] or []):
                found.append(p)
    return found


@pytest.mark.stack
def test_a_waiter_sees_a_run_end_when_it_ends_not_at_its_next_poll(stack):
    """evaldag.runtime.run_events.wait_until_final (how `evaldag run` and the parent's launch-shard wait): with a
    300 s poll, a run set Completed is seen within seconds, woken by the server's event; a run already final is
    returned at once."""
    import contextvars
    import threading

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Completed, Running

    from evaldag.runtime.run_events import wait_until_final

    @flow(name="wait-probe")
    def probe() -> None:
        pass

    with temporary_settings(updates={PREFECT_API_URL: stack.settings.prefect_api_url}), \
            get_client(sync_client=True) as client:
        run = client.create_flow_run(probe)
        client.set_flow_run_state(run.id, Running(), force=True)
        seen: dict = {}

        def wait() -> None:
            seen["run"] = wait_until_final(client, run.id, poll_s=300)
            seen["at"] = time.monotonic()

        # in this context: the stack's API URL is a context variable of temporary_settings
        waiter = threading.Thread(target=contextvars.copy_context().run, args=(wait,), daemon=True)
        waiter.start()
        time.sleep(3)                                 # the waiter has read the run and follows its events
        assert waiter.is_alive()
        ended = time.monotonic()
        client.set_flow_run_state(run.id, Completed(), force=True)
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "the waiter slept through the run's end"
        assert seen["run"].state.is_completed() and seen["at"] - ended < 5, seen["at"] - ended
        t0 = time.monotonic()
        assert wait_until_final(client, run.id, poll_s=300).state.is_completed()
        assert time.monotonic() - t0 < 5


@pytest.mark.stack
def test_down_leaves_nothing(stack, tmp_path):
    """A flow run in flight (its own process group, not the worker's) is stopped too."""
    s = stack.settings
    state = stack._load_state()
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    env = {**os.environ, "PREFECT_API_URL": s.prefect_api_url, "PREFECT_HOME": str(tmp_path / "prefect")}
    subprocess.run([sys.executable, "-c", START_RUN, str(tmp_path)], env=env, check=True, timeout=120,
                   capture_output=True)
    runs = _flow_run_processes(state["stack_id"])
    # the gpu worker (sleepy's pool) started the run, in a process group of the run's own but the worker's session
    gpu_worker = psutil.Process(_pids(stack)[GPU_WORKER])
    assert runs and {p.pid for p in runs} <= {c.pid for c in gpu_worker.children(recursive=True)}
    for p in runs:
        assert os.getpgid(p.pid) != os.getpgid(gpu_worker.pid) and os.getsid(p.pid) == os.getsid(gpu_worker.pid)

    t0 = time.monotonic()
    stopped = stack.down()
    took = time.monotonic() - t0
    assert stopped == [CPU_WORKER, GPU_WORKER, PREFECT_SERVER, MLFLOW_SERVER]
    assert not stack.state_path.exists()
    # Graceful: each worker obeyed the first SIGINT (the fixture started them with SIGINT ignored in the parent,
    # which they would inherit and then ignore) instead of being killed after the grace period.
    for name in (CPU_WORKER, GPU_WORKER):
        assert f"Worker '{name}' stopped!" in (stack.logs_dir / f"{name}.log").read_text()
    assert took < s.stop_timeout_s, f"down took {took:.1f} s"
    assert _ours(stack.home, [s.prefect_port, s.mlflow_port]) == []
    leftovers = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(STACK_ID_ENV) == state["stack_id"]:
                leftovers.append(p)
    # alive(), not is_running(): a run adopted by a PID 1 that never reaps (some CI containers) stays a zombie
    assert leftovers == [] and not any(alive(p) for p in runs)
    assert stack.down() == []
    assert stack.status() == []
    result = CliRunner().invoke(app, ["down"], env=_cli_env(stack))
    assert result.exit_code == 0 and "nothing running" in result.output


"""Helpers of the fault tests that kill whole nodes: Prefect reads, waiting, finding and killing processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import psutil


def wait(predicate: Callable[[], Any], timeout: float = 600.0, every: float = 1.0) -> Any:
    """The first truthy value of `predicate()`, polled every `every` s; AssertionError after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def _run(coro_fn):
    from prefect.client.orchestration import get_client

    async def go():
        async with get_client() as client:
            return await coro_fn(client)
    return asyncio.run(go())


def flow_run(flow_run_id):
    """The flow run as the server has it now."""
    return _run(lambda c: c.read_flow_run(flow_run_id))


def state_history(flow_run_id) -> list:
    """Every state the flow run went through, oldest first."""
    return sorted(_run(lambda c: c.read_flow_run_states(flow_run_id)), key=lambda s: s.timestamp)


def wait_final(flow_run_id, timeout: float = 900.0):
    """The flow run's final state, once it has one (a lost-run crash that the run undoes is not final)."""
    from evaldag.runtime.liveness import settled

    return wait(lambda: (s := settled(lambda: flow_run(flow_run_id)).state) and s.is_final() and s,
                timeout=timeout, every=2)


def children(parent_id) -> list:
    """The flow runs started by the parent flow run `parent_id` (its shard runs)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return _run(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]))))


class NewGenerations:
    """The generation chunks that evaluations started after this object was made write (one parquet file per batch,
    in the stack's local result store for `benchmark`): how a test knows that a shard is mid-generation."""

    def __init__(self, stack, benchmark: str = "math500") -> None:
        self.results = Path(stack.home) / "results" / benchmark
        self.before = set(self.results.glob("gen-*"))

    def chunk(self, batch: int) -> Path | None:
        """Batch `batch`'s chunk, once written."""
        return next((c for g in set(self.results.glob("gen-*")) - self.before
                     for c in g.glob(f"*.chunks/batch-{batch:05d}-*.parquet")), None)

    def wait(self, batch: int, timeout: float = 600.0) -> Path:
        """Batch `batch`'s chunk, waiting for it."""
        return wait(lambda: self.chunk(batch), timeout=timeout, every=0.2)


def progress_artifacts(flow_run_ids: list) -> list:
    """The progress artifacts the flow runs `flow_run_ids` published (a shard's, or a parent's whole-evaluation)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    return _run(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=list(flow_run_ids)), type=ArtifactFilterType(any_=["progress"]))))


def flow_run_processes(flow_run_id) -> list[psutil.Process]:
    """This machine's processes of one flow run (the worker hands PREFECT__FLOW_RUN_ID to it and its children)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id):
                found.append(p)
    return found


def engine_processes(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Of a flow run's processes, those running Prefect's engine, i.e. the flow itself: a shard generates there
    (both engines run in that process on a CPU host), the launcher above it only waits."""
    found = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if "prefect.engine" in " ".join(p.cmdline()):
                found.append(p)
    return found


def alive(p: psutil.Process) -> bool:
    """Whether `p` still runs: a zombie (dead, not yet reaped by whoever adopted it) does not."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL every process at once (a lost node says nothing), then wait until they are gone."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


# ---------------------------------------------------------------------------------------------- network namespaces

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Hosts:
    """Separate network hosts on this machine: one network namespace each, joined by a bridge in the root
    namespace (which gets `gateway`, so this test process reaches every host)."""

    def __init__(self, names: list[str]) -> None:
        tag = f"{os.getpid() % 100000}"
        self.subnet = f"10.231.{os.getpid() % 250}"
        self.bridge = f"edbr{tag}"[:15]
        self.gateway = f"{self.subnet}.254"
        self.ns = {name: f"evaldag-{tag}-{name}" for name in names}
        self.ip = {name: f"{self.subnet}.{i + 1}" for i, name in enumerate(names)}
        self._veths = {name: (f"ev{tag}{i}r"[:15], f"ev{tag}{i}p"[:15]) for i, name in enumerate(names)}

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, ns in self.ns.items():
            outer, inner = self._veths[name]
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.ip[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def pids(self, name: str) -> list[int]:
        """Every process living in host `name` (what a lost host takes with it)."""
        out = _ip("netns", "pids", self.ns[name], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process of host `name` at once; returns their pids."""
        pids = self.pids(name)
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        kill_all(procs)
        return pids

    def run(self, name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside host `name` and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.ns[name], *argv], **kwargs)

    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside host `name`."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[name], *argv], **kwargs)

    def destroy(self) -> None:
        """Kill what still runs in the hosts, delete the namespaces (their veth pairs go with them), the bridge."""
        for name, ns in self.ns.items():
            with contextlib.suppress(Exception):
                self.kill(name)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)


def can_make_namespaces() -> str | None:
    """None when this process can create network namespaces, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    probe = f"evaldag-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None

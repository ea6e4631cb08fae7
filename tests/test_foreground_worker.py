"""`evaldag worker --foreground` as a cluster job runs it (an sbatch job's srun, a Kubernetes pod, a systemd unit):
attached, against the session stack's servers, stopped by SIGTERM while its shard runs (docs/slurm.md, "At the time
limit").

What Prefect's process worker does on SIGTERM (`prefect worker start` the same): it cancels its loops and its runs'
tasks, and anyio's process wrapper kills each run's process on that cancellation (SIGKILL; the engine below the
launcher dies with it, PR_SET_PDEATHSIG), then the worker exits 0. Nobody is left to report the run: it stays
Running until its heartbeats are missed, and the lost-run automation (Prefect's documented answer to such runs) sets
it Crashed. Then evaldag's launch-shard task starts the shard again, and once a gpu worker is back the evaluation
completes with every sample exactly once. Asserted: exit 0, nothing of the shard left running, the run Crashed, the
evaluation recovered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from prefect.deployments import run_deployment

from cluster_helpers import (children, engine_processes, flow_run, flow_run_processes, kill_all, wait,
                             wait_final)
from evaldag.tracking.names import experiment_name

pytestmark = [pytest.mark.stack, pytest.mark.model]
EVALDAG = str(Path(sys.executable).parent / "evaldag")


def test_foreground_worker_stops_on_sigterm_and_its_shard_runs_again(live_stack, tmp_path):
    from evaldag.request.checkpoint import resolve_model
    from evaldag.runtime.stack import Stack
    from evaldag.tracking.samples import load_samples

    folder = resolve_model("smollm2-135m-instruct").path
    # the stack's own gpu worker goes: the shard can only start on the foreground worker
    Stack(live_stack.settings.model_copy(update={"num_gpus": 0})).up(deploy=False)
    log = tmp_path / "job.out"
    job, procs = None, []
    try:
        with open(log, "wb") as out:
            # a job's own EVALDAG_HOME, the head's servers and result store named on the command line
            job = subprocess.Popen(
                [EVALDAG, "worker", "--foreground", "--pool", "gpu", "--server", live_stack.settings.prefect_url,
                 "--mlflow-url", live_stack.mlflow_url, "--results-url", str(live_stack.home / "results"),
                 "--name", "slurm-job-1"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "EVALDAG_HOME": str(tmp_path / "job-home")})
        # one batch of 4 prompts x n=4, the least a relaunch must redo; SIGTERM lands while the shard runs
        fr = run_deployment("eval/gsm8k", timeout=0, parameters={
            "checkpoint": folder, "limit": 4, "num_shards": 1, "step": 91, "train_run": "foreground-sigterm",
            "sampling": {"n": 4, "temperature": 1.0, "max_new_tokens": 16, "seed": 5}})
        [shard] = wait(lambda: [r for r in children(fr.id) if r.state.is_running()], timeout=600)
        procs = wait(lambda: engine_processes(flow_run_processes(shard.id)) and flow_run_processes(shard.id),
                     timeout=120)
        job_tree = {p.pid for p in psutil.Process(job.pid).children(recursive=True)}
        assert procs and {p.pid for p in procs} <= job_tree, "the shard does not run under the foreground worker"
        assert not flow_run(shard.id).state.is_final()                     # stopped mid-generation, not after

        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
        gone, left = psutil.wait_procs(procs, timeout=120)
        assert not left, f"the shard's processes outlived their worker: {left}"
        stopped = wait_final(shard.id, timeout=300)       # the automation's window: 2 heartbeat periods here
        assert stopped.is_crashed(), stopped                    # not left Running
        text = log.read_text()
        assert "Worker 'slurm-job-1' started" in text and "stopped" in text, text[-3000:]
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        kill_all(procs)              # a failed run of this test leaves nothing running (no stack id to sweep)
        live_stack.up(deploy=False)                                     # its gpu worker back
    state = wait_final(fr.id)
    assert state.is_completed(), state.message
    shards = sorted(children(fr.id), key=lambda r: r.created)
    assert [r.state.type.value for r in shards] == ["CRASHED", "COMPLETED"], shards
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'foreground-sigterm'")
    samples = load_samples(run.info.run_id)
    assert samples.height == 16 and samples.select("sample_id", "sample_index").n_unique() == 16

"""`evaldag worker --foreground`: which worker it becomes and with what environment, and its refusals. The worker
itself, stopped by SIGTERM mid-shard, runs against the real stack in tests/test_foreground_worker.py."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from evaldag.cli import app
from evaldag.errors import StackError
from evaldag.runtime import cluster
from evaldag.runtime.stack import STACK_ID_ENV, Stack, StackSettings
from evaldag.runtime.stack.processes import _Spec

HEAD = cluster.ClusterInfo(prefect_url="http://10.0.0.1:4200", mlflow_url="http://0.0.0.0:5000",
                           results_url="s3://bucket/evals", heartbeat_s=45, env={"EVALDAG_DATA_DIR": "/data"})


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("EVALDAG_RESULTS_URL", "EVALDAG_RESULTS_DIR", "EVALDAG_GPUS", "EVALDAG_NUM_GPUS", "EVALDAG_DATA_DIR",
                "PREFECT_API_URL", "MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("evaldag.runtime.node_clock.check_clock", lambda *a, **kw: None)


@pytest.mark.parametrize("pool, limit", [("gpu", "1"), ("cpu", "4")])
def test_the_foreground_worker_is_a_nodes_worker_of_its_pool(tmp_path, monkeypatch, clean_env, pool, limit):
    monkeypatch.setattr(cluster, "fetch", lambda api, auth=None: HEAD)
    stack = Stack(StackSettings(home=tmp_path, server="http://10.0.0.1:4200", node_name="gpu7"))
    spec = stack.foreground_worker(pool, "gpu7-job-1")
    assert spec.argv[1:] == ["-m", "evaldag.runtime.wake_worker", "--pool", pool, "--name", "gpu7-job-1",
                             "--limit", limit]
    env = spec.env
    assert env["PREFECT_API_URL"] == "http://10.0.0.1:4200/api" and env["MLFLOW_TRACKING_URI"] == "http://10.0.0.1:5000"
    assert env["EVALDAG_RESULTS_URL"] == "s3://bucket/evals" and env["EVALDAG_DATA_DIR"] == "/data"
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "45"            # the period the head's automation expects
    assert env["EVALDAG_HOME"] == str(tmp_path) and env["PREFECT_HOME"] == str(tmp_path / "prefect")
    # the scheduler's GPUs (Slurm's --gres, the device plugin's) are left as they are; nothing for a sweep to find
    assert "CUDA_VISIBLE_DEVICES" not in env and STACK_ID_ENV not in env


def test_foreground_on_a_teams_servers_takes_them_from_the_environment(tmp_path, monkeypatch, clean_env):
    """No --server: PREFECT_API_URL, MLFLOW_TRACKING_URI and EVALDAG_RESULTS_URL name the servers and the store
    (a server that evaldag's `up` did not start publishes none); the worker is named per process."""
    def no_block(api, auth=None):
        raise StackError("no block")

    monkeypatch.setattr(cluster, "fetch", no_block)
    became: list[_Spec] = []

    def exec_foreground(spec: _Spec):              # the real one replaces the process: nothing after it runs
        became.append(spec)
        raise SystemExit(0)

    monkeypatch.setattr("evaldag.runtime.stack.processes.exec_foreground", exec_foreground)
    env = {"EVALDAG_HOME": str(tmp_path / "job"), "PREFECT_API_URL": "http://prefect.team:4200/api",
           "MLFLOW_TRACKING_URI": "http://mlflow.team:5000", "EVALDAG_RESULTS_URL": "s3://team/evals",
           "EVALDAG_NODE_NAME": "node3"}
    result = CliRunner().invoke(app, ["worker", "--foreground", "--pool", "cpu"], env=env)
    assert result.exit_code == 0, result.output
    [spec] = became
    assert spec.name == f"node3-cpu-{os.getpid()}" and spec.argv[spec.argv.index("--pool") + 1] == "cpu"
    assert spec.env["PREFECT_API_URL"] == "http://prefect.team:4200/api"
    assert spec.env["MLFLOW_TRACKING_URI"] == "http://mlflow.team:5000"
    assert spec.env["EVALDAG_RESULTS_URL"] == "s3://team/evals"
    assert spec.env["EVALDAG_HOME"] == str(tmp_path / "job")


@pytest.mark.parametrize("args, env, says", [
    (["--foreground"], {}, "PREFECT_API_URL in the environment will do"),
    (["--foreground", "--server", "http://h:4200", "--gpus", "2"], {}, "one process per GPU slot"),
    (["--foreground", "--server", "http://h:4200", "--pool", "tpu"], {}, "'tpu' is not one of evaldag's pools"),
    (["--server", "http://h:4200", "--pool", "cpu"], {}, "a cpu worker runs with --foreground"),
])
def test_foreground_refusals(tmp_path, clean_env, args, env, says):
    result = CliRunner().invoke(app, ["worker", *args], env={"EVALDAG_HOME": str(tmp_path), "COLUMNS": "400", **env})
    assert result.exit_code == 2 and says in " ".join(result.output.replace("│", " ").split()), result.output

"""Three hosts on this machine (network namespaces): a head with the Prefect server, MLflow and an S3 store (moto's
server), and two GPU nodes that join it with `evaldag worker --server`, each with its own EVALDAG_HOME and no
result disk in common (the store is S3; checkpoints are read from one path, as from NFS). An evaluation fans out
over both nodes; every process of one node is killed mid-shard; the evaluation completes on the other node with
every sample exactly once and one MLflow run. The nodes get MLflow, the store and its credentials from the head:
their own environment has none of them."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest

from evaldag.runtime.cluster import CRASH_AUTOMATION
from cluster_helpers import Hosts, can_make_namespaces, children, flow_run, state_history, wait, wait_final
from conftest import free_ports

pytestmark = [pytest.mark.stack, pytest.mark.model]

BUCKET = "evaldag-cluster"
NODES = ("node-a", "node-b")
EVALDAG = [sys.executable, "-m", "evaldag.cli"]
_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# both servers of a head on a namespace address require it (evaldag up --auth); the nodes join with it
AUTH = "evaldag:netns-test-password"
_AUTH_ENV = {"PREFECT_API_AUTH_STRING": AUTH, "MLFLOW_TRACKING_USERNAME": "evaldag",
             "MLFLOW_TRACKING_PASSWORD": "netns-test-password"}
_BASIC = {"Authorization": "Basic " + base64.b64encode(AUTH.encode()).decode()}


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would point a node at the head by another way."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "PREFECT_API", "MLFLOW_", "EVALDAG_RESULTS", "EVALDAG_HOME"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                    os.environ.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _cli(hosts: Hosts, host: str, args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    proc = hosts.run(host, [*EVALDAG, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"evaldag {' '.join(args)} on {host}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if why := can_make_namespaces():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):   # CI runs as root with iproute2 (.ci/run)
            pytest.fail(f"CI must run the lost-node test, but cannot build hosts from network namespaces: {why}")
        pytest.skip(f"cannot build hosts from network namespaces: {why}")
    tmp = tmp_path_factory.mktemp("cluster")
    hosts = Hosts(["head", *NODES])
    prefect_port, mlflow_port, s3_port = free_ports(3)
    head_ip = hosts.ip["head"]
    s3_url = f"http://{head_ip}:{s3_port}"
    head_env = _env(EVALDAG_HOME=str(tmp / "head"), EVALDAG_PREFECT_PORT=str(prefect_port),
                    EVALDAG_MLFLOW_PORT=str(mlflow_port), EVALDAG_RESULTS_URL=f"s3://{BUCKET}/evals",
                    AWS_ENDPOINT_URL=s3_url, **_AWS)
    homes = {name: tmp / name for name in NODES}
    moto = None
    try:
        hosts.create()
        moto = hosts.popen("head", [str(Path(sys.executable).with_name("moto_server")), "-H", head_ip, "-p",
                                    str(s3_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        s3 = boto3.client("s3", endpoint_url=s3_url, **{k.lower(): v for k, v in _AWS.items()
                                                         if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
        wait(lambda: _try(lambda: s3.create_bucket(Bucket=BUCKET)), timeout=60, every=0.5)
        # a head other hosts reach refuses to start without auth, before starting anything
        refused = hosts.run("head", [*EVALDAG, "up", "--host", head_ip, "--gpus", "0"],
                            env={**head_env, "EVALDAG_API_AUTH": ""}, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "--auth USER:PASSWORD" in refused.stderr + refused.stdout, refused
        assert not (tmp / "head" / "stack" / "state.json").exists()
        _cli(hosts, "head", ["up", "--host", head_ip, "--gpus", "0", "--auth", AUTH], head_env, timeout=600)
        # with auth, a client without it gets 401 from both servers (this process reaches the head by the bridge)
        api, mlflow = f"http://{head_ip}:{prefect_port}/api", f"http://{head_ip}:{mlflow_port}"
        assert httpx.post(f"{api}/block_documents/filter", json={}, timeout=10).status_code == 401
        assert httpx.get(f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10).status_code == 401
        assert httpx.post(f"{api}/block_documents/filter", json={}, headers=_BASIC, timeout=10).status_code == 200

        # both nodes join at once, each with a home of its own and nothing but the head's address; the S3 endpoint
        # is the node's to give (a block naming an endpoint would send every node's requests where it says)
        joins = [hosts.popen(name, [*EVALDAG, "worker", "--server", f"http://{head_ip}:{prefect_port}", "--auth", AUTH,
                                    "--name", name, "--gpus", "1", "--env", "EVALDAG_TORCH_THREADS=1",
                                    "--env", f"AWS_ENDPOINT_URL={s3_url}"],
                             env=_env(EVALDAG_HOME=str(homes[name])), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
                 for name in NODES]
        for name, join in zip(NODES, joins):
            out, _ = join.communicate(timeout=300)
            assert join.returncode == 0, f"{name}: {out}"
        yield {"hosts": hosts, "api": f"http://{head_ip}:{prefect_port}/api", "mlflow": f"http://{head_ip}:"
               f"{mlflow_port}", "s3": s3, "homes": homes, "head_env": head_env}
    finally:
        for name, env in [*((n, _env(EVALDAG_HOME=str(homes[n]))) for n in NODES), ("head", head_env)]:
            with contextlib.suppress(Exception):
                hosts.run(name, [*EVALDAG, "down"], env=env, timeout=120, capture_output=True)
        if moto is not None:
            moto.kill()
            moto.wait(10)
        hosts.destroy()


def _try(fn):
    try:
        fn()
        return True
    except Exception:
        return False


def _keys(s3, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _generating_pid(hosts: Hosts, name: str, flow_run_id) -> int | None:
    """The pid of the process on host `name` that runs flow run `flow_run_id`'s engine (where its shard generates)."""
    import psutil

    for pid in hosts.pids(name):
        try:
            p = psutil.Process(pid)
            if (p.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id)
                    and "prefect.engine" in " ".join(p.cmdline())):
                return pid
        except psutil.Error:
            continue
    return None


def _node_of(hosts: Hosts, flow_run_id) -> str | None:
    """The node whose namespace runs flow run `flow_run_id` now."""
    import psutil

    for name in NODES:
        for pid in hosts.pids(name):
            try:
                if psutil.Process(pid).environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id):
                    return name
            except psutil.Error:
                continue
    return None


def test_evaluation_survives_the_loss_of_a_whole_node(cluster, monkeypatch):
    from mlflow import MlflowClient
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from evaldag.request.checkpoint import resolve_model
    from evaldag.tracking.names import experiment_name

    for key, value in _AUTH_ENV.items():   # this process's Prefect and MLflow clients get in with the auth
        monkeypatch.setenv(key, value)
    hosts, s3 = cluster["hosts"], cluster["s3"]
    for name in NODES:   # the nodes took MLflow, the store and its credentials from the head
        env = json.loads((cluster["homes"][name] / "stack" / "state.json").read_text())["components"][
            f"{name}-gpu-0"]["key"]["env"]
        assert env["EVALDAG_RESULTS_URL"] == f"s3://{BUCKET}/evals" and env["AWS_SECRET_ACCESS_KEY"] == "testing"
        assert env["MLFLOW_TRACKING_URI"] == cluster["mlflow"] and env["PREFECT_API_URL"] == cluster["api"]
    workers = httpx.post(f"{cluster['api']}/work_pools/gpu/workers/filter", json={}, headers=_BASIC,
                         timeout=10).json()
    assert sorted(w["name"] for w in workers if w["status"] == "ONLINE") == [f"{n}-gpu-0" for n in NODES]

    folder = resolve_model("smollm2-135m-instruct").path        # a plain folder: batch 32 -> 4 prompts x n=8
    monkeypatch.setenv("MLFLOW_TRACKING_URI", cluster["mlflow"])
    with temporary_settings(updates={PREFECT_API_URL: cluster["api"]}):
        fr = run_deployment("eval/gsm8k", timeout=0, parameters={
            "checkpoint": folder, "limit": 16, "num_shards": 2, "step": 5, "train_run": "lost-host",
            "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 24, "seed": 9}})
        # both nodes generate: one shard each (one worker per node, one run per worker)
        placed = wait(lambda: (runs := children(fr.id)) and len(runs) == 2 and
                      (m := {_node_of(hosts, r.id): r for r in runs}) and set(m) == set(NODES) and m,
                      timeout=300, every=1)
        victim = placed["node-a"]
        index = victim.parameters["shard_index"]
        wait(lambda: any(f"generations-{index:04d}-of-0002.chunks/batch-00000" in k for k in _keys(s3, "evals/")),
             timeout=300, every=0.5)
        generating = _generating_pid(hosts, "node-a", victim.id)
        worker = json.loads((cluster["homes"]["node-a"] / "stack" / "state.json").read_text())["components"][
            "node-a-gpu-0"]["pid"]
        killed = hosts.kill("node-a")                            # the whole host is gone, mid-shard
        t_loss = time.time()
        # the host's every process died at once: its worker and the shard's generating process among them
        assert {generating, worker} <= set(killed) and hosts.pids("node-a") == [], (generating, worker, killed)
        assert not flow_run(victim.id).state.is_final()          # nobody told the server: it must find out

        state = wait_final(fr.id, timeout=600)
        assert state.is_completed(), state.message
        runs = children(fr.id)
        by_state = sorted((r.state.type.value, r.parameters["shard_index"]) for r in runs)
        assert by_state == sorted([("COMPLETED", 0), ("COMPLETED", 1), ("CRASHED", index)]), by_state
        crashed = flow_run(victim.id).state
        assert crashed.type.value == "CRASHED" and CRASH_AUTOMATION in (crashed.message or ""), crashed  # ours
        relaunched = max((r for r in runs if r.parameters["shard_index"] == index), key=lambda r: r.created)
        running = min(s.timestamp for s in state_history(relaunched.id) if s.type.value == "RUNNING")
        figures = {"loss_to_crashed_s": round(crashed.timestamp.timestamp() - t_loss, 1),
                   "loss_to_relaunch_running_s": round(running.timestamp() - t_loss, 1),
                   "loss_to_completed_s": round(state.timestamp.timestamp() - t_loss, 1)}
        print("lost-host timings:", json.dumps(figures))

    client = MlflowClient(cluster["mlflow"])
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'lost-host'")
    assert run.data.metrics["n_samples"] == 128
    import polars as pl

    keys = _keys(s3, "evals/")
    [samples_key] = [k for k in keys if k.endswith("/samples.parquet")]
    body = s3.get_object(Bucket=BUCKET, Key=samples_key)["Body"].read()
    samples = pl.read_parquet(body)
    assert samples.height == 128 and samples.select("sample_id", "sample_index").n_unique() == 128
    [stats_key] = [k for k in keys if k.endswith(f"/stats-generations-{index:04d}-of-0002.json")]
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=stats_key)["Body"].read())["resumed_batches"] >= 1
    for home in cluster["homes"].values():                      # no node kept results of its own
        assert not (home / "results").exists()

"""Several hosts without starting anything: what a head publishes, how a node builds its workers from it, the
crash automation's shape, the database settings. The real thing runs in test_cluster_netns_e2e.py and
test_lost_node_e2e.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from evaldag.runtime import cluster
from evaldag.cli import app
from evaldag.errors import StackError
from evaldag.runtime.stack import CPU_WORKER, Stack, StackSettings


def test_server_url_and_reachable_addresses():
    assert cluster.server_url("http://head:4200/api/") == "http://head:4200"
    assert cluster.server_url(" https://head.example ") == "https://head.example"
    with pytest.raises(StackError, match="http://HEAD:4200"):
        cluster.server_url("head:4200")
    # a head that published its own loopback or wildcard address is reached by the address the node uses
    assert cluster.reachable("http://0.0.0.0:5000", "http://10.0.0.1:4200") == "http://10.0.0.1:5000"
    assert cluster.reachable("http://127.0.0.1:5000", "http://head:4200") == "http://head:5000"
    assert cluster.reachable("http://mlflow.internal:5000", "http://head:4200") == "http://mlflow.internal:5000"
    assert cluster.public_host("10.1.2.3") == "10.1.2.3"


def test_shared_env_takes_settings_and_credentials_not_the_heads_paths():
    worker = {"EVALDAG_RESULTS_URL": "s3://b/e", "EVALDAG_HOME": "/head", "EVALDAG_DATA_DIR": "/data"}
    caller = {"AWS_SECRET_ACCESS_KEY": "k", "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
              "MLFLOW_TRACKING_TOKEN": "t", "HOME": "/root", "PATH": "/bin"}
    # the result store's and MLflow's URLs go in ClusterInfo's own fields, not among the variables
    assert cluster.shared_env(worker, caller) == {
        "EVALDAG_DATA_DIR": "/data", "AWS_SECRET_ACCESS_KEY": "k", "MLFLOW_TRACKING_TOKEN": "t"}


def test_crash_automation_watches_only_evaldag_runs_after_three_silent_periods():
    auto = cluster.crash_automation(30).model_dump(mode="json")
    trigger = auto["trigger"]
    assert (trigger["posture"], trigger["within"], trigger["threshold"]) == ("Proactive", 90.0, 1)
    assert sorted(trigger["after"]) == ["prefect.flow-run.Running", "prefect.flow-run.heartbeat"]
    assert set(trigger["expect"]) == {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                                      "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                                      "prefect.flow-run.Crashed"}
    assert trigger["for_each"] == ["prefect.resource.id"]
    assert trigger["match_related"] == {"prefect.resource.role": "tag", "prefect.resource.id": "prefect.tag.evaldag"}
    assert auto["actions"][0]["type"] == "change-flow-run-state" and auto["actions"][0]["state"] == "CRASHED"
    assert cluster.crash_automation(60).trigger.within.total_seconds() == 180


def _node(tmp_path, monkeypatch, **kw) -> Stack:
    info = cluster.ClusterInfo(prefect_url="http://10.0.0.1:4200", mlflow_url="http://0.0.0.0:5000",
                               results_url="s3://bucket/evals", heartbeat_s=45,
                               env={"AWS_SECRET_ACCESS_KEY": "from-head", "EVALDAG_DATA_DIR": "/data"})
    monkeypatch.setattr(cluster, "fetch", lambda api, auth=None: info)
    for var in ("EVALDAG_RESULTS_URL", "EVALDAG_RESULTS_DIR", "EVALDAG_GPUS", "EVALDAG_NUM_GPUS",
                "EVALDAG_GPU_WORKERS", "EVALDAG_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    settings = StackSettings(home=tmp_path, server="http://10.0.0.1:4200", node_name="gpu7", num_gpus=2,
                             gpus=("0", "1"), **kw)
    return Stack(settings)


@pytest.mark.parametrize("status, says", [
    (404, ["HTTP 404", "no `gpu` work pool", "run `evaldag up` on the head"]),
    (403, ["HTTP 403", "a proxy or firewall", "NO_PROXY"]),
    (503, ["HTTP 503", "the head's Prefect server failed", "prefect-server.log"]),
    (500, ["HTTP 500", "the head's Prefect server failed"]),
    (401, ["HTTP 401", "refused this node's auth", "--auth"]),
    (302, ["HTTP 302", "check that --server is the head's Prefect address"]),
])
def test_a_node_says_what_the_head_answered_for_its_gpu_pool(tmp_path, monkeypatch, status, says):
    """Only a 404 means the head has no `gpu` pool: a proxy's 403 or the server's own 5xx is named as such, with
    its fix, instead of sending the user to run `evaldag up` on a head that has the pool."""
    import httpx

    stack = _node(tmp_path, monkeypatch)
    seen = []

    def head(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(status, text="upstream says no")

    real_client = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(head), **kw))
    with pytest.raises(StackError) as err:
        stack._check_head_pools()
    assert seen == ["/api/work_pools/gpu"]
    message = str(err.value)
    assert all(s in message for s in says), message
    assert "upstream says no" in message
    assert (status == 404) == ("no `gpu` work pool" in message)


def test_a_node_accepts_the_heads_gpu_pool(tmp_path, monkeypatch):
    import httpx

    stack = _node(tmp_path, monkeypatch, api_auth="evaldag:correct-horse-battery")
    seen = []

    def head(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("Authorization")))
        return httpx.Response(200, json={"name": "gpu"})

    real_client = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(head), **kw))
    assert stack._check_head_pools() is None                   # no StackError: the node goes on to start
    # it asked the head itself, with the head's auth (base64 of evaldag:correct-horse-battery)
    assert seen == [("/api/work_pools/gpu", "Basic ZXZhbGRhZzpjb3JyZWN0LWhvcnNlLWJhdHRlcnk=")]


def test_node_workers_come_from_the_head_and_the_command_line(tmp_path, monkeypatch):
    stack = _node(tmp_path, monkeypatch, worker_env={"AWS_SECRET_ACCESS_KEY": "from-cli"})
    specs = stack._desired_specs("sid")
    assert sorted(specs) == ["gpu7-gpu-0", "gpu7-gpu-1"] and CPU_WORKER not in specs   # no servers, no cpu worker
    env = specs["gpu7-gpu-1"].env
    assert env["PREFECT_API_URL"] == "http://10.0.0.1:4200/api"
    assert env["MLFLOW_TRACKING_URI"] == "http://10.0.0.1:5000"        # the head published 0.0.0.0
    assert env["EVALDAG_RESULTS_URL"] == "s3://bucket/evals"
    assert env["AWS_SECRET_ACCESS_KEY"] == "from-cli"                  # the command line wins over the head
    assert env["EVALDAG_DATA_DIR"] == "/data"                             # (the node's own EVALDAG_* would win)
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "45"           # the period the head's automation expects
    assert env["EVALDAG_HOME"] == str(tmp_path) and env["PREFECT_HOME"] == str(tmp_path / "prefect")
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert specs["gpu7-gpu-1"].argv[specs["gpu7-gpu-1"].argv.index("--pool") + 1] == "gpu"
    assert stack._urls() == {"prefect": "http://10.0.0.1:4200", "mlflow": "http://10.0.0.1:5000"}


# what whoever writes the block (anyone with the Prefect API) might publish: code the workers would load, and
# endpoints, URIs, files and CAs that would send their requests or secrets elsewhere (issue 38 item 2)
HOSTILE = {"LD_PRELOAD": "/tmp/evil.so", "LD_LIBRARY_PATH": "/tmp/evil-lib", "PYTHONPATH": "/tmp/evil",
           "PYTHONSTARTUP": "/tmp/evil.py", "PATH": "/tmp/evil-bin", "EVALDAG_PG_BIN": "/tmp/evil-bin",
           "EVALDAG_REPO": "/tmp/evil-repo", "EVALDAG_CONFIGS_DIR": "/tmp/evil-configs",
           "EVALDAG_FAULTS_FILE": "/tmp/evil-faults.json", "AWS_CONFIG_FILE": "/tmp/cfg",
           "AWS_CONTAINER_CREDENTIALS_FULL_URI": "https://attacker.example/creds",
           "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": "/var/run/secrets/token",
           "AWS_ENDPOINT_URL": "https://attacker.example", "AWS_ENDPOINT_URL_S3": "https://attacker.example/s3",
           "AWS_CA_BUNDLE": "/tmp/evil-ca.pem", "AWS_PROFILE": "evil",
           "AZURE_STORAGE_CONNECTION_STRING": "BlobEndpoint=https://attacker.example;SharedAccessSignature=x",
           "MLFLOW_TRACKING_URI": "https://attacker.example/mlflow", "MLFLOW_TRACKING_INSECURE_TLS": "true",
           "REQUESTS_CA_BUNDLE": "/tmp/evil-ca.pem", "HF_ENDPOINT": "https://attacker.example/hf",
           # a proxy sees every request and its credentials (S3 keys, MLflow token, HF token); NO_PROXY sends a
           # request the node routes through its own proxy around it; a CA file or folder lets a proxy pass as any
           # server (httpx and urllib read SSL_CERT_*, requests REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE)
           "HTTP_PROXY": "http://attacker.example:3128", "HTTPS_PROXY": "http://attacker.example:3128",
           "ALL_PROXY": "socks5://attacker.example:1080", "http_proxy": "http://attacker.example:3128",
           "https_proxy": "http://attacker.example:3128", "all_proxy": "socks5://attacker.example:1080",
           "NO_PROXY": "*", "no_proxy": "*", "SSL_CERT_FILE": "/tmp/evil-ca.pem", "SSL_CERT_DIR": "/tmp/evil-ca",
           "CURL_CA_BUNDLE": "/tmp/evil-ca.pem", "PREFECT_API_URL": "https://attacker.example/api",
           "MLFLOW_S3_ENDPOINT_URL": "https://attacker.example/s3", "HF_HUB_CACHE": "/tmp/evil-hub"}


def test_the_node_allow_list_names_no_endpoint_uri_file_or_ca():
    assert cluster.accepted_env(HOSTILE) == {}
    assert cluster.shared_env(HOSTILE, HOSTILE) == {}              # the head publishes none of them either
    for name in cluster.NODE_ENV_ALLOWED:
        assert not any(word in name.upper() for word in ("ENDPOINT", "URI", "URL", "FILE", "CA_BUNDLE", "PATH",
                                                          "CONNECTION", "PROFILE", "CONFIG", "PROXY", "CERT",
                                                          "SSL")), name


def test_a_node_never_applies_loader_or_interpreter_variables_from_the_head(tmp_path, monkeypatch, caplog):
    """The effective environment of a node's worker (the node's own, under what the spec sets) carries no hostile
    value of the block, not even prepended to a search path the node sets itself."""
    import os

    info = cluster.ClusterInfo(prefect_url="http://10.0.0.1:4200", mlflow_url="http://10.0.0.1:5000",
                               results_url="s3://bucket/evals",
                               env={**HOSTILE, "AWS_SECRET_ACCESS_KEY": "k", "MLFLOW_TRACKING_TOKEN": "t",
                                    "HF_TOKEN": "h", "EVALDAG_DATA_DIR": "/data"})
    stack = _node(tmp_path, monkeypatch)
    monkeypatch.setattr(cluster, "fetch", lambda api, auth=None: info)
    monkeypatch.setenv("PYTHONPATH", "/node/own")                  # the node's own search path stays as it is
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    with caplog.at_level("WARNING", logger="evaldag.runtime.cluster"):
        spec = stack._desired_specs("sid")["gpu7-gpu-0"]
    env = {**os.environ, **spec.env}                               # what the worker process gets (processes.py)
    for key, value in HOSTILE.items():
        assert env.get(key) != value and value not in env.get(key, "").split(os.pathsep), (key, env.get(key))
        assert spec.key["passthrough"].get(key) != value, key       # the settings the block may add
    assert env["PYTHONPATH"] == "/node/own" and "LD_PRELOAD" not in env and "LD_LIBRARY_PATH" not in env
    assert env["MLFLOW_TRACKING_URI"] == "http://10.0.0.1:5000"    # ClusterInfo's, not the env's
    assert (env["AWS_SECRET_ACCESS_KEY"], env["MLFLOW_TRACKING_TOKEN"], env["HF_TOKEN"], env["EVALDAG_DATA_DIR"]) \
        == ("k", "t", "h", "/data")
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(k in warned for k in HOSTILE) and "attacker" not in warned and "/tmp/evil" not in warned


def test_a_home_is_a_head_or_a_node_never_both(tmp_path, monkeypatch):
    stack = _node(tmp_path, monkeypatch)
    head_state = {"role": "head", "components": {"prefect-server": {}}, "urls": {"prefect": "http://x"}}
    with pytest.raises(StackError, match="worker node needs a state folder of its own"):
        stack._check_role(head_state)
    node_state = {"role": "node", "components": {"gpu7-gpu-0": {}}, "urls": {"prefect": "http://10.0.0.1:4200"}}
    with pytest.raises(StackError, match="holds a worker node of http://10.0.0.1:4200"):
        Stack(StackSettings(home=tmp_path))._check_role(node_state)
    stack._check_role(node_state)
    stack._check_role({"components": {}})                                # an empty home can become either


def test_head_listening_everywhere_uses_loopback_locally_and_publishes_its_address(tmp_path):
    s = StackSettings(home=tmp_path, host="0.0.0.0", advertise_host="head.example", prefect_port=4200)
    assert s.prefect_url == "http://127.0.0.1:4200" and s.public_host == "head.example"
    specs = Stack(s)._desired_specs("sid")
    assert specs["prefect-server"].env["PREFECT_UI_API_URL"] == "http://head.example:4200/api"
    assert "head.example" in specs["mlflow-server"].env["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert specs["prefect-server"].argv[specs["prefect-server"].argv.index("--host") + 1] == "0.0.0.0"
    assert specs[CPU_WORKER].env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"


def test_database_settings(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="did you mean postgresql\\+asyncpg://USER:PASSWORD@db/prefect"):
        StackSettings(database_url="postgresql://u:p@db/prefect")
    with pytest.raises(ValueError, match="give one of them"):
        StackSettings(postgres=True, database_url="postgresql+asyncpg://u:p@db/prefect")
    url = "postgresql+asyncpg://u:p@db:5432/prefect"
    specs = Stack(StackSettings(home=tmp_path, database_url=url))._desired_specs("sid")
    assert specs["prefect-server"].env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == url
    assert "postgres" not in specs
    monkeypatch.setenv("EVALDAG_POSTGRES", "1")
    monkeypatch.setenv("EVALDAG_POSTGRES_PORT", "6543")
    s = StackSettings.from_env(home=tmp_path)
    assert s.postgres and s.postgres_port == 6543
    assert not StackSettings.from_env(home=tmp_path, postgres=False).postgres     # `up --sqlite` wins


@pytest.mark.parametrize("overrides", [
    {"api_auth": "evaldag:SHORTPW"},                                          # a password too short
    {"database_url": "postgres://prefect:SHORTPW@db:5432/prefect"},           # a URL Prefect cannot use
    {"database_url": "prefect:SHORTPW@db:5432/prefect"},                      # ... without a scheme
    {"database_url": "postgres://prefect:SHORT/PW@db:5432/prefect"},          # ... a password with a /
    {"database_url": "postgresql://prefect:SHORT#PW@db:5432/prefect"},        # ... or a #
    {"api_auth": "evaldag:SHORTPW", "heartbeat_s": "5"},                      # another field's error beside it
], ids=["auth", "database-url", "no-scheme", "slash", "hash", "other-field"])
def test_settings_errors_do_not_show_passwords(tmp_path, monkeypatch, overrides):
    """pydantic's own message quotes the input (input_value=...): the settings' errors leave values out."""
    monkeypatch.delenv("EVALDAG_API_AUTH", raising=False)
    with pytest.raises(StackError, match="invalid stack settings: ") as err:
        StackSettings.from_env(home=tmp_path, **overrides)
    assert all(part not in str(err.value) for part in ("SHORTPW", "SHORT/PW", "SHORT#PW", "input_value"))
    if overrides.get("database_url", "").startswith("postgres"):
        assert "did you mean postgresql+asyncpg://USER:PASSWORD@db:5432/prefect?" in str(err.value)


def test_worker_cli_shows_the_mlflow_url_without_its_password(tmp_path, monkeypatch):
    from evaldag.runtime.stack import UpReport

    monkeypatch.setattr("evaldag.runtime.node_clock.check_clock", lambda *a, **kw: None)
    _node(tmp_path, monkeypatch)                                  # the head's published block, without a server
    monkeypatch.setattr(Stack, "up", lambda self, deploy=True: UpReport())
    monkeypatch.setattr(Stack, "_load_state", lambda self: {"urls": self._urls()})    # as up() records them
    result = CliRunner().invoke(app, ["worker", "--server", "http://10.0.0.1:4200", "--gpus", "1",
                                      "--mlflow-url", "https://evaldag:MLPW-123456@mlflow.corp"],
                                env={"EVALDAG_HOME": str(tmp_path), "EVALDAG_GPUS": "0"})
    assert result.exit_code == 0, result.output
    assert "MLflow:      https://***@mlflow.corp" in result.output and "MLPW-123456" not in result.output


def test_worker_cli_rejects_a_bad_env_pair_and_an_unreachable_head(tmp_path):
    env = {"EVALDAG_HOME": str(tmp_path)}
    result = CliRunner().invoke(app, ["worker", "--server", "http://127.0.0.1:9", "--env", "NOVALUE"], env=env)
    assert result.exit_code != 0 and "is not KEY=VALUE" in result.output
    result = CliRunner().invoke(app, ["worker", "--server", "http://127.0.0.1:9"], env=env)
    assert result.exit_code == 1
    assert "cannot reach the head's Prefect API at http://127.0.0.1:9/api" in result.output
    assert "Traceback" not in result.output


def test_the_automation_file_for_other_servers_is_the_one_up_creates():
    import yaml
    from prefect.events.schemas.automations import AutomationCore

    from evaldag import paths

    text = (paths.REPO_ROOT / "deployments" / "crash-automation.yaml").read_text()
    from_file = AutomationCore.model_validate(yaml.safe_load(text)).model_dump(mode="json")
    assert cluster._canonical(from_file) == cluster._canonical(cluster.crash_automation(30).model_dump(mode="json"))


def _configure_only(monkeypatch) -> list[str]:
    """Stub what _configure_server does over HTTP; returns the list the cluster block calls are recorded in."""
    calls: list[str] = []
    monkeypatch.setattr(cluster, "publish", lambda api, info: calls.append(f"publish {sorted(info.env)}"))
    monkeypatch.setattr(cluster, "unpublish", lambda api: calls.append("unpublish"), raising=False)
    monkeypatch.setattr(cluster, "ensure_crash_automation", lambda api, hb, missed: "kept")
    monkeypatch.setattr("evaldag.runtime.prefect_results.configure", lambda api, root: None)
    monkeypatch.setattr(Stack, "_ensure_pools", lambda self: None)
    monkeypatch.setattr(Stack, "_ensure_gpu_limit", lambda self, reset_slots=False: None)
    return calls


def test_a_stack_without_nodes_publishes_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    monkeypatch.setenv("HF_TOKEN", "hf")
    calls = _configure_only(monkeypatch)
    for host in ("127.0.0.1", "localhost", "127.0.0.2", "::1"):
        Stack(StackSettings(home=tmp_path, host=host))._configure_server(fresh=True)
    # loopback only: no block, and one an earlier head left is deleted
    assert calls == ["unpublish"] * 4
    calls.clear()
    auth = "evaldag:correct-horse-battery"
    for kw in ({"host": "0.0.0.0"}, {"host": "10.0.0.1"}, {"host": "127.0.0.1", "advertise_host": "head.example"}):
        Stack(StackSettings(home=tmp_path, api_auth=auth, **kw))._configure_server(fresh=True)
    assert len(calls) == 3 and all(c.startswith("publish") and "AWS_SECRET_ACCESS_KEY" in c for c in calls)


def test_a_head_beyond_loopback_without_auth_refuses_to_start(tmp_path, monkeypatch):
    def no_start(*a, **kw):
        raise AssertionError("a component was started")

    monkeypatch.setattr(Stack, "_spawn", no_start)
    monkeypatch.setattr(Stack, "_check_port_free", no_start)
    for host in ("0.0.0.0", "10.0.0.1", "::", "head.example"):
        with pytest.raises(StackError, match="without authentication.*--auth USER:PASSWORD"):
            Stack(StackSettings(home=tmp_path, host=host)).up()
    assert not (tmp_path / "stack" / "state.json").exists()
    # the same through the command line: one clear line, exit code 1
    result = CliRunner().invoke(app, ["up", "--host", "10.0.0.1", "--no-deploy"],
                                env={"EVALDAG_HOME": str(tmp_path), "EVALDAG_API_AUTH": ""})
    assert result.exit_code == 1 and "--auth USER:PASSWORD" in result.output and "Traceback" not in result.output
    with pytest.raises(StackError, match="at least 12 characters"):
        StackSettings.from_env(home=tmp_path, host="0.0.0.0", api_auth="evaldag:short")
    StackSettings(home=tmp_path, host="10.0.0.1", api_auth="evaldag:correct-horse-battery").check_exposure()
    StackSettings(home=tmp_path, host="127.0.0.1").check_exposure()      # loopback needs none


def test_a_loopback_head_advertised_to_nodes_refuses_to_start_without_auth(tmp_path, monkeypatch):
    """`--host 127.0.0.1 --advertise-host X` is a head for nodes behind a tunnel or proxy: it publishes the cluster
    block, so it needs auth as much as one on 0.0.0.0 (before: it started open, and the block's credentials were
    one POST /api/block_documents/filter away from anyone who reached the tunnel, and from every local user)."""
    def no_start(*a, **kw):
        raise AssertionError("a component was started")

    monkeypatch.setattr(Stack, "_spawn", no_start)
    monkeypatch.setattr(Stack, "_check_port_free", no_start)
    for host in ("127.0.0.1", "localhost", "::1"):
        settings = StackSettings(home=tmp_path, host=host, advertise_host="10.0.0.5")
        assert settings.for_nodes and settings.loopback_only
        with pytest.raises(StackError, match="advertised to worker nodes as '10.0.0.5'.*without authentication"):
            Stack(settings).up()
    assert not (tmp_path / "stack" / "state.json").exists()
    result = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--advertise-host", "10.0.0.5", "--no-deploy"],
                                env={"EVALDAG_HOME": str(tmp_path), "EVALDAG_API_AUTH": ""})
    assert result.exit_code == 1 and "--auth USER:PASSWORD" in result.output and "Traceback" not in result.output
    assert "advertised to worker nodes" in result.output
    # with auth it starts (and publishes: test_a_stack_without_nodes_publishes_no_credentials); without
    # nodes it needs none
    StackSettings(home=tmp_path, host="127.0.0.1", advertise_host="10.0.0.5",
                  api_auth="evaldag:correct-horse-battery").check_exposure()
    StackSettings(home=tmp_path, host="127.0.0.1").check_exposure()


def test_auth_reaches_both_servers_every_worker_and_the_nodes_but_not_the_block(tmp_path, monkeypatch):
    auth = "evaldag:correct-horse-battery"
    monkeypatch.setenv("EVALDAG_API_AUTH", auth)
    s = StackSettings.from_env(home=tmp_path, host="0.0.0.0")
    assert s.api_auth == auth and auth not in repr(s)
    stack = Stack(s)
    specs = stack._desired_specs("sid")
    assert specs["prefect-server"].env["PREFECT_SERVER_API_AUTH_STRING"] == auth
    mlflow = specs["mlflow-server"]
    assert mlflow.argv[mlflow.argv.index("--app-name") + 1] == "basic-auth"
    assert (mlflow.env["MLFLOW_AUTH_ADMIN_USERNAME"], mlflow.env["MLFLOW_AUTH_ADMIN_PASSWORD"]) == (
        "evaldag", "correct-horse-battery")
    worker = specs[CPU_WORKER].env
    assert (worker["PREFECT_API_AUTH_STRING"], worker["MLFLOW_TRACKING_USERNAME"],
            worker["MLFLOW_TRACKING_PASSWORD"]) == (auth, "evaldag", "correct-horse-battery")
    assert "EVALDAG_API_AUTH" not in worker and "EVALDAG_API_AUTH" not in stack._cluster_info().env
    assert stack._api_headers()["Authorization"].startswith("Basic ")
    # a node: its --auth goes to its workers, for the head's Prefect API and MLflow
    monkeypatch.delenv("EVALDAG_API_AUTH")
    node = _node(tmp_path / "node", monkeypatch, api_auth=auth)
    env = node._desired_specs("sid")["gpu7-gpu-0"].env
    assert (env["PREFECT_API_AUTH_STRING"], env["MLFLOW_TRACKING_PASSWORD"]) == (auth, "correct-horse-battery")


def test_servers_with_auth_answer_401_to_a_client_without_it(tmp_path):
    """Both servers as the stack starts them with --auth (on loopback, a few seconds): a request without the auth
    gets 401, one with it gets in; health stays open for probes."""
    import base64
    import os
    import signal
    import subprocess
    import time

    import httpx

    from conftest import free_ports

    auth = "evaldag:correct-horse-battery"
    prefect_port, mlflow_port = free_ports(2)
    specs = Stack(StackSettings(home=tmp_path, prefect_port=prefect_port, mlflow_port=mlflow_port,
                                api_auth=auth))._desired_specs("sid")
    procs = [subprocess.Popen(specs[name].argv, env={**os.environ, **specs[name].env}, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for name in ("prefect-server", "mlflow-server")]
    prefect, mlflow = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    try:
        deadline = time.monotonic() + 120
        for health in (f"{prefect}/health", f"{mlflow}/health"):      # open without auth, for probes
            while True:
                try:
                    if httpx.get(health, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "servers did not start"
                time.sleep(0.5)
        basic = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
        wrong = {"Authorization": "Basic " + base64.b64encode(b"evaldag:wrong-password-123").decode()}
        assert httpx.post(f"{prefect}/block_documents/filter", json={}, timeout=10).status_code == 401
        assert httpx.post(f"{prefect}/block_documents/filter", json={}, headers=wrong, timeout=10).status_code == 401
        assert httpx.post(f"{prefect}/block_documents/filter", json={}, headers=basic, timeout=10).status_code == 200
        search = f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=1"
        assert httpx.get(search, timeout=10).status_code == 401
        assert httpx.get(search, headers=wrong, timeout=10).status_code == 401
        assert httpx.get(search, headers=basic, timeout=10).status_code == 200
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)

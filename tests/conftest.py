"""Shared test setup.

Environment is fixed before anything imports prefect: results, caches and Prefect state go to a temporary folder so
test sessions never see each other's results; the benchmark data comes from ../shared/data; the exported default
model is shared with `make run` (it is keyed by the GGUF's hash, so sharing it is safe and saves ~20 s).
The real local stack (Prefect server, cpu/gpu workers, MLflow server) is started once per session, on free ports,
only when a test asks for it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from pathlib import Path

_TMP = Path(tempfile.mkdtemp(prefix="evaldag-test-"))
# Removed when the session's process exits (after the stack is down): a session leaves 50-300 MB here, and sessions
# that leave them fill a CI machine's disk. EVALDAG_KEEP_TEST_TMP=1 keeps it for a post-mortem.
_OWNER_PID = os.getpid()


def _remove_tmp() -> None:
    if os.getpid() == _OWNER_PID and not os.environ.get("EVALDAG_KEEP_TEST_TMP"):    # not in a forked child
        shutil.rmtree(_TMP, ignore_errors=True)


atexit.register(_remove_tmp)
_REPO = Path(__file__).resolve().parent.parent
os.environ["EVALDAG_HOME"] = str(_TMP / "home")
os.environ["PREFECT_HOME"] = str(_TMP / "prefect")
os.environ.setdefault("EVALDAG_DATA_DIR", str(_REPO.parent / "shared" / "data"))
os.environ.setdefault("EVALDAG_MODELS_DIR", str(Path.home() / ".evaldag" / "models"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
# huggingface_hub's model cache of this session: tests lay hub snapshots out in it (tests/hub_cache.py) and the
# stack's workers read hub models from it, never the user's own cache
os.environ["HF_HUB_CACHE"] = str(_TMP / "hf-hub")
# checkpoint events and sweeps may only point here (the stack hands it to its workers)
os.environ["EVALDAG_CHECKPOINT_ROOTS"] = str(_TMP / "checkpoints")
# the fault drill's plan (evaldag.pipeline.faults): absent, so nothing fails, until a test writes it; workers inherit it
os.environ["EVALDAG_FAULTS_FILE"] = str(_TMP / "faults.json")
(_TMP / "checkpoints").mkdir(parents=True, exist_ok=True)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# The pipeline's mechanics (caching, faults, triggers, metrics) are tested on the transformers engine: a shard of a
# few problems loads it in ~1 s, where a vLLM engine start costs 20-40 s on 2 cores. The default engine itself
# (vLLM) runs for real in tests/engine_vllm, through the same stack, and test_plan checks that it is the default.
os.environ.setdefault("EVALDAG_DEFAULT_ENGINE", "hf")
# Workers poll every second in tests (production: 2 s, test_stack checks it): about 150 flow runs start in a session,
# each waiting half a poll on average. Stacks started through the CLI read this; the ones built here pass it.
TEST_WORKER_QUERY_S = 1
os.environ["EVALDAG_WORKER_QUERY_SECONDS"] = str(TEST_WORKER_QUERY_S)
# A lost node's runs are crashed after 2 silent heartbeat periods (60 s) instead of 3 (90 s; test_stack checks it):
# the netns test waits for that window. Read by stacks started through the CLI (the netns hosts' `evaldag up`).
os.environ["EVALDAG_MISSED_HEARTBEATS"] = "2"
# sequential stopping (evaldag.decisions.decide): the parent reads the shards' rows every second, 4 requests in flight per
# shard so that a 24-problem slice finishes in several steps (production: 10 s, the model's batch_size)
os.environ["EVALDAG_DECIDE_POLL_S"] = "1"
os.environ["EVALDAG_DECIDE_IN_FLIGHT"] = "4"
for var in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
    os.environ.pop(var, None)

import pytest  # noqa: E402

TEST_MLFLOW_TIMEOUT_S = 12


def require_free_disk(path: Path, gib: float, what: str) -> None:
    """Fail at once, saying so, when `path`'s disk has less than `gib` GiB free for `what`: a full disk otherwise
    surfaces deep inside torch.save as a write error in the middle of a training step."""
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free / 2**30
    if free < gib:
        pytest.fail(f"{what} needs about {gib:g} GiB free on the disk of {path}; it has {free:.1f} GiB. "
                    "Free space there (old test or CI folders in the temp dir) or set TMPDIR to a larger disk.",
                    pytrace=False)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def complete_checkpoint(folder: Path) -> Path:
    """A tiny folder that passes checkpoint validation (config, weights, tokenizer); not a loadable model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"w" * 64)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture(scope="session")
def live_stack():
    """The real local stack with everything in deployments/ deployed; clients in this process point at it.

    EVALDAG_TEST_DATABASE=postgres runs its Prefect server on a private PostgreSQL cluster (CI runs the stack
    tests once that way); the default is SQLite."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from evaldag.runtime.stack import Stack, StackSettings

    prefect_port, mlflow_port, pg_port = free_ports(3)
    database = os.environ.get("EVALDAG_TEST_DATABASE", "sqlite")
    if database not in ("sqlite", "postgres"):
        raise pytest.UsageError(f"EVALDAG_TEST_DATABASE={database!r}: use sqlite or postgres")
    extra = {}
    if database == "postgres":
        # under root the cluster runs as `postgres`, which cannot enter this session's 0700 temp folder
        pg_root = Path(tempfile.mkdtemp(prefix="evaldag-test-pg-"))
        pg_root.chmod(0o755)
        extra = {"postgres": True, "postgres_port": pg_port, "postgres_dir": pg_root / "cluster"}
    # a shorter MLflow request timeout than production's 30 s (test_stack checks that one): the hung-server test
    # waits out about three of them
    stack = Stack(StackSettings(home=_TMP / "stack-home", prefect_port=prefect_port, mlflow_port=mlflow_port,
                                mlflow_timeout_s=TEST_MLFLOW_TIMEOUT_S, worker_query_seconds=TEST_WORKER_QUERY_S,
                                missed_heartbeats=int(os.environ["EVALDAG_MISSED_HEARTBEATS"]),
                                **extra))
    try:
        stack.up(deploy=True)
        env = {"PREFECT_API_URL": stack.settings.prefect_api_url, "MLFLOW_TRACKING_URI": stack.mlflow_url,
               "EVALDAG_HOME": str(stack.home)}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        with temporary_settings(updates={PREFECT_API_URL: stack.settings.prefect_api_url}):
            yield stack
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        stack.down()
        if extra:
            shutil.rmtree(extra["postgres_dir"].parent, ignore_errors=True)


@pytest.fixture
def anyio_backend():
    return "asyncio"


# What the marks promise (docs/testing.md): `-m "not stack"` starts no stack, `-m "not stack and not model"` loads no
# model either. Both are enforced, so a new test cannot quietly make the fast subset slow.
_STACK_FIXTURES = {"live_stack", "stack"}   # conftest's session stack, test_stack.py's module stack


# The stack and model tests' longest files, longest first (CI's durations, 2026-12). `make test` hands whole test files
# to its xdist workers in collection order (--dist loadfile --no-loadscope-reorder), so these start first and the
# short files fill in at the end, instead of a long file starting last and running alone while the other worker
# idles. A stable sort: the other files keep their order after these, and each file its tests' order.
LONGEST_FIRST = (
    "tests/engine_vllm/test_decide_e2e.py",
    "tests/test_trl_e2e.py",
    "tests/test_cancel_windows_e2e.py",
    "tests/engine_vllm/test_adaptive_e2e.py",
    "tests/test_cluster_netns_e2e.py",
    "tests/test_foreground_worker.py",
)


def pytest_collection_modifyitems(config, items):
    missing = [f for f in LONGEST_FIRST if not (_REPO / f).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}; "
                                "update it to the renamed or removed test files")
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(_REPO).as_posix(), len(rank)))
    unmarked = [item.nodeid for item in items if item.get_closest_marker("stack") is None
                and _STACK_FIXTURES & set(getattr(item, "fixturenames", ()))]
    if unmarked:
        raise pytest.UsageError("these tests start the real stack but are not marked `stack`; add @pytest.mark.stack "
                                "so that `-m \"not stack\"` stays fast: " + ", ".join(unmarked))


@pytest.fixture(autouse=True)
def _model_needs_its_mark(request, monkeypatch):
    """A test without the `model` mark that loads a checkpoint through evaldag.engines.load_engine (the path every
    stage takes) fails, naming the mark; tests that swap in a stand-in engine patch over this."""
    if request.node.get_closest_marker("model") is not None:
        return
    from evaldag import engines

    real = engines.load_engine

    def guarded(name, model_path, *args, **kwargs):
        if Path(model_path).is_dir():
            pytest.fail(f"{request.node.nodeid} loads the model in {model_path} but is not marked `model`; add "
                        "@pytest.mark.model", pytrace=False)
        return real(name, model_path, *args, **kwargs)

    monkeypatch.setattr(engines, "load_engine", guarded)


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """A writable copy of configs/ that the loaders use."""
    from evaldag import paths

    folder = tmp_path / "configs"
    shutil.copytree(paths.REPO_ROOT / "configs", folder)
    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(folder))
    return folder


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A fresh SQLite MLflow store for the test, its artifacts under tmp_path (the store's default artifact root is
    ./mlruns); returns its tracking URI."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    return uri


@pytest.fixture
def sqlite_mlflow(mlflow_store):
    """mlflow_store, also set in mlflow itself for the test (an earlier test's set_tracking_uri would win over the
    variable) and taken back after it."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(mlflow_store):
        yield mlflow_store


# A stack test that fails because a flow run failed shows only the run's one-line message (e.g. "RuntimeError: ..."):
# the traceback lives in the run's logs on the Prefect server, which goes down with the session. So a failed stack
# test's report carries the ERROR logs the server received while it ran.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.when == "call" and _STACK_FIXTURES & set(getattr(item, "fixturenames", ())):
        try:
            text = _error_logs_since(call.start)
        except Exception as e:  # noqa: BLE001 - a report must not fail for want of its extra section
            text = f"(could not read the Prefect server's logs: {e})"
        if text:
            report.sections.append(("flow runs' error logs", text))
    return report


def _error_logs_since(start: float, limit: int = 20, max_chars: int = 6000) -> str:
    """The Prefect server's ERROR (and worse) logs since `start` (epoch seconds), newest last, each cut short."""
    import asyncio
    import datetime as dt

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterLevel, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    async def read():
        async with get_client() as client:
            return await client.read_logs(
                log_filter=LogFilter(level=LogFilterLevel(ge_=40),
                                     timestamp=LogFilterTimestamp(after_=dt.datetime.fromtimestamp(start, dt.UTC))),
                sort=LogSort.TIMESTAMP_DESC, limit=limit)

    logs = asyncio.run(read())
    return "\n".join(f"{log.timestamp} flow run {log.flow_run_id} task run {log.task_run_id} [{log.name}]\n"
                     f"{log.message[-max_chars:]}" for log in reversed(logs))


# A slow stack or model test is named with its time as soon as it ends, not only in --durations' table at the end of
# the session: a CI run cut off at its time limit then still says where the time went.
SLOW_TEST_S = 120


_CONFIG: list = []


def pytest_configure(config):
    _CONFIG.append(config)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration >= SLOW_TEST_S and _CONFIG:
        terminal = _CONFIG[-1].pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.write_line(f"\n[slow test] {report.nodeid}: {report.duration:.0f} s")

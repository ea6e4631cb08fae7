"""GPU assignment of the gpu-pool workers, GPUs per shard, and the GPU-slot guard of the shard flow (no server)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from evaldag.request import gpus
from evaldag.cli import app
from evaldag.errors import ConfigError, StackError
from evaldag.request.gpus import (
    GPU_LIMIT,
    assign_gpus,
    check_fits,
    check_visible_gpus,
    detect_gpu_ids,
    parse_gpu_ids,
    shard_gpus,
)
from evaldag.request.checkpoint import ResolvedModel
from evaldag.runtime.stack import CPU_WORKER, Stack, StackSettings


def test_parse_gpu_ids():
    assert parse_gpu_ids(None) is None
    assert parse_gpu_ids("") == ()
    assert parse_gpu_ids(" 0, 1,,3 ") == ("0", "1", "3")


@pytest.mark.parametrize(("n", "tp", "ids", "expected"), [
    (1, 1, None, [None]),
    (4, 1, None, [None] * 4),                               # CPU box: slots, nothing pinned
    (4, 2, None, [None, None]),
    (0, 1, None, []),
    (4, 1, ["0", "1", "2", "3"], [("0",), ("1",), ("2",), ("3",)]),
    (4, 2, ["0", "1", "2", "3"], [("0", "1"), ("2", "3")]),
    (4, 4, ["3", "2", "1", "0"], [("3", "2", "1", "0")]),
    (6, 3, ["0", "1", "2", "3", "4", "5"], [("0", "1", "2"), ("3", "4", "5")]),
    (2, 2, ["GPU-aaa", "GPU-bbb"], [("GPU-aaa", "GPU-bbb")]),  # UUIDs work as well as indices
])
def test_assign_gpus(n, tp, ids, expected):
    got = assign_gpus(n, tp, ids)
    assert got == expected
    pinned = [g for group in got if group for g in group]
    assert len(pinned) == len(set(pinned))  # no GPU goes to two workers


@pytest.mark.parametrize(("n", "tp", "ids", "match"), [
    (3, 2, None, "not a multiple of --tp 2"),
    (1, 2, None, "not a multiple of --tp 2"),
    (2, 0, None, "--tp must be a whole number >= 1"),
    (2, -1, None, "--tp must be"),
    (-1, 1, None, "--gpus must be"),
    (2, 1, ["0"], "name 1 GPUs, but --gpus is 2"),
    (2, 1, ["0", "0"], "name a GPU twice"),
])
def test_assign_gpus_errors(n, tp, ids, match):
    with pytest.raises(ConfigError, match=match):
        assign_gpus(n, tp, ids)


def test_detect_gpu_ids(monkeypatch):
    assert detect_gpu_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ("2", "3")  # the caller's restriction wins
    assert detect_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) is None          # explicitly no GPU
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    assert detect_gpu_ids({}) is None                                   # no driver: a CPU box
    monkeypatch.setattr(gpus.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    listing = "GPU 0: NVIDIA H100 (UUID: GPU-a)\nGPU 1: NVIDIA H100 (UUID: GPU-b)\n"
    monkeypatch.setattr(gpus.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=listing))
    assert detect_gpu_ids({}) == ("0", "1")

    def broken(*a, **k):
        raise subprocess.TimeoutExpired("nvidia-smi", 20)

    monkeypatch.setattr(gpus.subprocess, "run", broken)
    assert detect_gpu_ids({}) is None


def _model(engine: str, **engine_args) -> ResolvedModel:
    return ResolvedModel(name="m", path="/m", fingerprint="f", dtype="bfloat16", engine=engine, batch_size=8,
                         engine_args=engine_args)


def test_shard_gpus():
    assert shard_gpus(_model("vllm")) == 1
    assert shard_gpus(_model("vllm", tensor_parallel_size=4, gpu_memory_utilization=0.9)) == 4
    assert shard_gpus(_model("hf", tensor_parallel_size=4)) == 1  # only vllm spans GPUs
    assert shard_gpus(_model("openai")) == 0                      # a served model holds no local GPU
    assert shard_gpus({"engine": "vllm", "engine_args": {"tensor_parallel_size": 2}}) == 2
    assert shard_gpus({"engine": "vllm", "engine_args": None}) == 1
    for bad in (0, -2, "2", 1.5, True):
        with pytest.raises(ConfigError, match="tensor_parallel_size must be a whole number"):
            shard_gpus(_model("vllm", tensor_parallel_size=bad))


def test_check_visible_and_fits():
    check_visible_gpus(2, None)        # not pinned: nothing to check
    check_visible_gpus(2, "")          # CPU box
    check_visible_gpus(2, "0,1")
    with pytest.raises(ConfigError, match=r"needs 4 GPUs .* sees 2 \(CUDA_VISIBLE_DEVICES=0,1\).*--tp 4"):
        check_visible_gpus(4, "0,1")
    check_fits(2, 2)
    with pytest.raises(ConfigError, match=r"needs 4 GPUs .* has 2 \(concurrency limit 'evaldag-gpus' = 2\)"):
        check_fits(4, 2)


# ---------------------------------------------------------------------- the stack's settings and workers


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path))
    for var in ("EVALDAG_GPUS", "EVALDAG_NUM_GPUS", "EVALDAG_GPU_WORKERS", "EVALDAG_TP", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _cuda(settings: StackSettings) -> dict[str, str | None]:
    specs = Stack(settings)._desired_specs("x")
    return {n: s.env.get("CUDA_VISIBLE_DEVICES") for n, s in specs.items() if s.kind == "worker"}


def test_settings_tp_with_named_gpus(clean_env):
    clean_env.setenv("EVALDAG_GPUS", "0,1,2,3")
    clean_env.setenv("EVALDAG_TP", "2")
    s = StackSettings.from_env()
    assert (s.num_gpus, s.tp, s.num_gpu_workers) == (4, 2, 2)
    assert _cuda(s) == {CPU_WORKER: None, "gpu-worker-0": "0,1", "gpu-worker-1": "2,3"}
    s = StackSettings.from_env(tp=4)
    assert _cuda(s) == {CPU_WORKER: None, "gpu-worker-0": "0,1,2,3"}
    for spec in Stack(s)._desired_specs("x").values():
        if spec.pool == "gpu":
            assert spec.argv[spec.argv.index("--limit") + 1] == "1"
    with pytest.raises(StackError, match="name 4 GPUs, but --gpus is 2"):
        StackSettings.from_env(num_gpus=2)


def test_settings_gpus_on_a_cpu_box(clean_env):
    clean_env.setattr("evaldag.runtime.stack.settings.detect_gpu_ids", lambda: None)
    s = StackSettings.from_env(num_gpus=4, tp=2)
    assert (s.gpus, s.num_gpu_workers) == (None, 2)
    assert _cuda(s) == {CPU_WORKER: None, "gpu-worker-0": None, "gpu-worker-1": None}  # inherit, as before
    s = StackSettings.from_env()  # nothing asked: one unpinned worker, as before
    assert (s.num_gpus, s.tp, s.gpus, s.num_gpu_workers) == (1, 1, None, 1)
    assert StackSettings.from_env(gpu_workers=3).num_gpus == 3  # the old keyword (--gpu-workers)
    assert StackSettings(gpu_workers=2).num_gpus == 2
    with pytest.raises(StackError, match="not a multiple of --tp 2"):
        StackSettings.from_env(num_gpus=3, tp=2)


def test_settings_gpus_on_a_gpu_box(clean_env):
    clean_env.setattr("evaldag.runtime.stack.settings.detect_gpu_ids", lambda: ("0", "1", "2", "3"))
    assert _cuda(StackSettings.from_env(num_gpus=2)) == {CPU_WORKER: None, "gpu-worker-0": "0", "gpu-worker-1": "1"}
    assert _cuda(StackSettings.from_env(num_gpus=4, tp=2))["gpu-worker-1"] == "2,3"
    clean_env.setenv("EVALDAG_NUM_GPUS", "4")
    assert StackSettings.from_env().gpus == ("0", "1", "2", "3")
    with pytest.raises(StackError, match="asks for more GPUs than this machine shows: 4"):
        StackSettings.from_env(num_gpus=8)


def test_cli_up_rejects_a_bad_layout_before_starting_anything(tmp_path):
    env = {"EVALDAG_HOME": str(tmp_path), "EVALDAG_GPUS": "", "CUDA_VISIBLE_DEVICES": ""}
    result = CliRunner().invoke(app, ["up", "--no-deploy", "--gpus", "3", "--tp", "2"], env=env)
    assert result.exit_code == 1
    assert "error: --gpus 3 is not a multiple of --tp 2" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["up", "--no-deploy", "--gpu-workers", "2", "--tp", "0"], env=env)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert not (tmp_path / "stack" / "state.json").exists()
    result = CliRunner().invoke(app, ["up", "--help"])
    assert "--gpus" in result.output and "--gpu-workers" in result.output and "--tp" in result.output


@pytest.fixture
def warnings_said():
    """The warnings logged on "evaldag" during the test (a handler on that logger itself: Prefect's logging setup
    may stop it from propagating to caplog's root handler)."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("evaldag")
    log.addHandler(handler)
    try:
        yield lambda: list(said)
    finally:
        log.removeHandler(handler)


def test_old_names_of_num_gpus_still_work_and_say_so(clean_env, warnings_said):
    clean_env.setattr("evaldag.runtime.stack.settings.detect_gpu_ids", lambda: None)
    clean_env.setenv("EVALDAG_NUM_GPUS", "2")
    assert StackSettings.from_env().num_gpus == 2 and warnings_said() == []  # the new name: no warning
    clean_env.delenv("EVALDAG_NUM_GPUS")
    clean_env.setenv("EVALDAG_GPU_WORKERS", "4")
    assert StackSettings.from_env().num_gpus == 4
    assert warnings_said() == ["warning: EVALDAG_GPU_WORKERS is deprecated; use EVALDAG_NUM_GPUS"]
    clean_env.setenv("EVALDAG_NUM_GPUS", "2")
    assert StackSettings.from_env().num_gpus == 2  # both set: the new name wins
    clean_env.delenv("EVALDAG_GPU_WORKERS")
    clean_env.delenv("EVALDAG_NUM_GPUS")
    assert StackSettings(gpu_workers=3).num_gpus == 3
    assert StackSettings(gpu_workers=3, num_gpus=2).num_gpus == 2
    assert StackSettings.from_env(gpu_workers=4).num_gpus == 4
    assert warnings_said()[-3:] == ["warning: gpu_workers is deprecated; use num_gpus"] * 3


def test_cli_old_gpu_workers_option_still_works_and_says_so(tmp_path, warnings_said):
    env = {"EVALDAG_HOME": str(tmp_path), "EVALDAG_GPUS": "", "CUDA_VISIBLE_DEVICES": "", "EVALDAG_NUM_GPUS": "",
           "EVALDAG_GPU_WORKERS": ""}
    # --gpu-workers 3 reaches the settings as --gpus 3: the layout check rejects it in --gpus' words
    result = CliRunner().invoke(app, ["up", "--no-deploy", "--gpu-workers", "3", "--tp", "2"], env=env)
    assert result.exit_code == 1 and "error: --gpus 3 is not a multiple of --tp 2" in result.output
    assert warnings_said() == ["warning: --gpu-workers is deprecated; use --gpus"]
    result = CliRunner().invoke(app, ["up", "--no-deploy", "--tp", "2"], env={**env, "EVALDAG_GPU_WORKERS": "3"})
    assert result.exit_code == 1 and "error: --gpus 3 is not a multiple of --tp 2" in result.output
    assert warnings_said()[-1] == "warning: EVALDAG_GPU_WORKERS is deprecated; use EVALDAG_NUM_GPUS"
    assert not (tmp_path / "stack" / "state.json").exists()


# ---------------------------------------------------------------------- the shard flow's GPU slots (no server)


@pytest.fixture
def slots(monkeypatch):
    """tasks.gpu_slots' GPU slots with the limit lookup and Prefect's concurrency() replaced by fakes; records what
    was acquired."""
    import prefect.concurrency.sync

    from tasks import gpu_slots as task_gpus

    acquired: list[tuple] = []
    leases: list[float] = []

    @contextlib.contextmanager
    def fake_concurrency(names, occupy=1, **kwargs):
        acquired.append((names, occupy))
        leases.append(kwargs["lease_duration"])
        yield

    monkeypatch.setattr(prefect.concurrency.sync, "concurrency", fake_concurrency)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    state = SimpleNamespace(limit=None, acquired=acquired, leases=leases, module=task_gpus)
    monkeypatch.setattr(task_gpus, "_read_limit", lambda name: state.limit)
    return state


def test_gpu_slots_missing_or_inactive_limit_runs_without_slots(slots, caplog):
    ran = []
    log = logging.getLogger("evaldag")  # Prefect's logging setup may stop it from propagating to caplog's root handler
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="evaldag"), slots.module.hold_gpus(2):
            ran.append(1)
    finally:
        log.removeHandler(caplog.handler)
    assert ran == [1] and slots.acquired == []
    assert f"{GPU_LIMIT!r} does not exist" in caplog.text
    slots.limit = SimpleNamespace(limit=1, active=False, active_slots=0)
    with slots.module.hold_gpus(4):  # inactive = unlimited in Prefect: no check against its limit either
        ran.append(2)
    assert ran == [1, 2] and slots.acquired == []


def test_gpu_slots_occupies_tp_and_rejects_tp_over_limit(slots, monkeypatch):
    slots.limit = SimpleNamespace(limit=4, active=True, active_slots=0)
    with slots.module.hold_gpus(2):
        pass
    assert slots.acquired == [(GPU_LIMIT, 2)]
    assert slots.leases == [60]            # Prefect's server refuses a lease under 60 s (HTTP 422)
    with pytest.raises(ConfigError, match="needs 8 GPUs"), slots.module.hold_gpus(8):
        pytest.fail("must not run")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match="its worker sees 1"), slots.module.hold_gpus(2):
        pytest.fail("must not run")
    assert slots.acquired == [(GPU_LIMIT, 2)]


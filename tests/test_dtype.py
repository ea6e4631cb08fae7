"""The default dtype: float32 on a CPU without bf16 instructions, bfloat16 elsewhere, the env variable first."""

from __future__ import annotations

import logging

import pytest

from evaldag.engines import dtype as dtypemod
from evaldag.engines.dtype import DEFAULT_DTYPE_ENV, cpuinfo_has_bf16, default_dtype, slow_dtype_hint
from evaldag.errors import ConfigError

# The first lines of this project's 2-core box (AVX-512, no bf16) and of a Sapphire Rapids host with AMX.
NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni avx512vl\n"
WITH_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


@pytest.fixture
def host(monkeypatch):
    """Pretend a host: (has an accelerator, its CPU computes bf16)."""
    monkeypatch.delenv(DEFAULT_DTYPE_ENV, raising=False)

    def set_host(accelerator: bool, bf16: bool) -> None:
        monkeypatch.setattr(dtypemod, "has_accelerator", lambda: accelerator)
        monkeypatch.setattr(dtypemod, "cpu_has_bf16", lambda: bf16)
    return set_host


def test_cpuinfo_flags_decide_bf16():
    assert not cpuinfo_has_bf16(NO_BF16)
    assert cpuinfo_has_bf16(WITH_AMX)
    assert cpuinfo_has_bf16("processor\t: 0\n")          # no flags line: no reason to leave the usual default


@pytest.mark.parametrize(("accelerator", "bf16", "expected"), [
    (False, False, "float32"), (False, True, "bfloat16"), (True, False, "bfloat16"), (True, True, "bfloat16")])
def test_default_follows_the_host(host, accelerator, bf16, expected):
    host(accelerator, bf16)
    assert default_dtype() == expected


def test_the_environment_wins_and_is_checked(host, monkeypatch):
    host(False, False)
    monkeypatch.setenv(DEFAULT_DTYPE_ENV, "bfloat16")
    assert default_dtype() == "bfloat16"
    monkeypatch.setenv(DEFAULT_DTYPE_ENV, "bf16")
    with pytest.raises(ConfigError, match="EVALDAG_DEFAULT_DTYPE='bf16' is not a dtype; use one of bfloat16"):
        default_dtype()


def test_hint_only_for_bf16_on_a_cpu_without_it(host):
    host(False, False)
    assert "set `dtype: float32`" in slow_dtype_hint("bfloat16", on_cpu=True)
    assert slow_dtype_hint("float32", on_cpu=True) is None
    assert slow_dtype_hint("bfloat16", on_cpu=False) is None
    host(False, True)
    assert slow_dtype_hint("bfloat16", on_cpu=True) is None


def test_load_engine_logs_the_hint(host, monkeypatch, caplog):
    """The hint reaches the shard's log where the engine is loaded (the engine itself is not built here)."""
    import evaldag.engines as engines

    host(False, False)
    monkeypatch.setattr(engines, "has_accelerator", lambda: False)
    monkeypatch.setattr(engines, "slow_dtype_hint", dtypemod.slow_dtype_hint)

    class Probe:
        def __init__(self, model_path: str, dtype: str, batch_size: int) -> None:
            self.dtype = dtype

    monkeypatch.setattr(engines.importlib, "import_module", lambda name: type("M", (), {"HFEngine": Probe}))
    with caplog.at_level(logging.WARNING, logger="evaldag"):
        engines.load_engine("hf", "/ckpt", "bfloat16", 2)
    assert "/ckpt: dtype bfloat16 on a CPU without bf16 instructions" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="evaldag"):
        engines.load_engine("hf", "/ckpt", "float32", 2)
    assert caplog.text == ""

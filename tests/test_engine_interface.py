"""Every registered engine offers the whole Engine interface (a new method on the protocol must reach them all)."""

from __future__ import annotations

import importlib

import pytest

from evaldag.engines import _ENGINES
from evaldag.engines.base import Engine

METHODS = sorted(name for name in vars(Engine) if not name.startswith("_") and callable(getattr(Engine, name)))


@pytest.mark.parametrize("name", sorted(_ENGINES))
def test_engine_implements_the_interface(name):
    module, cls_name, _ = _ENGINES[name]
    cls = getattr(importlib.import_module(module), cls_name)
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    assert not missing, f"engine {name!r} ({cls_name}) lacks {missing}"
    assert "generate_batches" in METHODS


def test_modules_vllm_cannot_scan_are_hidden_while_it_starts_and_put_back():
    """vLLM probes every module global with hasattr; a global whose probe raises (werkzeug's LocalProxy outside an
    app context) must be out of sys.modules while the engine starts, and back after."""
    import sys
    import types

    from evaldag.engines.vllm_process import modules_hidden_from_vllm_scan

    class Raising:
        def __getattribute__(self, name):
            raise RuntimeError("Working outside of application context.")

    bad, good = types.ModuleType("evaldag_test_unscannable"), types.ModuleType("evaldag_test_scannable")
    bad.proxy, good.value = Raising(), 3
    sys.modules[bad.__name__], sys.modules[good.__name__] = bad, good
    try:
        with modules_hidden_from_vllm_scan():
            assert bad.__name__ not in sys.modules
            assert sys.modules[good.__name__] is good
        assert sys.modules[bad.__name__] is bad
    finally:
        sys.modules.pop(bad.__name__, None)
        sys.modules.pop(good.__name__, None)


@pytest.mark.parametrize("engine_args, expected", [({}, False), ({"trust_remote_code": True}, True)])
def test_the_tokenizer_is_always_told_whether_to_run_a_checkpoints_code(monkeypatch, engine_args, expected):
    """Left unset, transformers asks on stdin, under a 15 s SIGALRM, for a checkpoint with its own code; a worker has
    no stdin, so the shard failed with a ValueError instead of the engine_args' answer."""
    import transformers

    from evaldag import engines
    from evaldag.request.checkpoint import ResolvedModel
    from evaldag.request.config import SamplingConfig

    asked = []

    def from_pretrained(path, **kwargs):
        asked.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    engines._tokenizer.cache_clear()
    model = ResolvedModel(name="m", path="/nowhere", fingerprint="f", dtype="bfloat16", engine="vllm", batch_size=8,
                          engine_args=engine_args)
    with pytest.raises(RuntimeError, match="stop here"):
        engines.workload(model, ["1 + 1?"], SamplingConfig())
    assert asked == [{"trust_remote_code": expected}]

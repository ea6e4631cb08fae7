"""Context sizing and the kept engine: an engine is sized for the longest sequence its requests need, a kept engine
serves every later request that fits, and a keep_loaded block sized for all its evaluations loads once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from evaldag import engines
from evaldag.engines.vllm import fitted_max_model_len
from evaldag.errors import ConfigError
from evaldag.models import resolve_model


def _model(engine: str):
    return replace(resolve_model("smollm2-135m-instruct"), engine=engine)


@pytest.mark.parametrize("need, window, fit", [
    (1, 8192, 256), (256, 8192, 256), (257, 8192, 512), (1190, 8192, 1280),
    (8000, 8192, None),         # rounded up it would not be smaller than the window: vLLM's default
    (9000, 8192, None),         # longer than the window: cut at the window, as without sizing
    (1000, None, None),         # window unknown: vLLM decides
])
def test_fitted_max_model_len(need, window, fit):
    assert fitted_max_model_len(need, window) == fit


def test_fitted_max_model_len_refuses_nonsense():
    with pytest.raises(ValueError, match="context_tokens"):
        fitted_max_model_len(0, 8192)


def test_context_tokens_is_the_longest_formatted_prompt_plus_the_completion():
    from transformers import AutoTokenizer

    from evaldag.engines.base import chat_text

    model = _model("vllm")
    tok = AutoTokenizer.from_pretrained(model.path)
    prompts = ["Say OK.", "What is 2+3? " * 40]
    longest = len(tok(chat_text(tok, prompts[1]), add_special_tokens=False)["input_ids"])
    assert longest > 100
    assert engines.context_tokens(model, prompts, 512) == longest + 512
    assert engines.context_tokens(model, [], 512) is None
    # the transformers engine pads per batch: nothing to size
    assert engines.context_tokens(_model("hf"), prompts, 512) is None


def test_engine_args_may_not_set_what_evaldag_sets():
    with pytest.raises(ConfigError, match="context_tokens"):
        engines.load_engine("vllm", "/nowhere", "float32", 4, {"context_tokens": 10})


@dataclass
class _Recorder:
    """Stands in for load_engine: records each load's context (the real loads are counted in
    tests/engine_vllm/test_vllm_e2e.py)."""

    loads: list = field(default_factory=list)
    closed: int = 0

    def __call__(self, name, path, dtype, batch_size, engine_args, context_tokens=None):
        self.loads.append(context_tokens)
        recorder = self

        class _Engine:
            def close(self):
                recorder.closed += 1
        return _Engine()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(engines, "load_engine", rec)
    return rec


def test_a_kept_engine_serves_what_fits_and_reloads_for_what_does_not(recorder):
    model = _model("vllm")
    with engines.keep_loaded():
        with engines.engine_for(model, 1000) as a:
            assert a.loaded
        with engines.engine_for(model, 800) as b:
            assert not b.loaded and b.engine is a.engine
        with engines.engine_for(model, 1500) as c:        # longer than it was sized for: a new load
            assert c.loaded
        assert recorder.closed == 1
    assert recorder.loads == [1000, 1500] and recorder.closed == 2


def test_a_block_sized_for_all_its_evaluations_loads_once(recorder):
    model = _model("vllm")
    with engines.keep_loaded(1500):
        for need in (1000, 1500, 700):
            with engines.engine_for(model, need):
                pass
    assert recorder.loads == [1500] and recorder.closed == 1


def test_outside_a_block_each_engine_is_closed_after_use(recorder):
    model = _model("vllm")
    for need in (1000, 1000):
        with engines.engine_for(model, need) as got:
            assert got.loaded
    assert recorder.loads == [1000, 1000] and recorder.closed == 2

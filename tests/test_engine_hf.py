"""The transformers engine on the real default model: token counts, finish reasons, order, seeded sampling; and its
argument checks, which refuse bad input before any model loads (no `model` mark)."""

from __future__ import annotations

import pytest

from evaldag.config import SamplingConfig
from evaldag.engines import load_engine
from evaldag.errors import ConfigError
from evaldag.models import resolve_model


@pytest.fixture(scope="module")
def engine():
    model = resolve_model("smollm2-135m-instruct")
    eng = load_engine("hf", model.path, "bfloat16", batch_size=2)
    yield eng
    eng.close()


PROMPTS = ["What is 2+3? Put the final answer in \\boxed{}.",
           "Write a very long essay about the history of mathematics, with many details.",
           "Say OK."]


@pytest.mark.model
def test_greedy_shapes_order_and_finish_reasons(engine):
    out = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=12))
    assert [len(c) for c in out] == [1, 1, 1]
    comps = [c[0] for c in out]
    assert all(0 < c.completion_tokens <= 12 for c in comps)
    assert comps[1].finish_reason == "length" and comps[1].completion_tokens == 12     # the essay cannot fit
    assert all(c.finish_reason in ("stop", "length") for c in comps)
    assert all(c.text.strip() for c in comps)
    assert comps[0].prompt_tokens > 10
    # batch of 2 over 3 prompts: batches are formed by length, results come back in input order
    again = engine.generate(list(reversed(PROMPTS)), SamplingConfig(max_new_tokens=12))
    assert [c[0].text for c in reversed(again)] == [c.text for c in comps]


@pytest.mark.model
def test_sampling_n_is_seeded(engine):
    s = SamplingConfig(n=3, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=7)
    a = engine.generate(PROMPTS[:1], s)
    b = engine.generate(PROMPTS[:1], s)
    assert len(a[0]) == 3
    assert [c.text for c in a[0]] == [c.text for c in b[0]]
    other = engine.generate(PROMPTS[:1], s.model_copy(update={"seed": 8}))
    assert [c.text for c in other[0]] != [c.text for c in a[0]]


def test_unknown_engine_is_named():
    with pytest.raises(ConfigError, match="unknown engine 'vllm2'"):
        load_engine("vllm2", "/x", "bfloat16", 1)


def test_unknown_engine_arg_is_named():
    # checked against the engine's constructor before the model loads
    with pytest.raises(ConfigError, match=r"engine 'hf' does not take engine_args \['tensor_parallel_size'\]; "
                                          r"allowed: cache_implementation"):
        load_engine("hf", "/x", "bfloat16", 1, {"tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="engine_args must be a mapping"):
        load_engine("hf", "/x", "bfloat16", 1, ["tensor_parallel_size"])

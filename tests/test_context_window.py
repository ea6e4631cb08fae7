"""Prompt + max_new_tokens against the model's context window (evaldag.engines.context): a shard that does not fit
is refused before its first generated token, with the same message whichever engine runs it. The openai engine's
side (window and token counts from the server) is in test_openai_engine_args.py, vLLM's in
tests/engine_vllm/test_vllm_context_window.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import complete_checkpoint

from evaldag import engines
from evaldag.engines.base import Completion, EngineBase
from evaldag.errors import ConfigError
from evaldag.request.plan import EvalRequest, resolve
from evaldag.pipeline.generate import generate_shard


def test_the_check_names_the_benchmark_the_count_the_longest_the_window_and_the_fix():
    from evaldag.engines.context import ContextOverflowError, PromptFit, check_fits

    fit = PromptFit(window=64, source="max_position_embeddings in the model's config.json",
                    prompt_tokens=[10, 50, 40, 49])
    check_fits("gsm8k", "hf", fit, 14)                  # 50 + 14 = 64: the longest fits exactly
    with pytest.raises(ContextOverflowError) as err:
        check_fits("gsm8k", "hf", fit, 16)
    text = str(err.value)
    assert isinstance(err.value, ConfigError)          # a permanent error: no task retry
    assert text.startswith("gsm8k: 2 of 4 prompts do not fit the context window with max_new_tokens 16 (engine hf, "
                           "window 64 tokens: max_position_embeddings in the model's config.json)"), text
    assert "the longest prompt has 50 tokens, and 50 + 16 = 66 > 64" in text
    assert "Nothing was generated" in text
    assert "Lower sampling.max_new_tokens to at most 14" in text and "a model with a longer window" in text
    # the prompt alone fills the window: no cap fits, and the message does not suggest one
    with pytest.raises(ContextOverflowError, match="1 of 1 prompts.*longest prompt alone fills the window") as err:
        check_fits("aime24", "openai", PromptFit(64, "the server's max_model_len", [64]), 1)
    assert "at most" not in str(err.value) and "--max-model-len" in str(err.value)
    check_fits("gsm8k", "hf", None, 10**6)              # an engine that cannot measure: nothing to check


class WindowedEngine(EngineBase):
    """A stand-in engine with a context window of `window` tokens, a prompt's length in tokens being its length in
    characters; counts the batches it generates."""

    window = 0
    generated = 0

    def prompt_fit(self, prompts):
        from evaldag.engines.context import PromptFit

        return PromptFit(type(self).window, "the stand-in's window", [len(p) for p in prompts])

    def plan_batches(self, prompts, sampling):
        return [[i] for i in range(len(prompts))]

    def generate_batch(self, prompts, sampling, batch_index):
        type(self).generated += 1
        return [[Completion(text="1", token_ids=[1], prompt_tokens=len(p), completion_tokens=1,
                            finish_reason="stop", latency_s=0.0, batch_size=1)] for p in prompts]

    def close(self):
        pass


def test_a_shard_that_overflows_the_window_generates_nothing(tmp_path, configs, monkeypatch):
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: WindowedEngine())
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(complete_checkpoint(tmp_path / "ckpt")), limit=3,
                               num_shards=3, sampling={"max_new_tokens": 32}), tmp_path / "results")
    lengths = sorted(len(p) for p in plan.shard_inputs(0)["prompt"].to_list()
                     + [p for s in (1, 2) for p in plan.shard_inputs(s)["prompt"].to_list()])
    assert lengths[-2] < lengths[-1]
    WindowedEngine.generated = 0
    # a window one token short for the longest prompt: only it overflows, and only one shard holds it
    WindowedEngine.window = lengths[-1] + 32 - 1
    over = next(s for s in range(3) if max(len(p) for p in plan.shard_inputs(s)["prompt"].to_list()) == lengths[-1])
    with pytest.raises(ConfigError) as err:
        generate_shard(plan, over)
    text = str(err.value)
    assert text.startswith("aime24: 1 of 3 prompts do not fit the context window with max_new_tokens 32"), text
    assert f"the longest prompt has {lengths[-1]} tokens" in text and "at most 31" in text
    assert WindowedEngine.generated == 0 and not plan.generations_path(over).exists()
    # the other shards fit and generate; a shard that overflows counts the prompts of the whole benchmark
    for s in set(range(3)) - {over}:
        generate_shard(plan, s)
    assert WindowedEngine.generated == 2
    WindowedEngine.window = lengths[0] + 32 - 1         # every prompt overflows now
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(tmp_path / "ckpt"), limit=3, num_shards=3,
                               sampling={"max_new_tokens": 32, "seed": 1}), tmp_path / "results")
    with pytest.raises(ConfigError, match="aime24: 3 of 3 prompts do not fit"):
        generate_shard(plan, 0)
    assert WindowedEngine.generated == 2


@pytest.mark.model
def test_the_transformers_engine_refuses_a_shard_past_max_position_embeddings(tmp_path, configs):
    """A real checkpoint whose config states a tiny window (128 positions): the hf engine measures it and the shard
    fails before generating, where transformers would otherwise run past the positions the model knows."""
    from evaldag.request.checkpoint import resolve_model

    source = resolve_model("smollm2-135m-instruct").path
    ckpt = tmp_path / "tiny-window"
    shutil.copytree(source, ckpt, ignore=shutil.ignore_patterns("*.safetensors"))
    for weights in Path(source).glob("*.safetensors"):
        (ckpt / weights.name).symlink_to(weights)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=2, num_shards=1, engine="hf",
                               sampling={"max_new_tokens": 96}), tmp_path / "results")
    with pytest.raises(ConfigError) as err:
        generate_shard(plan, 0)
    text = str(err.value)
    assert text.startswith("aime24: 2 of 2 prompts do not fit the context window with max_new_tokens 96 (engine hf, "
                           "window 128 tokens: max_position_embeddings in the model's config.json)"), text
    assert not plan.generations_path(0).exists()

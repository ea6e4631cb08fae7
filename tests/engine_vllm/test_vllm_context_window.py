"""The vLLM engine's context window on the real default model: what evaldag.engines.context checks before a shard
generates, and the silent cut it prevents. One small engine (max_model_len 128), one short generation."""

from __future__ import annotations

import pytest

from evaldag.request.config import SamplingConfig
from evaldag.engines import load_engine
from evaldag.engines.context import ContextOverflowError, check_fits
from evaldag.request.checkpoint import resolve_model

pytestmark = pytest.mark.model

PROMPTS = ["What is 2+3? Put the final answer in \\boxed{}.",
           "Write a very long essay about the history of mathematics, with many details.",
           ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")]


def test_a_window_too_short_for_the_cap_is_measured_before_generation():
    """vLLM stops a completion where its window ends and calls it an ordinary "length" finish, with fewer tokens
    than max_new_tokens (shown below): the engine's prompt_fit reports the window it loaded (here the user's
    max_model_len) and the prompts' lengths, so evaldag.engines.context refuses such a shard before generating."""
    eng = load_engine("vllm", resolve_model("smollm2-135m-instruct").path, "float32", 4, {"max_model_len": 128})
    try:
        fit = eng.prompt_fit(PROMPTS)
        assert (fit.window, fit.source) == (128, "engine_args.max_model_len")
        assert fit.prompt_tokens == [len(ids) for ids in eng._prompt_ids(PROMPTS)]
        room = 128 - max(fit.prompt_tokens)
        check_fits("unit", "vllm", fit, room)
        with pytest.raises(ContextOverflowError, match=rf"unit: 1 of {len(PROMPTS)} prompts do not fit.*at most "
                                                       rf"{room}.*raise engine_args.max_model_len"):
            check_fits("unit", "vllm", fit, room + 1)
        # what the check prevents: the longest prompt asked for 200 tokens is cut at the window, as "length"
        longest = PROMPTS[fit.prompt_tokens.index(max(fit.prompt_tokens))]
        [[c]] = eng.generate_batch(["Count from 1 to 500, separated by commas. " + longest],
                                   SamplingConfig(max_new_tokens=200), 0)
        assert c.finish_reason == "length" and c.prompt_tokens + c.completion_tokens == 128
    finally:
        eng.close()

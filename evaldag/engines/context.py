"""Prompt + max_new_tokens against the model's context window, checked before any generation, for every engine.

A sequence is its prompt and its completion, and an engine holds at most its window of them: vLLM's max_model_len
(from the model config or engine_args), transformers' max_position_embeddings, a server's max_model_len. Where a
prompt + max_new_tokens does not fit, the engines disagree without this check: vLLM stops the completion where the
window ends and reports an ordinary "length" finish (graded `truncated`, with fewer tokens than asked, silently),
transformers runs past the positions the model was trained on, and a vLLM server cuts or refuses the request
mid-shard. So every engine measures what the shard's prompts take (`prompt_fit`), and evaldag.pipeline.shard_runs
refuses the shard with ContextOverflowError before its first generated token: one behaviour for all engines, and a
message that names the benchmark, how many prompts overflow, the longest, the window and the fix.

No status of its own: a row cut by the window would measure the window rather than the model, and mixing such rows
into accuracy (as `truncated` or as a new status) would quietly change what a benchmark's number means between
models with different windows; the run is refused instead, and the user picks a cap that fits.

Where an engine cannot measure (a server that offers no tokenizer endpoint or reports no window, a model config
without max_position_embeddings), `prompt_fit` returns None and the check is skipped; the openai engine still
refuses a completion that the server cut at its context, per request (evaldag.engines.openai).
"""

from __future__ import annotations

from dataclasses import dataclass

from evaldag.errors import ConfigError


class ContextOverflowError(ConfigError):
    """Some prompts + max_new_tokens do not fit the model's context window (the message says which and the fix)."""


@dataclass(frozen=True)
class PromptFit:
    """What a set of prompts takes of an engine's window."""

    window: int                 # tokens one sequence may hold, prompt + completion
    source: str                 # where the window comes from, for the error message
    prompt_tokens: list[int]    # chat-formatted prompt length of each prompt, in tokens, in input order

    def overflowing(self, max_new_tokens: int) -> list[int]:
        """Indexes of the prompts whose prompt + `max_new_tokens` exceed the window."""
        return [i for i, n in enumerate(self.prompt_tokens) if n + max_new_tokens > self.window]


def overflow_error(benchmark: str, engine: str, fit: PromptFit, max_new_tokens: int) -> ContextOverflowError:
    """The error for prompts of `fit` that overflow the window with `max_new_tokens`: how many, the longest, the
    window and what to change."""
    over = fit.overflowing(max_new_tokens)
    longest = max(fit.prompt_tokens)
    room = fit.window - longest
    head = (f"{benchmark}: {len(over)} of {len(fit.prompt_tokens)} prompts do not fit the context window with "
            f"max_new_tokens {max_new_tokens} (engine {engine}, window {fit.window} tokens: {fit.source}); the "
            f"longest prompt has {longest} tokens, and {longest} + {max_new_tokens} = {longest + max_new_tokens} > "
            f"{fit.window}. Nothing was generated: a completion cut by the window would pass for an ordinary "
            f"truncation. ")
    if room >= 1:
        fix = (f"Lower sampling.max_new_tokens to at most {room} (e.g. -p 'sampling={{\"max_new_tokens\": {room}}}' "
               f"or --max-new-tokens {room}), or evaluate a model with a longer window")
    else:
        fix = ("The longest prompt alone fills the window, so no max_new_tokens fits: evaluate a model with a longer "
               "window, or fewer problems (limit)")
    if engine == "openai":
        fix += " (or restart the server with a longer context: vllm serve --max-model-len, if the model supports it)"
    elif "engine_args.max_model_len" in fit.source:
        fix += " (or raise engine_args.max_model_len, up to the model's own window)"
    return ContextOverflowError(head + fix + ".")


def check_fits(benchmark: str, engine: str, fit: PromptFit | None, max_new_tokens: int) -> None:
    """Raise ContextOverflowError when a prompt of `fit` + `max_new_tokens` exceeds its window; None: the engine
    cannot tell, nothing to check."""
    if fit is not None and fit.prompt_tokens and fit.overflowing(max_new_tokens):
        raise overflow_error(benchmark, engine, fit, max_new_tokens)


def config_window(config) -> int | None:
    """The context window a Hugging Face model config states (max_position_embeddings of its text config), or None."""
    text = getattr(config, "get_text_config", lambda: config)()
    window = getattr(text, "max_position_embeddings", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


__all__ = ["ContextOverflowError", "PromptFit", "check_fits", "config_window", "overflow_error"]

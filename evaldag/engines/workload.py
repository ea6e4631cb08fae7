"""What an engine is loaded to serve, for engines that size themselves to it (vLLM).

A Workload says three things about the requests an engine will get: the longest sequence (chat-formatted prompt +
max_new_tokens), how many sequences one generate call holds at most (prompts x n), and whether every request is
greedy. vLLM turns them into its context window, its CPU KV cache and n-gram speculation (evaldag.engines.vllm,
`fit_to_workload`). None of them decides a result: every request still fits, and speculation is only used where it
is lossless (greedy); the generation key ignores the workload.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """The requests an engine is loaded for (see the module doc)."""

    context_tokens: int     # the longest sequence, prompt + completion, in tokens
    sequences: int          # sequences in one generate call at most (prompts x samples per prompt)
    greedy: bool            # every request greedy (temperature 0)

    def __post_init__(self) -> None:
        if self.context_tokens < 1 or self.sequences < 1:
            raise ValueError(f"a workload needs context_tokens >= 1 and sequences >= 1, got {self}")

    def covering(self, other: Workload | None) -> Workload:
        """The smallest workload that serves both this one and `other` (one engine load for both)."""
        if other is None:
            return self
        return Workload(max(self.context_tokens, other.context_tokens), max(self.sequences, other.sequences),
                        self.greedy and other.greedy)

    def served_by(self, loaded: Workload | None) -> bool:
        """Whether an engine loaded for `loaded` serves this workload as well as a fresh load would: long enough,
        room for as many sequences, and no speculation under sampled requests (it would change their samples).
        None: loaded for anything (the model's whole window, the default cache, no speculation)."""
        if loaded is None:
            return True
        return (self.context_tokens <= loaded.context_tokens and self.sequences <= loaded.sequences
                and (self.greedy or not loaded.greedy))


__all__ = ["Workload"]

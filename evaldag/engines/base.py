"""The engine interface: chat prompts in, completions with token counts, finish reason and latency out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from evaldag.config import SamplingConfig


@dataclass(frozen=True)
class Completion:
    """One generated completion."""

    text: str
    token_ids: list[int]        # generated ids, end-of-sequence included
    prompt_tokens: int
    completion_tokens: int      # up to and including the end-of-sequence token
    finish_reason: str          # "stop" or "length"
    latency_s: float            # wall time of the batch that produced it
    batch_size: int             # prompts in that batch


# progress callback: (prompts done, prompts total, tokens generated so far, seconds so far)
Progress = Callable[[int, int, int, float], None]


class Engine(Protocol):
    """What every engine offers; `generate` returns, per prompt, `sampling.n` completions in input order."""

    def plan_batches(self, prompts: list[str], sampling: SamplingConfig) -> list[list[int]]:
        """The deterministic batches `generate` would use (indexes into `prompts`)."""
        ...

    def generate_batch(self, prompts: list[str], sampling: SamplingConfig,
                       batch_index: int) -> list[list[Completion]]:
        """One batch of the plan, seeded by its index (so a re-run batch repeats itself)."""
        ...

    def generate(self, prompts: list[str], sampling: SamplingConfig,
                 progress: Progress | None = None) -> list[list[Completion]]: ...

    def score(self, prompts: list[str], completion_ids: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities (temperature 1) of each completion's ids after its prompt."""
        ...

    def close(self) -> None: ...

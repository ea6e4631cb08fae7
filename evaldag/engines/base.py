"""The engine interface: chat prompts in, completions with token counts, finish reason and latency out."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

from evaldag.request.config import SamplingConfig


@dataclass(frozen=True)
class Completion:
    """One generated completion."""

    text: str
    token_ids: list[int]        # generated ids, end-of-sequence included
    prompt_tokens: int
    completion_tokens: int      # up to and including the end-of-sequence token
    finish_reason: str          # "stop" or "length"
    latency_s: float            # wall time of its own request (vLLM, a server); of its batch (transformers)
    batch_size: int             # prompts in its batch; requests generated together (Engine.generate_requests)


@dataclass(frozen=True)
class Request:
    """One prompt to generate `n` (default `sampling.n`) completions for, under a seed of its own (`request_seed`),
    so that its completions depend neither on its batch nor on what else runs beside it or what was resumed."""

    key: Hashable               # the caller's name for it, handed back in Finished
    prompt: str
    seed: int
    n: int | None = None        # completions to generate; None: sampling.n


@dataclass(frozen=True)
class Finished:
    """A request whose completions are all done (in sample order)."""

    key: Hashable
    completions: list[Completion]


@dataclass(frozen=True)
class Running:
    """Tokens generated so far by the requests still running (not yet Finished), as the engine reports them (None
    where it cannot say); an engine yields one every few seconds while requests run, so its consumer also hears
    the time pass while none finishes."""

    tokens: int | None
    # each running sequence's tokens so far (an n-sample request has n sequences; None where the engine cannot
    # say): what evaldag.pipeline.time_left forecasts the end from
    counts: tuple[int, ...] | None = None
    # sequences handed to the engine that it has not started (its own queue, behind its running set: vLLM runs at
    # most max_num_seqs at once); None where the engine cannot say
    queued: int | None = None


Event = Finished | Running          # what Engine.generate_requests yields


class Engine(Protocol):
    """What every engine offers; `generate` returns, per prompt, `sampling.n` completions in input order.

    The real engines also offer `prompt_fit(prompts) -> PromptFit | None`: their context window and each prompt's
    length in tokens, with which evaldag.pipeline.shard_runs refuses a shard whose prompt + max_new_tokens do not fit
    before any generation (evaldag.engines.context). It stays out of the protocol so that a stand-in engine needs no
    window."""

    def plan_batches(self, prompts: list[str], sampling: SamplingConfig) -> list[list[int]]:
        """The deterministic batches `generate` would use (indexes into `prompts`)."""
        ...

    def generate_batch(self, prompts: list[str], sampling: SamplingConfig,
                       batch_index: int) -> list[list[Completion]]:
        """One batch of the plan, seeded by its index (so a re-run batch repeats itself)."""
        ...

    def generate_batches(self, batches: list[tuple[int, list[str]]],
                         sampling: SamplingConfig) -> Iterator[tuple[int, list[list[Completion]]]]:
        """Several batches of the plan, (batch index, prompts) each; yields (batch index, completions) as each
        batch completes. Same completions as generate_batch per batch; an engine that batches continuously (vLLM)
        keeps its scheduler full across batch boundaries instead of draining it at the end of every batch."""
        ...

    def generate(self, prompts: list[str], sampling: SamplingConfig) -> list[list[Completion]]: ...

    # An engine that batches continuously (vLLM) also offers
    #   generate_requests(requests: list[Request], sampling) -> Iterator[Event]
    # every request in the engine at once, a Finished as each one finishes and a Running now and then, and
    # evaldag.pipeline.shard_runs then writes and reports per request instead of per batch. It stays out of the
    # protocol: a static-batch engine has nothing finer than its batch to report.

    def score(self, prompts: list[str], completion_ids: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities (temperature 1) of each completion's ids after its prompt."""
        ...

    def close(self) -> None: ...


def request_seed(seed: int, sample_id: str) -> int:
    """The sampler seed of one problem's request: a hash of (evaluation seed, sample id), so it does not depend on
    the batch, shard or chunk the request falls in, and nearby seeds give unrelated streams. vLLM gives the k-th of
    the request's n samples a seed of its own derived from it, so each (sample_id, sample_index) is seeded alone."""
    digest = hashlib.sha256(f"{seed}:request:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1      # vLLM wants a non-negative int64


def chat_text(tokenizer, prompt: str) -> str:
    """The user message as the model's chat template renders it (the prompt itself for a model without one)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def batches_by_length(lengths: list[int], batch_size: int, n: int) -> list[list[int]]:
    """Deterministic batches (indexes into the prompts): sorted by token length, `batch_size` sequences each.

    batch_size counts sequences: with n samples per prompt, a batch holds batch_size // n prompts. Every engine
    cuts a shard this way, so batches (and their seeds) mean the same whichever engine runs them."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    per_batch = max(1, batch_size // n)
    return [order[lo:lo + per_batch] for lo in range(0, len(order), per_batch)]


def batches_one_by_one(engine: Engine, batches: list[tuple[int, list[str]]],
                       sampling: SamplingConfig) -> Iterator[tuple[int, list[list[Completion]]]]:
    """`Engine.generate_batches` for an engine with static batches (transformers): one generate_batch each."""
    for b, prompts in batches:
        yield b, engine.generate_batch(prompts, sampling, b)


class EngineBase:
    """What the engines share: `generate` runs the plan's batches (generate_in_batches); `generate_batches` runs
    one generate_batch after another, an engine with static batches (transformers, a server's requests). vLLM
    overrides it to keep every batch in its scheduler at once."""

    def generate_batches(self, batches: list[tuple[int, list[str]]],
                         sampling: SamplingConfig) -> Iterator[tuple[int, list[list[Completion]]]]:
        """Static batching: one batch after another (see Engine.generate_batches)."""
        return batches_one_by_one(self, batches, sampling)

    def generate(self, prompts: list[str], sampling: SamplingConfig) -> list[list[Completion]]:
        """Generate `sampling.n` completions per prompt; results come back in the order of `prompts`."""
        return generate_in_batches(self, prompts, sampling)


def generate_in_batches(engine: Engine, prompts: list[str], sampling: SamplingConfig) -> list[list[Completion]]:
    """`Engine.generate` for any engine: its plan's batches one after another, results in the order of `prompts`
    (a shard's progress is evaldag.pipeline.shard_runs', per request)."""
    results: list[list[Completion] | None] = [None] * len(prompts)
    plan = engine.plan_batches(prompts, sampling)
    for b, batch in engine.generate_batches([(b, [prompts[i] for i in idx]) for b, idx in enumerate(plan)], sampling):
        idx = plan[b]
        for i, comps in zip(idx, batch):
            results[i] = comps
    return results  # type: ignore[return-value]

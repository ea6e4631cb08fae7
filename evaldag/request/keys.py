"""Which settings decide an evaluation's result: the one list of those that do not, and the filter that applies it.

Every key that says "the same evaluation" is derived from the *resolved* settings (the model's dtype as
EVALDAG_DEFAULT_DTYPE or the host resolves it, the engine as EVALDAG_DEFAULT_ENGINE resolves it, the benchmark
config as it is on disk, the checkpoint's fingerprint) minus NOT_RESULT_SETTINGS: the plan's generation key
(evaldag.request.plan: the engine_args in it), and the trigger keys (evaldag.events.identity: settings_key, evaluation_id,
evaluated_key). A setting is result-changing unless it is listed here, so a new setting costs at worst a
recomputation, never a wrong cache hit. Each entry says why it does not change results; tests/test_keys.py changes
each entry and checks that the keys stay.

Paths are dotted: `request.<EvalRequest field or flow parameter>`, `benchmark.<BenchmarkConfig field>`,
`model.<dtype|engine|batch_size|engine_args|fingerprint>`, `model.engine_args.<engine argument>`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

NOT_RESULT_SETTINGS: dict[str, str] = {
    # ---- the request: where the result goes and how the shards are dispatched
    "request.mlflow_parent_run_id": "where the training job's curves are logged; nothing is computed differently",
    "request.dispatch": "shards as flow runs on the gpu pool or inline in the parent: the same stages on the same "
                        "plan",
    "request.baseline": "which evaluation this one's paired verdict is computed against, after the results exist; "
                        "no stage reads it",
    "request.final_step": "the job's planned last step, where its accuracy is forecast from the curve of results "
                          "already computed; no stage reads it",
    # ---- the benchmark config
    "benchmark.description": "free text for people; no stage reads it",
    # ---- vLLM engine_args that size memory and scheduling. vLLM schedules the sequences of one batch freely
    # already, and evaldag fits its KV cache and window to each shard without keying them (engines/vllm.py,
    # fit_to_workload); these move only that scheduling, never what a sequence is conditioned on or sampled with.
    "model.engine_args.gpu_memory_utilization": "share of GPU memory vLLM takes (room for KV cache): throughput",
    "model.engine_args.max_num_seqs": "how many sequences of a batch run at once: throughput",
    "model.engine_args.max_num_batched_tokens": "tokens per scheduler step (prefill chunking): throughput",
    "model.engine_args.kv_cache_space_gb": "KV cache size: how many sequences fit at once, throughput",
    "model.engine_args.cpu_offload_gb": "where weights wait between uses (CPU memory); the same weights compute",
    "model.engine_args.distributed_executor_backend": "which process launcher (mp, ray) runs the same workers",
    # Parallelism: the same weights and sampling spread over more GPUs. Like a batch's composition (which is keyed:
    # the shards), the order of a sum across GPUs can move a near-tied greedy token; unlike it, an evaluation rerun
    # on other GPUs is taken to be the same evaluation (issue 52: parallelism is not part of its identity), so that
    # a job's checkpoints stay comparable and cached when the cluster's layout changes.
    "model.engine_args.tensor_parallel_size": "GPUs one model is split over (tensor parallelism): speed and memory",
    "model.engine_args.pipeline_parallel_size": "GPUs one model's layers are spread over (pipeline stages): speed "
                                                "and memory",
    # ---- openai engine_args: how requests reach the server (which server and model: base_url, model, and the
    # fingerprint, stay in the key)
    "model.engine_args.concurrency": "requests in flight at once: throughput; each request is seeded on its own",
    "model.engine_args.max_retries": "how often a transient failure is retried; a request that still fails fails "
                                     "the shard, it is not recorded as a different completion",
    "model.engine_args.timeout_s": "how long one request may take before it counts as a transient failure (same "
                                   "as max_retries)",
    "model.engine_args.api_key_env": "which variable holds the credentials; the server answers the same",
}


def _without(settings: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in settings.items():
        path = f"{prefix}{name}"
        if path in NOT_RESULT_SETTINGS:
            continue
        out[name] = _without(value, f"{path}.") if isinstance(value, Mapping) else value
    return out


def result_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` (the nested resolved settings: `{"request": ..., "benchmark": ..., "model": ...}`, or any part
    of that tree) without the entries of NOT_RESULT_SETTINGS."""
    return _without(settings, "")


def result_engine_args(engine_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """A model's engine_args without those that do not change results (the `model.engine_args.*` entries)."""
    return _without(dict(engine_args or {}), "model.engine_args.")


def settings_digest(settings: Mapping[str, Any]) -> str:
    """16 hex digits over the canonical JSON of `result_settings(settings)`."""
    blob = json.dumps(result_settings(settings), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


__all__ = ["NOT_RESULT_SETTINGS", "result_engine_args", "result_settings", "settings_digest"]

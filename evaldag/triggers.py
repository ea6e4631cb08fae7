"""What a "checkpoint saved" event or a sweep turns into: which evaluations to start, under which identity.

Pure functions: the Prefect flows in flows/checkpoint_flow.py and flows/sweeper_flow.py call them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evaldag.config import available
from evaldag.errors import ConfigError


def requested_benchmarks(event_benchmarks: list[str] | None, default: list[str]) -> list[str]:
    """The benchmarks an event asks for (or the configured default set), each checked against configs/."""
    wanted = list(dict.fromkeys(event_benchmarks or default))
    if not wanted:
        raise ConfigError("no benchmark to run: the event names none and the deployment's default_benchmarks is "
                          "empty")
    known = set(available("benchmarks"))
    unknown = [b for b in wanted if b not in known]
    if unknown:
        raise ConfigError(f"unknown benchmarks {unknown} in the event; available: {', '.join(sorted(known))}")
    return wanted


# What an evaluation request is made of (evaldag.plan.EvalRequest's fields, and the eval flow's parameters):
# - IDENTITY: which checkpoint on which benchmark, and where it belongs (part of every key below);
# - OUTPUT_SETTINGS: settings that change the result: a slice (limit), sampling, pass@k's ks, the KL reference,
#   the engine, and the shard count (batch composition moves greedy outputs);
# - NOT_OUTPUT: where the result is logged and how the shards are dispatched; never part of a key.
IDENTITY = ("benchmark", "checkpoint", "step", "train_run")
OUTPUT_SETTINGS = ("limit", "num_shards", "sampling", "pass_k", "reference", "engine")
NOT_OUTPUT = ("mlflow_parent_run_id", "dispatch")


def output_settings(benchmark: str, overrides: Mapping[str, Any] | None,
                    default_sampling: Any = None) -> dict[str, Any]:
    """The settings among `overrides` that change an evaluation's result, in one canonical form: unset (None) ones
    dropped, sampling completed with the benchmark's defaults (`default_sampling`, else the benchmark config's now;
    so `{"temperature": 0}` on a greedy benchmark is the same request as no override), pass_k sorted and
    deduplicated. Overrides the config rejects are kept as given: the evaluation flow reports them, a key must not
    fail first."""
    out = {k: overrides[k] for k in OUTPUT_SETTINGS if overrides and overrides.get(k) is not None}
    if isinstance(out.get("pass_k"), list):
        try:
            out["pass_k"] = sorted(set(out["pass_k"]))
        except TypeError:
            pass
    try:
        from evaldag.config import load_benchmark, merge_sampling

        base = default_sampling if default_sampling is not None else load_benchmark(benchmark).sampling
        out["sampling"] = merge_sampling(base, out.get("sampling")).model_dump()
    except Exception:  # an unknown benchmark or invalid sampling: the flow names the problem
        pass
    return out


def settings_key(benchmark: str, overrides: Mapping[str, Any] | None, default_sampling: Any = None) -> str:
    """16 hex digits identifying the output settings of a request (see `output_settings`)."""
    blob = json.dumps(output_settings(benchmark, overrides, default_sampling), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def request_settings_key(request: Any, default_sampling: Any = None) -> str:
    """`settings_key` of an EvalRequest (what track() tags the MLflow run with, for the sweeper to find), with the
    benchmark's sampling defaults as resolved (`default_sampling`, the plan's benchmark config)."""
    return settings_key(request.benchmark, {k: getattr(request, k) for k in OUTPUT_SETTINGS}, default_sampling)


def evaluation_id(train_run: str, step: int, benchmark: str | Sequence[str], checkpoint: str | Path,
                  overrides: Mapping[str, Any] | None = None) -> str:
    """Identity of "this checkpoint on this benchmark (or these benchmarks, evaluated together) with these
    settings": the idempotency key of its evaluation flow run. The same event delivered twice (or by the trainer and
    the sweeper) starts one run; a request whose settings change the result (a full run after a quick `limit` slice,
    other sampling, a reference...) is another evaluation and starts its own."""
    names = [benchmark] if isinstance(benchmark, str) else list(benchmark)
    digest = hashlib.sha256(str(checkpoint).encode()).hexdigest()[:16]
    settings = "+".join(settings_key(name, overrides) for name in names)
    if len(names) > 1:
        settings = hashlib.sha256(settings.encode()).hexdigest()[:16]
    return f"evaldag-eval:{train_run}:{step}:{'+'.join(names)}:{digest}:{settings}"


def evaluated_key(checkpoint: str | Path, step: int, benchmark: str,
                  overrides: Mapping[str, Any] | None = None) -> tuple[str, int, str]:
    """What the sweeper looks up among the finished evaluations (evaldag.tracking.evaluated_checkpoints)."""
    return str(checkpoint), int(step), settings_key(benchmark, overrides)


def train_run_of(checkpoint: Path, root: Path) -> str:
    """The training job a discovered checkpoint belongs to: <root>/<run>/<ckpt> -> run, <root>/<ckpt> -> root name."""
    parent = checkpoint.parent
    return parent.name if parent != root else root.name

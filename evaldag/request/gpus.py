"""GPU bookkeeping without Prefect: which GPUs each gpu-pool worker gets, and how many GPUs a shard occupies.

The local stack (`evaldag up --gpus N --tp K`) starts N // K workers on the `gpu` pool, each pinned to K distinct
GPUs with CUDA_VISIBLE_DEVICES and running one shard at a time (`--limit 1`). On top of that, the Prefect global
concurrency limit GPU_LIMIT (limit N) counts GPUs across the whole pool: a shard holds `shard_gpus(model)` slots
of it while it generates (tasks/gpu_slots.py), so the pool never runs more GPU work than it has GPUs, and a shard
that needs more GPUs than the pool has fails at once instead of waiting forever.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from evaldag.errors import ConfigError

GPU_LIMIT = "evaldag-gpus"          # Prefect global concurrency limit: one slot per GPU of the `gpu` pool
TP_ARG = "tensor_parallel_size"     # engine_args key of the vllm engine: GPUs one model instance spans
TP_ENGINES = ("vllm",)              # engines that read TP_ARG; every other engine runs a shard on one GPU
SERVED_ENGINES = ("openai",)        # engines whose model runs on a server elsewhere: a shard holds no local GPU
# A lost shard (its node gone, kill -9) keeps its slots until their lease expires, and its relaunch waits that long
# for them. Prefect's default of 300 s would hold the relaunch back for minutes after the crash automation
# (evaldag.runtime.cluster, ~60-95 s) has released it; 60 s is the shortest lease Prefect's server accepts. The
# holder renews every 0.75 x the lease, so a live shard never loses its slots.
GPU_LEASE_S = 60.0


def parse_gpu_ids(text: str | None) -> tuple[str, ...] | None:
    """"0, 1,2" -> ("0", "1", "2"); None -> None (not set); "" -> () (set, and no GPU visible)."""
    if text is None:
        return None
    return tuple(g.strip() for g in text.split(",") if g.strip())


def assign_gpus(num_gpus: int, tp: int = 1, gpu_ids: Sequence[str] | None = None) -> list[tuple[str, ...] | None]:
    """The GPUs of each gpu-pool worker: num_gpus // tp workers, worker i gets ids [i*tp, (i+1)*tp).

    `gpu_ids` None means "no GPU ids to pin" (a CPU box, or GPUs not detected): every worker is a plain slot and
    its entry is None (the worker inherits the caller's CUDA_VISIBLE_DEVICES).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"--tp must be a whole number >= 1 (GPUs per worker), got {tp!r}")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 0:
        raise ConfigError(f"--gpus must be a whole number >= 0, got {num_gpus!r}")
    if num_gpus % tp:
        raise ConfigError(f"--gpus {num_gpus} is not a multiple of --tp {tp}: every gpu worker gets exactly {tp} "
                          f"GPUs, so --gpus must be a multiple of {tp} (e.g. {num_gpus + tp - num_gpus % tp})")
    workers = num_gpus // tp
    if gpu_ids is None:
        return [None] * workers
    ids = tuple(str(g) for g in gpu_ids)
    if len(ids) != num_gpus:
        raise ConfigError(f"GPU ids {list(ids)} name {len(ids)} GPUs, but --gpus is {num_gpus}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"GPU ids {list(ids)} name a GPU twice; every GPU goes to exactly one worker")
    return [ids[i * tp:(i + 1) * tp] for i in range(workers)]


def detect_gpu_ids(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The GPU ids this process may hand out: the caller's CUDA_VISIBLE_DEVICES when set, else "0".."n-1" for the
    n GPUs `nvidia-smi -L` lists. None when no NVIDIA GPU is visible (a CPU box): nothing to pin."""
    environ = os.environ if environ is None else environ
    visible = parse_gpu_ids(environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        return visible or None
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return tuple(str(i) for i in range(n)) or None


def shard_gpus(model: Any) -> int:
    """GPUs one shard of `model` (a ResolvedModel or its dict) occupies: engine_args["tensor_parallel_size"] for
    the vllm engine (default 1); 0 for a served model (the openai engine); 1 for every other engine, which loads a
    model on one device."""
    engine = model["engine"] if isinstance(model, Mapping) else model.engine
    args = (model.get("engine_args") if isinstance(model, Mapping) else model.engine_args) or {}
    if engine in SERVED_ENGINES:
        return 0
    if engine not in TP_ENGINES:
        return 1
    tp = args.get(TP_ARG, 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"engine_args.{TP_ARG} must be a whole number >= 1, got {tp!r}")
    return tp


def check_visible_gpus(tp: int, cuda_visible_devices: str | None) -> None:
    """Fail when this worker is pinned (CUDA_VISIBLE_DEVICES set) to fewer GPUs than a shard needs."""
    ids = parse_gpu_ids(cuda_visible_devices)
    if ids and len(ids) < tp:
        raise ConfigError(f"this shard needs {tp} GPUs ({TP_ARG}={tp}) but its worker sees {len(ids)} "
                          f"(CUDA_VISIBLE_DEVICES={cuda_visible_devices}); give each gpu worker {tp} GPUs, e.g. "
                          f"`evaldag up --gpus {max(tp, len(ids))} --tp {tp}`")


def check_fits(tp: int, limit: int, name: str = GPU_LIMIT) -> None:
    """Fail when a shard needs more GPUs than the pool has: it would otherwise wait for slots forever."""
    if tp > limit:
        raise ConfigError(f"this shard needs {tp} GPUs ({TP_ARG}={tp}) but the `gpu` pool has {limit} "
                          f"(concurrency limit {name!r} = {limit}); start the stack with `evaldag up --gpus "
                          f"{tp} --tp {tp}` (or more GPUs), raise the limit (`prefect gcl update {name} --limit "
                          f"{tp}`) on a cluster, or lower {TP_ARG}")

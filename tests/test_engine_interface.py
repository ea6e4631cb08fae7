"""Every registered engine offers the whole Engine interface (a new method on the protocol must reach them all)."""

from __future__ import annotations

import importlib

import pytest

from evaldag.engines import _ENGINES
from evaldag.engines.base import Engine

METHODS = sorted(name for name in vars(Engine) if not name.startswith("_") and callable(getattr(Engine, name)))


@pytest.mark.parametrize("name", sorted(_ENGINES))
def test_engine_implements_the_interface(name):
    module, cls_name, _ = _ENGINES[name]
    cls = getattr(importlib.import_module(module), cls_name)
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    assert not missing, f"engine {name!r} ({cls_name}) lacks {missing}"
    assert "generate_batches" in METHODS

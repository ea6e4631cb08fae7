"""Engines kept loaded across the shards of one process: one engine load per checkpoint per slot.

A shard flow run that works on several evaluations of the same checkpoint (the benchmarks of one checkpoint event,
see flows/shard_flow.py) opens `keep_loaded()`; every `engine_for(model)` inside it hands back the engine already
loaded for that model and its settings instead of loading it again. Outside such a block an engine lives for one
`engine_for` call, as before. One engine is kept at a time: a different model (or settings) closes the previous one
first, because two vLLM engines would split the GPU's (or the CPU's) KV cache memory.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

from evaldag import engines
from evaldag.engines.base import Engine


@dataclass
class Loaded:
    """An engine handed out by engine_for, and whether this call loaded it (False: reused)."""

    engine: Engine
    loaded: bool


_kept: dict[str, Engine] = {}
_depth = 0


def _key(model) -> str:
    return json.dumps([model.engine, model.path, model.dtype, model.batch_size, model.engine_args], sort_keys=True,
                      default=str)


def close_all() -> None:
    """Close every kept engine (its processes and memory go with it)."""
    while _kept:
        _, engine = _kept.popitem()
        engine.close()


@contextlib.contextmanager
def keep_loaded() -> Iterator[None]:
    """Keep engines loaded between engine_for calls until the outermost block ends."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            close_all()


@contextlib.contextmanager
def engine_for(model) -> Iterator[Loaded]:
    """The engine of `model` (a ResolvedModel): reused when kept loaded, else loaded now and closed after."""
    key = _key(model)
    if _depth and key in _kept:
        yield Loaded(_kept[key], loaded=False)
        return
    if _depth:
        close_all()
    engine = engines.load_engine(model.engine, model.path, model.dtype, model.batch_size, model.engine_args)
    if _depth:
        _kept[key] = engine
        yield Loaded(engine, loaded=True)
        return
    try:
        yield Loaded(engine, loaded=True)
    finally:
        engine.close()

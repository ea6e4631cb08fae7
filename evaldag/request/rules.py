"""The input rules every entry point shares: train run, benchmark name, step, limit, run id, checkpoint completeness.

Each rule is defined here once and used by the trainer client (evaldag/client/notifier.py), the event validator
(evaldag/events/checkpoint_event.py), the request and config models (evaldag/request/plan.py, evaldag/request/config.py), the datasets loader,
the on-checkpoint flow and the CLI. The trainer client imports this module inside training scripts, so it uses the
standard library only (tests/test_trainer.py checks that in a fresh interpreter): pydantic models take the patterns
and bounds below as `Field(pattern=..., ge=...)`, plain code calls the `check_*` functions.

A `check_*` function returns the value it accepted and raises `error` (ValueError unless the caller passes its own
class, such as evaldag.errors.CheckpointError) with a message that names the value and says what would be accepted.
`describe_errors` is the one formatter of pydantic validation errors.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from evaldag.request.layouts import why_not_hf

# A train run names a spool folder and a Prefect resource id, so it admits no path separators and no spaces.
TRAIN_RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
TRAIN_RUN_RULE = "letters, digits, '.', '_', '-'; at most 128 characters"


def train_run_name(name: str) -> str:
    """A folder's name as a train run name (TRAIN_RUN_PATTERN): other characters become '-' ("run 42" -> "run-42"),
    at most 128 characters, "default" when nothing is left."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:128].rstrip("-._")
    return cleaned or "default"
# A benchmark name is a config file stem (configs/benchmarks/<name>.yaml) and a deployment name (eval/<name>).
BENCHMARK_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
# An MLflow run id (32 hex digits from the server; other tracking back ends use other alphabets, hence the margin).
RUN_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MIN_STEP = 0                    # a training step (check_count's bound): the x axis of the MLflow metrics
MIN_LIMIT = 1                   # `limit`: evaluate only the first N problems

# What a complete Hugging Face-format checkpoint folder holds (the fingerprint hashes the same weight files).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_train_run(value: object, error: type[Exception] = ValueError) -> str:
    """`value` when it is a valid training-run name (TRAIN_RUN_PATTERN), else `error`."""
    if not isinstance(value, str) or not re.match(TRAIN_RUN_PATTERN, value):
        raise error(f"train_run must match {TRAIN_RUN_PATTERN} ({TRAIN_RUN_RULE}), got {value!r}")
    return value


def is_benchmark_name(value: object) -> bool:
    """Whether `value` has the form of a benchmark name (whether such a config exists is evaldag.request.config's job)."""
    return isinstance(value, str) and re.match(BENCHMARK_PATTERN, value) is not None


def is_benchmark_ref(value: object) -> bool:
    """Whether `value` names a benchmark: a config name (BENCHMARK_PATTERN) or a config file's absolute path
    (ending in .yaml or .yml; absolute, since the evaluation reads it in another process and folder)."""
    if is_benchmark_name(value):
        return True
    return isinstance(value, str) and value.lower().endswith((".yaml", ".yml")) and os.path.isabs(value)


def check_benchmark_ref(value: object, error: type[Exception] = ValueError) -> str:
    """`value` when it names a benchmark (is_benchmark_ref), else `error` saying what does."""
    if not is_benchmark_ref(value):
        raise error(f"benchmark {value!r} is neither a config name (such as math500: lower-case letters, digits, "
                    "- and _) nor a config file's absolute path ending in .yaml")
    return value


def check_benchmark_names(value: object, error: type[Exception] = ValueError) -> list[str]:
    """A non-empty list of benchmarks (config names or config files' absolute paths), else `error`."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
            or not all(is_benchmark_ref(b) for b in value):
        raise error(f"benchmarks must be a non-empty list of benchmark names such as ['math500', 'gsm8k'] or "
                    f"config files' absolute paths, or None for the deployment's default; got {value!r}")
    return list(value)


def check_count(name: str, value: object, error: type[Exception] = ValueError) -> int:
    """An int >= 0 (never a bool), else `error`: the rule of a step (MIN_STEP), an epoch, a retry count."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < MIN_STEP:
        raise error(f"{name} must be >= {MIN_STEP}, got {value}")
    return value


def check_step(value: object, name: str = "step", error: type[Exception] = ValueError) -> int:
    """A training step: an int >= MIN_STEP, else `error`."""
    return check_count(name, value, error)


def check_limit(value: object, name: str = "limit", error: type[Exception] = ValueError) -> int | None:
    """None (every problem) or an int >= MIN_LIMIT (never a bool), else `error`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer >= {MIN_LIMIT}, got {value!r}")
    if value < MIN_LIMIT:
        raise error(f"{name} must be >= {MIN_LIMIT} (got {value}); omit it to evaluate the whole benchmark")
    return value


def check_run_id(value: object, name: str = "mlflow_parent_run_id",
                 error: type[Exception] = ValueError) -> str | None:
    """None or a tracking run id (RUN_ID_PATTERN), else `error`."""
    if value is not None and (not isinstance(value, str) or not re.match(RUN_ID_PATTERN, value)):
        raise error(f"{name} must be None or a run id matching {RUN_ID_PATTERN} (such as MLflow's 32 hex digits), "
                    f"got {value!r}")
    return value


DECIDE_MODES = ("vs_best",)
DECIDE_FIELDS = ("alpha", "margin", "rounds")


def check_decide(value: object, error: type[Exception] = ValueError) -> dict | None:
    """A trainer's sequential-stopping request (evaldag.decisions.decide): None, "vs_best", or {"against": "vs_best", "alpha":
    0 < a < 1, "margin": 0 <= m < 1, "rounds": 1..1000} (each but `against` optional). Returns it as that dict
    (absent fields None), or raises `error` naming what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"against": value}
    if not isinstance(value, Mapping):
        raise error(f"decide must be 'vs_best' or a mapping with against/alpha/margin/rounds, got {value!r}")
    unknown = set(value) - {"against", *DECIDE_FIELDS}
    if unknown:
        raise error(f"decide has unknown keys {sorted(unknown)}; allowed: against, {', '.join(DECIDE_FIELDS)}")
    out = {"against": value.get("against", "vs_best"), **{k: value.get(k) for k in DECIDE_FIELDS}}
    if out["against"] not in DECIDE_MODES:
        raise error(f"decide.against must be one of {DECIDE_MODES}, got {out['against']!r}")
    checks = {"alpha": (lambda a: 0 < a < 1, "a number in (0, 1)"), "margin": (lambda m: 0 <= m < 1,
                                                                             "a number in [0, 1)"),
              "rounds": (lambda r: isinstance(r, int) and 1 <= r <= 1000, "an int in 1..1000")}
    for key, (ok, rule) in checks.items():
        v = out[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v)):
            raise error(f"decide.{key} must be {rule}, got {v!r}")
    return out


def decide_overrides(decide: Mapping | None) -> dict:
    """The evaluation parameters (decide, decide_alpha, ...) of a checked decide request (check_decide)."""
    if not decide:
        return {}
    out = {"decide": decide["against"]}
    out.update({f"decide_{k}": decide[k] for k in DECIDE_FIELDS if decide.get(k) is not None})
    return out


# Per-job settings a trainer may send (the server validates their values: evaldag.request.config.SamplingOverrides
# and EngineSettings, whose fields tests/test_job_settings.py checks against these names).
SAMPLING_KEYS: dict[str, tuple[type, ...]] = {"n": (int,), "temperature": (int, float), "top_p": (int, float),
                                              "max_new_tokens": (int,), "seed": (int,)}
ENGINE_SETTING_KEYS: dict[str, tuple[type, ...]] = {"tensor_parallel_size": (int,), "max_model_len": (int,),
                                                    "gpu_memory_utilization": (int, float), "dtype": (str,)}


def check_settings(name: str, value: object, allowed: Mapping[str, tuple[type, ...]],
                   error: type[Exception] = ValueError) -> dict | None:
    """None, or a mapping of per-job settings whose keys are among `allowed` and whose values have its types (never
    a bool for a number); returned as a plain dict without None values. Ranges are the server's to check."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise error(f"{name} must be a mapping such as {{{next(iter(allowed))!r}: ...}}, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise error(f"{name} has unknown keys {unknown}; allowed: {', '.join(allowed)}")
    out = {}
    for key, v in value.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, allowed[key]):
            raise error(f"{name}.{key}={v!r} must be {' or '.join(t.__name__ for t in allowed[key])}")
        out[key] = v
    return out or None


def check_checkpoint(folder: str | os.PathLike, error: type[Exception] = ValueError) -> Path:
    """`folder` as a Path when it is a complete Hugging Face-format checkpoint (config.json that parses, every
    weight file its index names, or a single weight file, non-empty, and a tokenizer), else `error` naming what is
    missing; for a training framework's folder without such a model (verl's shards, a DeepSpeed checkpoint), the
    setting or conversion that makes one (evaldag.request.layouts.why_not_hf)."""
    folder = Path(folder)
    try:
        return _check_hf_folder(folder, error)
    except error:
        why = why_not_hf(folder) if folder.is_dir() else None
        if why is None:
            raise
        raise error(why) from None


def _check_hf_folder(folder: Path, error: type[Exception]) -> Path:
    if not folder.exists():
        raise error(f"checkpoint folder {folder} does not exist")
    if not folder.is_dir():
        raise error(f"checkpoint {folder} is not a folder; pass a Hugging Face-format checkpoint folder "
                    "(config.json + weights + tokenizer) or a model alias")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise error(f"checkpoint {folder} has no config.json; is it a Hugging Face-format folder, "
                    "and has the trainer finished writing it?")
    try:
        json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"checkpoint {folder}: config.json is not valid JSON ({e}); "
                    "the checkpoint may be partially written") from None
    _check_weights(folder, error)
    if not any((folder / n).is_file() for n in TOKENIZER_FILES):
        raise error(f"checkpoint {folder} has no tokenizer (expected one of {TOKENIZER_FILES}); "
                    "save it with tokenizer.save_pretrained(folder)")
    return folder


def _check_weights(folder: Path, error: type[Exception]) -> None:
    index = next((folder / n for n in WEIGHT_INDEXES if (folder / n).is_file()), None)
    if index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise error(f"checkpoint {folder}: {index.name} is malformed ({e!r})") from None
        missing = [s for s in shards if not (folder / s).is_file() or (folder / s).stat().st_size == 0]
        if missing:
            raise error(f"checkpoint {folder}: {index.name} names weight files that are missing or empty: "
                        f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return
    weights = [folder / n for n in WEIGHT_FILES if (folder / n).is_file()]
    if not weights:
        raise error(f"checkpoint {folder} has no weights (expected one of {WEIGHT_FILES} or an index "
                    f"{WEIGHT_INDEXES})")
    if any(w.stat().st_size == 0 for w in weights):
        raise error(f"checkpoint {folder}: weight file {weights[0].name} is empty")


def describe_errors(errors: Iterable[Mapping[str, Any]], top: str = "(top level)", show_input: bool = True) -> str:
    """pydantic's `ValidationError.errors()` as one line: missing fields first, then each other problem as
    `field: message (got <type> <value>)`; a problem of the whole object (no field) is named `top` and shows no
    value, since the value is the whole input. `show_input=False` leaves every value out, for models that hold
    passwords."""
    errors = list(errors)
    missing = [_loc(e) for e in errors if e["type"] == "missing"]
    parts = [f"missing required field(s) {', '.join(repr(m) for m in missing)}"] if missing else []
    for e in errors:
        if e["type"] == "missing":
            continue
        loc = _loc(e)
        if not loc or not show_input:
            parts.append(f"{loc or top}: {e['msg']}")
            continue
        got = e.get("input")
        parts.append(f"{loc}: {e['msg']} (got {type(got).__name__} {got!r:.80})")
    return "; ".join(parts)


def _loc(error: Mapping[str, Any]) -> str:
    return ".".join(str(x) for x in error["loc"])


__all__ = ["TRAIN_RUN_PATTERN", "BENCHMARK_PATTERN", "RUN_ID_PATTERN", "MIN_STEP", "MIN_LIMIT", "WEIGHT_FILES",
           "WEIGHT_INDEXES", "TOKENIZER_FILES", "check_train_run", "is_benchmark_name", "is_benchmark_ref",
           "check_benchmark_ref", "check_benchmark_names", "check_count", "check_step", "check_limit", "check_run_id", "check_checkpoint", "describe_errors"]

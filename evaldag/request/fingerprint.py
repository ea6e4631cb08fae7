"""The identity of a checkpoint: a hash of exactly the files that decide what it generates, computed fast.

What is in it: the weights (the files the weight index names, or model.safetensors / pytorch_model.bin), the model
and generation configs, every tokenizer file, the chat template (inline in tokenizer_config.json, chat_template.jinja
or .json, additional_chat_templates/), and the modelling code a trust_remote_code checkpoint runs (*.py). Each file
is hashed whole: a fine-tune that changes one middle layer changes the fingerprint.

What is not: optimizer, scheduler, RNG and trainer state (optimizer.pt, trainer_state.json, global_step*/ ...),
READMEs, evaldag's own export note, and any absolute path. So a checkpoint whose weights did not change keeps its
fingerprint (and its cached generations), and the same checkpoint fingerprints the same on every machine.

Speed: file contents are hashed with xxHash's XXH3-128 (about 8 GB/s here, against 1 GB/s for sha256; an identity
check against accidental change, not a defence against a crafted collision), and each file's digest is cached in
`$EVALDAG_HOME/cache/file-hashes/` under the file's identity (path, device, inode, size, mtime_ns, ctime_ns): a
checkpoint fingerprinted once costs a few stat() calls the next time, and any write to a file (which moves its mtime
and ctime) makes it hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from evaldag import paths
from evaldag.request.rules import WEIGHT_FILES, WEIGHT_INDEXES  # the weight files a complete checkpoint holds

# Configs, tokenizer files and chat templates (top level of the folder). A file not listed here does not decide what
# the model generates with evaldag's engines.
GENERATION_FILES = frozenset({
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.jinja", "chat_template.json",
})
TEMPLATE_DIR = "additional_chat_templates"
HASH_NAME = "xxh3_128"
_BLOCK = 8 << 20


def identity_files(folder: Path) -> list[Path]:
    """The files of `folder` that decide what the checkpoint generates (see the module docstring), sorted."""
    chosen: set[Path] = set()
    index = next((folder / n for n in WEIGHT_INDEXES if (folder / n).is_file()), None)
    if index is not None:
        chosen.add(index)
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
            names = set()        # validate_checkpoint names the problem; the index's bytes are still hashed
        chosen.update(folder / n for n in names if (folder / n).is_file())
    else:
        chosen.update(folder / n for n in WEIGHT_FILES if (folder / n).is_file())
    for f in folder.iterdir():
        if f.is_file() and (f.name in GENERATION_FILES or f.name.endswith(".tiktoken")
                            or (f.suffix == ".py" and not f.name.startswith("."))):
            chosen.add(f)
    templates = folder / TEMPLATE_DIR
    if templates.is_dir():
        chosen.update(f for f in templates.rglob("*") if f.is_file() and not f.name.startswith("."))
    return sorted(chosen, key=lambda p: p.relative_to(folder).as_posix())


def _cache_dir() -> Path:
    return paths.home() / "cache" / "file-hashes"


def _identity(path: Path, st: os.stat_result) -> str:
    key = f"{HASH_NAME}\0{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0" \
          f"{st.st_ctime_ns}"
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def hash_file(path: Path) -> str:
    """XXH3-128 hex digest of a file's bytes (no cache)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def cached_file_hash(path: Path) -> str:
    """`hash_file(path)`, remembered under the file's identity so an unchanged file is read once."""
    st = path.stat()
    entry = _cache_dir() / _identity(path, st)
    try:
        return entry.read_text().strip()
    except OSError:
        pass
    digest = hash_file(path)
    after = path.stat()
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
        return digest            # written while we read it: correct for these bytes perhaps, but never cache it
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            fh.write(digest)
        os.replace(tmp, entry)    # atomic: a concurrent reader sees no entry or a whole one
    except OSError:               # a read-only or full home only costs speed
        pass
    return digest


def fingerprint(folder: str | os.PathLike) -> str:
    """sha256 over (relative name, size, content hash) of every identity file of the checkpoint folder."""
    folder = Path(folder)
    h = hashlib.sha256(f"evaldag-fingerprint/2 {HASH_NAME}\n".encode())
    for f in identity_files(folder):
        h.update(f"{f.relative_to(folder).as_posix()}\0{f.stat().st_size}\0{cached_file_hash(f)}\n".encode())
    return h.hexdigest()


__all__ = ["fingerprint", "identity_files", "cached_file_hash", "hash_file", "GENERATION_FILES"]

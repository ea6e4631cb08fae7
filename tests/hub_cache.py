"""A Hugging Face hub cache laid out as huggingface_hub leaves it after `snapshot_download`, made from a local model
folder, for tests that must not reach the hub.

The layout (huggingface_hub's cache, https://huggingface.co/docs/huggingface_hub/guides/manage-cache, as written by
huggingface_hub 0.x-2.x): `<cache>/models--<org>--<name>/blobs/<etag>` holds each file's bytes once, named by its
etag (the sha256 of an LFS file such as the weights, the git blob sha1 of a small file);
`snapshots/<commit>/<file>` is a relative symlink to its blob, so revisions that share a file share its blob;
`refs/<branch>` holds the commit the branch pointed at when it was downloaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin")


def _etag(path: Path) -> str:
    lfs = path.suffix in LFS_SUFFIXES
    digest = hashlib.sha256() if lfs else hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def add_revision(cache: Path, repo_id: str, folder: Path, branch: str | None = "main",
                 changes: dict[str, str] | None = None) -> str:
    """Put the files of `folder` (with `changes`: file name -> new text) in `cache` as one commit of `repo_id`, the
    head of `branch` (None: no branch points at it); returns the commit sha (made from the files' etags)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    staged = repo / ".staging"
    staged.mkdir(exist_ok=True)
    files: dict[str, str] = {}
    for src in sorted(p for p in folder.iterdir() if p.is_file()):
        if changes and src.name in changes:
            src = staged / src.name
            src.write_text(changes[src.name])
        etag = _etag(src)
        blob = repo / "blobs" / etag
        if not blob.exists():
            try:
                os.link(src, blob)          # the weights: a hard link where the file system allows, else a copy
            except OSError:
                shutil.copyfile(src, blob)
        files[src.name] = etag
    shutil.rmtree(staged)
    commit = hashlib.sha1("".join(f"{n}:{e}\n" for n, e in sorted(files.items())).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, etag in files.items():
        link = snapshot / name
        if not link.is_symlink():
            link.symlink_to(Path("..") / ".." / "blobs" / etag)
    if branch is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return commit

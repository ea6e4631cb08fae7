"""The result store: one fsspec URL that holds every evaluation's files.

A local folder by default (`<home>/results`); `s3://bucket/prefix`, `gs://...`, `az://...` or any other fsspec
scheme works unchanged, so the shards of one evaluation can run on machines that share nothing but the store.
Paths are `upath.UPath` objects (pathlib's API over fsspec); a local path is a plain `pathlib.Path` subclass.

Every write is atomic: a local file is written beside its target and renamed over it, and an object store PUT
replaces an object whole. So a reader never sees half a file, and a stage that finds its output can reuse it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from upath import UPath

from evaldag import paths
from evaldag.errors import ConfigError, redact_url

StorePath = UPath
log = logging.getLogger("evaldag")


def root(env: Mapping[str, str] | None = None, home: Path | None = None) -> UPath:
    """The store's root: `$EVALDAG_RESULTS_URL` (any fsspec URL), else `$EVALDAG_RESULTS_DIR`, else
    `<home>/results`. `env` and `home` default to this process's; the local stack passes its workers'."""
    env = os.environ if env is None else env
    url = env.get("EVALDAG_RESULTS_URL") or env.get("EVALDAG_RESULTS_DIR")
    if not url:
        return UPath((home or paths.home()) / "results")
    return as_path(url)


def as_path(location: str | os.PathLike) -> UPath:
    """A store path from a URL or a local path (a relative local path is made absolute: every worker must read
    the same plan path)."""
    text = str(location)
    if not text.strip():
        raise ConfigError("the result store location is empty; set EVALDAG_RESULTS_URL to a folder or a URL "
                          "such as s3://bucket/evaldag")
    if "://" not in text:
        return UPath(Path(text).expanduser().resolve())
    try:
        path = UPath(text)
        _check_passes_as_text(text, path)
        path.fs  # noqa: B018 - creating the filesystem is what fails when its package is missing
    except (ImportError, ValueError) as e:
        scheme = text.split("://", 1)[0]
        raise ConfigError(f"the result store {text!r} needs the fsspec backend for {scheme!r}: {e}; install it "
                          "(e.g. `pip install s3fs` for s3://, `gcsfs` for gs://, `adlfs` for az://)") from None
    return path


def _check_passes_as_text(text: str, path: UPath) -> None:
    """Refuse a store URL that does not survive `str()`: flows hand plans to shard runs and workers by path text,
    and for some filesystems (ftp://, sftp://: host, port and user go into storage options) that text drops the
    host, so a worker would read and write somewhere else."""
    if UPath(str(path)).storage_options != path.storage_options:
        raise ConfigError(f"the result store {redact_url(text)!r} cannot be used: a path on it loses its host and "
                          f"user when written as text ({str(path)!r}), which is how evaldag hands paths to its "
                          "workers; use an object store (s3://, gs://, az://) or mount the server as a local folder")


def is_local(path: UPath) -> bool:
    """True when `path` lives on this machine's filesystem (locks and renames work there)."""
    return getattr(path, "protocol", "") in ("", "file", "local")


def write_bytes(path: UPath, data: bytes) -> UPath:
    """Write `data` to `path` atomically."""
    if is_local(path):
        local = Path(str(path).removeprefix("file://"))
        local.parent.mkdir(parents=True, exist_ok=True)
        # unique temp name: two writers of the same (identical) file must not rename each other's half
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(data)
        tmp.replace(local)
    else:
        path.write_bytes(data)  # one PUT: the object appears whole or not at all
    return path


def write_text(path: UPath, text: str) -> UPath:
    """Write `text` (UTF-8) to `path` atomically."""
    return write_bytes(path, text.encode())


def write_json(path: UPath, data: dict) -> UPath:
    """Write `data` as indented JSON to `path` atomically."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str))


def read_json(path: UPath) -> dict:
    """Read a JSON file of the store."""
    return json.loads(path.read_text())


def remove_tree(path: UPath) -> None:
    """Delete a folder (or prefix) and everything under it; a missing one is fine."""
    if is_local(path):
        shutil.rmtree(str(path).removeprefix("file://"), ignore_errors=True)
    elif path.exists():
        path.fs.rm(path.path, recursive=True)


@functools.cache
def _waiting_lock_class() -> type:
    from filelock import FileLock, Timeout

    class WaitingFileLock(FileLock):
        """A FileLock whose `with` says so when another process holds it, so a shard that sits idle in the logs
        says why: it waits for an identical evaluation's stage instead of computing it again."""

        target = ""

        def __enter__(self):
            try:
                self.acquire(blocking=False)
            except Timeout:
                log.info("%s is being written by another process (an identical evaluation): waiting for it",
                         self.target or self.lock_file)
                self.acquire()
            return self

    return WaitingFileLock


def lock(path: UPath):
    """An exclusive lock for computing `path`: two identical evaluations running at once compute it once (the
    second waits, logging that it does, then finds the file).

    A local or shared POSIX store gets a lock file beside the output, which holds across processes and machines
    that mount it. Object stores have no locks; their lock lives in `<home>/locks` and so holds between the
    processes of one machine only. Across machines, Prefect's idempotency keys keep identical evaluations apart,
    and if two still race they write identical, atomically replaced objects.
    """
    cls = _waiting_lock_class()
    if is_local(path):
        local = Path(str(path).removeprefix("file://"))
        local.parent.mkdir(parents=True, exist_ok=True)
        file_lock = cls(str(local) + ".lock")
    else:
        folder = paths.home() / "locks"
        folder.mkdir(parents=True, exist_ok=True)
        file_lock = cls(str(folder / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".lock")))
    file_lock.target = str(path)
    return file_lock


@contextmanager
def local_copy(path: UPath) -> Iterator[Path]:
    """A local file with the contents of `path` (the file itself when it is local), for tools that need a local
    path such as MLflow's log_artifact."""
    if is_local(path):
        yield Path(str(path).removeprefix("file://"))
        return
    with tempfile.TemporaryDirectory(prefix="evaldag-") as tmp:
        local = Path(tmp) / path.name
        local.write_bytes(path.read_bytes())
        yield local


def write_parquet(path: UPath, df, metadata: dict[str, str] | None = None) -> UPath:
    """Write a polars DataFrame as parquet to `path` atomically."""
    buf = io.BytesIO()
    df.write_parquet(buf, metadata=metadata)
    return write_bytes(path, buf.getvalue())


__all__ = ["StorePath", "root", "as_path", "is_local", "write_bytes", "write_text", "write_json", "read_json",
           "remove_tree", "lock", "local_copy", "write_parquet"]


def chunks_dir(out: UPath) -> UPath:
    """Where a stage's output `out` keeps its chunks while it is being generated (`<stem>.chunks/` beside it)."""
    return out.with_name(out.stem + ".chunks")


def chunk_files(chunks: UPath) -> list[UPath]:
    """A shard's chunks, batch chunks and request chunks alike, in a fixed order."""
    return sorted([*chunks.glob("batch-*.parquet"), *chunks.glob("requests-*.parquet")], key=str)

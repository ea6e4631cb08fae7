"""Prefect's persisted results in the result store, beside the stage outputs.

A flow or task result (a shard's graded path, an evaluation's summary) is written by the worker that ran it and
read by others: the parent flow, `prefect flow-run` tooling, a retry on another node. On a cluster those share
nothing but the result store, so Prefect's results go there too: `configure` saves a storage block for
`<store>/prefect-results` (a LocalFileSystem for a folder, a RemoteFileSystem for any other fsspec URL) and makes it
the server's default result storage, which every client of that server then uses.
"""

from __future__ import annotations

from uuid import UUID

from evaldag.storage import store

BLOCK_NAME = "evaldag-results"


def storage_location(results_root: str | None = None) -> str:
    """Where Prefect's results go: `<result store>/prefect-results` (the store of this process by default)."""
    root = store.as_path(results_root) if results_root else store.root()
    return str(root / "prefect-results")


def configure(api_url: str, results_root: str | None = None) -> UUID:
    """Save the result-storage block on the Prefect server at `api_url` and make it the server's default.

    `results_root` is the result store the workers use (it can differ from this process's own)."""
    from prefect.client.orchestration import get_client
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem
    from prefect.settings import PREFECT_API_URL, temporary_settings

    location = storage_location(results_root)
    local = store.is_local(store.as_path(location))
    block = LocalFileSystem(basepath=location) if local else RemoteFileSystem(basepath=location)
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        block_id = block.save(BLOCK_NAME, overwrite=True, _sync=True)
        with get_client(sync_client=True) as client:
            client.update_server_default_result_storage(block_id)
    return block_id


__all__ = ["BLOCK_NAME", "configure", "storage_location"]

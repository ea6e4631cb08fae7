"""Prefect's persisted results in the result store: an evaluation's summary, as JSON data, read as data.

The eval flow's summary (the figures its run measured, which `evaldag run` prints) is written by the cpu worker and
read by the `evaldag run` process, which shares only the result store with it; so `configure` saves a storage
block for `<store>/prefect-results` (a LocalFileSystem for a folder, a RemoteFileSystem for any other fsspec URL)
and makes it the server's default result storage.

Every node can write the result store, so what is read back from it must be data: Prefect's own reader
(`State.result()`, and the cache lookup a task with a cache policy makes before it runs) decodes a record with the
serializer the record file itself names, so a planted file unpickles anything (`pickle`), or imports and calls
whatever its `__class__`/`__exc_type__` names (`json`: `prefect.serializers.prefect_json_object_decoder`). Hence:
no task persists or caches its result (`persist_result=False`: the store's files are the stages' results), the
eval flow writes its summary with the `json` serializer (plain JSON types), and `read_result` reads it back with a
plain JSON parser, never with Prefect's.
"""

from __future__ import annotations

import json
import re
from typing import Any
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


# The key Prefect gives a result it writes (uuid4().hex): anything else in a state is not ours to read.
_RESULT_KEY = re.compile(r"[0-9a-f]{32}")


def read_result(state: Any) -> Any | None:
    """The persisted result of a flow run's final `state`, parsed as plain JSON (dicts, lists, text, numbers; never
    an object, whatever serializer the state or the file names), or None when there is none or it cannot be read
    from here. The file is found where the state's storage block (read as data from the API) points, else in this
    process's result store."""
    data = getattr(state, "data", None)
    if isinstance(data, dict):
        key, block_id = data.get("storage_key"), data.get("storage_block_id")
    else:
        key, block_id = getattr(data, "storage_key", None), getattr(data, "storage_block_id", None)
    if not isinstance(key, str) or not _RESULT_KEY.fullmatch(key):
        return None
    try:
        folder = _block_basepath(block_id) if block_id else storage_location()
        content = json.loads((store.as_path(folder) / key).read_text())
        if isinstance(content, dict) and content.keys() == {"metadata", "result"}:
            # a whole record (a task's result): the result inside it is JSON text (a flow writes the result alone)
            content = json.loads(content["result"]) if isinstance(content["result"], str) else None
        return content
    except Exception:    # a store or server this machine cannot reach, a file that is not JSON
        return None


def _block_basepath(block_id: Any) -> str:
    """The folder a file-system block stores in, read from the block's document (data: no block class is built)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        document = client.read_block_document(UUID(str(block_id)), include_secrets=False)
    basepath = document.data.get("basepath")
    if not isinstance(basepath, str) or not basepath:
        raise ValueError(f"result storage block {block_id} has no basepath")
    return basepath


__all__ = ["BLOCK_NAME", "configure", "read_result", "storage_location"]

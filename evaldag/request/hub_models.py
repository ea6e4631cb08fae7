"""Checkpoints named by a Hugging Face hub id: `org/name` or `org/name@revision` (a commit sha, branch or tag).

How a `checkpoint` string is read (evaldag.request.checkpoint.checkpoint_kind): a model alias first, then an existing
local path, and only then a hub id, which must match the hub's grammar with its namespace (`org/name`: letters,
digits, '-', '_', '.', at most 96 characters, no '--' or '..'). So a folder `Qwen/Qwen2.5-Math-1.5B-Instruct` next
to the caller wins over the hub model of that name, and a mistyped relative folder that happens to look like an id
fails with a message that says both readings.

The files come from huggingface_hub's own cache (HF_HUB_CACHE, `models--org--name/{blobs,snapshots,refs}`), never a
cache of ours: `snapshot_download` fetches what is missing, and with HF_HUB_OFFLINE=1 answers from the cache alone
(a branch through refs/<branch>). A revision that is a full commit sha is immutable, so a complete snapshot of it in
the cache is used without asking the hub. The snapshot folder is then validated and fingerprinted like any folder
(evaldag.request.fingerprint: its files resolve through the cache's symlinks to the blobs), so a hub model and the
same files in a plain folder are the same checkpoint, and another revision with other files is another one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from evaldag.errors import CheckpointError
from evaldag.request.rules import check_checkpoint

HUB_ID_RULE = "org/name or org/name@revision (e.g. Qwen/Qwen2.5-Math-1.5B-Instruct@<commit sha>)"
# The revision after '@': a commit sha, a branch or a tag (branches may hold '/', as refs/pr/1 does).
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# The files a model needs (config, weights, tokenizer, chat templates, remote code): not a repo's other formats
# (GGUF, ONNX, original/ PyTorch shards), which can be many times the model's size.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py",
               "additional_chat_templates/*"]
# a repo with PyTorch weights only
BIN_FILES = ["*.bin"]


@dataclass(frozen=True)
class HubId:
    """A model repo on the hub, at a revision (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    @property
    def pinned(self) -> bool:
        """Whether the revision is a full commit sha: the same files forever."""
        return self.revision is not None and bool(_COMMIT.fullmatch(self.revision))


def parse_hub_id(text: str) -> HubId | None:
    """`text` as a hub model id with its namespace and an optional `@revision`, or None when it is not one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, at, revision = str(text).strip().partition("@")
    if repo_id.count("/") != 1 or (at and (not _REVISION.fullmatch(revision) or ".." in revision)):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubId(repo_id, revision or None)


def _download(hub: HubId, patterns: list[str], local_only: bool = False) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(hub.repo_id, revision=hub.revision, allow_patterns=patterns,
                                  local_files_only=local_only))


def _complete(folder: Path) -> bool:
    try:
        check_checkpoint(folder, CheckpointError)
    except CheckpointError:
        return False
    return True


def cached_snapshot(hub: HubId) -> Path | None:
    """The snapshot folder of `hub` in huggingface_hub's cache, without asking the hub (a branch through the cache's
    refs/<branch>), or None when the cache has none."""
    try:
        return _download(hub, MODEL_FILES, local_only=True)
    except Exception:  # noqa: BLE001 - not in the cache (LocalEntryNotFoundError), an unreadable cache: none
        return None


def snapshot(hub: HubId, given: str | None = None) -> Path:
    """The local snapshot folder of `hub`, from huggingface_hub's cache, downloading the model's files (MODEL_FILES;
    *.bin where a repo has no safetensors) where the cache lacks them. Raises CheckpointError naming the model, the
    hub's answer and the fix. `given`: the checkpoint as the user wrote it, for the message."""
    if hub.pinned and (folder := cached_snapshot(hub)) is not None and _complete(folder):
        return folder      # a commit's files never change: the hub has nothing newer to say
    try:
        folder = _download(hub, MODEL_FILES)
        if not _complete(folder):
            folder = _download(hub, MODEL_FILES + BIN_FILES)
    except Exception as e:  # noqa: BLE001 - every hub failure gets the same message, with the hub's own reason
        raise CheckpointError(_failure(hub, given, e)) from None
    return folder


def _failure(hub: HubId, given: str | None, error: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    read_as = (f"checkpoint {given!r} is no model alias and no folder here ({Path.cwd()}), so it was read as the hub "
               f"model {hub}; " if given else f"hub model {hub}: ")
    download = (f"`hf download {hub.repo_id}{' --revision ' + hub.revision if hub.revision else ''}` where the hub "
                f"is reachable, with the same HF_HUB_CACHE")
    if constants.HF_HUB_OFFLINE:
        fix = (f"HF_HUB_OFFLINE is set, and the hub cache ({constants.HF_HUB_CACHE}) has no snapshot of it. Download "
               f"it once ({download}), or unset HF_HUB_OFFLINE")
    elif isinstance(error, (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError)):
        fix = ("Check the id and revision on the hub (a gated or private model needs HF_TOKEN), or pass a model "
               "alias or an existing checkpoint folder")
    else:
        fix = (f"The hub could not be reached, and the hub cache ({constants.HF_HUB_CACHE}) has no snapshot of it. "
               f"Download it once ({download}), or pass a model alias or an existing checkpoint folder")
    return f"{read_as}it could not be had from the hub ({type(error).__name__}: {reason}). {fix}"


__all__ = ["BIN_FILES", "HUB_ID_RULE", "HubId", "MODEL_FILES", "cached_snapshot", "parse_hub_id", "snapshot"]

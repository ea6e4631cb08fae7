"""A checkpoint named by a hub id (issue 52 item 4): how it is told from a folder, resolved from huggingface_hub's
own cache offline, fingerprinted like a folder, and refused in events unless the operator allows its namespace.

The cache is the one huggingface_hub leaves (tests/hub_cache.py), made here from the default model's exported folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_cache import add_revision

from evaldag.errors import CheckpointError
from evaldag.events.checkpoint_event import HUB_ORGS_ENV, validate_checkpoint_event
from evaldag.request.checkpoint import checkpoint_kind, resolve_model
from evaldag.request.fingerprint import fingerprint
from evaldag.request.hub_models import HubId, parse_hub_id

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "evaldag-test/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("text, expected", [
    ("Qwen/Qwen2.5-Math-1.5B-Instruct", HubId("Qwen/Qwen2.5-Math-1.5B-Instruct")),
    (f"Qwen/Qwen2.5-Math-1.5B-Instruct@{SHA}", HubId("Qwen/Qwen2.5-Math-1.5B-Instruct", SHA)),
    ("org/name@main", HubId("org/name", "main")),
    ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
    ("gpt2", None),                    # no namespace: a model alias's form, never read as a hub id
    ("a/b/c", None),                   # a relative path, not an id
    ("org/na--me", None), ("org/name.git", None), ("org/-name", None),
    ("org/name@", None), ("org/name@../../etc", None), ("org/name@a b", None),
    ("/ckpts/run/checkpoint-5", None), ("./org/name", None),
])
def test_hub_id_grammar(text, expected):
    assert parse_hub_id(text) == expected


def test_an_existing_folder_wins_over_the_hub_id_it_spells(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checkpoint_kind("Qwen/Qwen2.5-Math-1.5B-Instruct") == ("hub", HubId("Qwen/Qwen2.5-Math-1.5B-Instruct"))
    (tmp_path / "Qwen" / "Qwen2.5-Math-1.5B-Instruct").mkdir(parents=True)
    kind, what = checkpoint_kind("Qwen/Qwen2.5-Math-1.5B-Instruct")
    assert kind == "folder" and Path(what).resolve() == tmp_path / "Qwen" / "Qwen2.5-Math-1.5B-Instruct"
    assert checkpoint_kind("./ckpts/x")[0] == "folder"       # written as a path: a folder, existing or not


def test_neither_alias_folder_nor_hub_id_names_all_three(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"neither a model alias .*nor an existing folder .*nor a hub model "
                                              r"id \(org/name or org/name@revision"):
        checkpoint_kind("runs/a/checkpoint-5")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline hub cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1) holding the default model as REPO at two commits: the
    exported files (refs/main), and the same weights with another generation_config.json (no branch)."""
    from huggingface_hub import constants

    folder = Path(resolve_model("smollm2-135m-instruct").path)
    cache = tmp_path / "hf-hub"
    main = add_revision(cache, REPO, folder)
    other = add_revision(cache, REPO, folder, branch=None,
                         changes={"generation_config.json": '{"bos_token_id": 1, "eos_token_id": 2}'})
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(constants, name, value)     # read once at import; set as the environment would
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder, main, other


def test_a_hub_model_resolves_offline_and_fingerprints_like_its_folder(hub):
    folder, main, other = hub
    unpinned = resolve_model(REPO)                        # the default branch, through refs/main
    pinned = resolve_model(f"{REPO}@{main}")
    assert Path(unpinned.path) == Path(pinned.path) and Path(pinned.path).name == main
    assert Path(pinned.path).parent.parent.name == f"models--{REPO.replace('/', '--')}"   # the hub's cache, not ours
    assert pinned.fingerprint == unpinned.fingerprint == fingerprint(folder)
    assert (pinned.name, pinned.hub) == (REPO, f"{REPO}@{main}")
    assert unpinned.hub == f"{REPO}@{main}"               # the branch as the cache resolved it
    changed = resolve_model(f"{REPO}@{other}")
    assert changed.fingerprint != pinned.fingerprint


def test_a_hub_model_missing_from_the_offline_cache_says_how_to_get_it(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        resolve_model(f"{REPO}@{'f' * 40}")
    message = str(e.value)
    assert f"read as the hub model {REPO}@{'f' * 40}" in message and "HF_HUB_OFFLINE is set" in message
    assert f"hf download {REPO} --revision {'f' * 40}" in message
    with pytest.raises(CheckpointError, match="no folder here .* read as the hub model nobody/nothing"):
        resolve_model("nobody/nothing")


def test_the_plan_files_a_hub_model_under_its_repo(hub, tmp_path, monkeypatch):
    from test_plan import KeyWorld

    from evaldag.request.plan import EvalRequest, resolve

    folder, main, other = hub
    w = KeyWorld(tmp_path / "world", monkeypatch)
    base = {k: v for k, v in w.request.items() if k != "train_run"}
    plans = [resolve(EvalRequest(**{**base, "checkpoint": c}), w.results) for c in (REPO, f"{REPO}@{main}")]
    assert {p.train_run for p in plans} == {"evaldag-test-SmolLM2-135M-Instruct"}
    assert plans[0].generation_key == plans[1].generation_key         # the same files: the same generations
    w.write_alias(path=str(folder))
    assert resolve(EvalRequest(**base), w.results).generation_key == plans[0].generation_key
    assert resolve(EvalRequest(**{**base, "checkpoint": f"{REPO}@{other}"}), w.results).generation_key \
        != plans[0].generation_key


def test_events_name_hub_models_only_of_allowed_namespaces_and_pinned(tmp_path, monkeypatch):
    payload = {"path": f"{REPO}@{SHA}", "step": 100, "train_run": "grpo-42"}
    monkeypatch.delenv(HUB_ORGS_ENV, raising=False)
    with pytest.raises(CheckpointError, match=f"is not absolute; .* as a hub model id it is refused too: events "
                                              f"may name hub models only of the namespaces listed in {HUB_ORGS_ENV} "
                                              "\\(none is\\), add 'evaldag-test' there"):
        validate_checkpoint_event(payload, [tmp_path])
    monkeypatch.setenv(HUB_ORGS_ENV, "other-org, evaldag-test")
    assert validate_checkpoint_event(payload, [tmp_path]).path == f"{REPO}@{SHA}"
    with pytest.raises(CheckpointError, match="names no commit"):
        validate_checkpoint_event({**payload, "path": f"{REPO}@main"}, [tmp_path])
    with pytest.raises(CheckpointError, match="not under an allowed checkpoint root"):   # folders: as before
        validate_checkpoint_event({**payload, "path": "/elsewhere/checkpoint-100"}, [tmp_path])


def test_an_unreachable_hub_is_named_with_the_cache_to_fill(tmp_path, monkeypatch):
    """A hub that refuses connections (a closed local port stands for it) and an empty cache."""
    from conftest import free_ports
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_ports(1)[0]}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"read as the hub model nobody/nothing@main; .*The hub could not be "
                                              r"reached, and the hub cache \(.*empty-cache\) has no snapshot of it\. "
                                              r"Download it once \(`hf download nobody/nothing --revision main`"):
        resolve_model("nobody/nothing@main")

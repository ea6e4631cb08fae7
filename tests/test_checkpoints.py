"""Checkpoint events are untrusted: each bad payload or folder is refused by name; discovery finds complete ones."""

from __future__ import annotations

import json
import logging
import os

import pytest

from conftest import complete_checkpoint
from evaldag.events.checkpoint_event import (CheckpointEvent, allowed_roots_from_env, discover_checkpoints, parse_step,
                                 validate_checkpoint_event)
from evaldag.errors import CheckpointError, EvalDagError


_complete = complete_checkpoint


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "ckpts"
    r.mkdir()
    return r


def _payload(path, **kw):
    """An event for `path` at the step its folder name says (1200 for a name without one)."""
    step = parse_step(os.path.basename(str(path)))
    return {"path": str(path), "step": 1200 if step is None else step, "train_run": "grpo-42", **kw}


# ----------------------------------------------------------------------------------------------------------------
# parse_step
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, step", [
    ("checkpoint-1200", 1200),
    ("checkpoint_1200", 1200),
    ("global_step_1200", 1200),
    ("global_step1200", 1200),
    ("globalstep1200", 1200),
    ("step_1200", 1200),
    ("step-1200", 1200),
    ("step1200", 1200),
    ("ckpt_1200", 1200),
    ("ckpt-0", 0),
    ("iter_0001200", 1200),
    ("epoch1epochstep5globalstep1200", 1200),
    ("epoch=1-step=1200", 1200),
    ("Checkpoint-7", 7),
    ("tmp-checkpoint-1200", None),          # the Hugging Face Trainer's folder while it is still writing
    ("checkpoint-best", None),
    ("checkpoint-", None),
    ("step_1200_old", None),
    ("final", None),
    ("run-42", None),
    ("", None),
])
def test_parse_step(name, step):
    assert parse_step(name) == step


# ----------------------------------------------------------------------------------------------------------------
# validate_checkpoint_event
# ----------------------------------------------------------------------------------------------------------------

def test_valid_event_passes_and_keeps_extra_keys_out(root):
    ckpt = _complete(root / "checkpoint-1200")
    ev = validate_checkpoint_event(_payload(ckpt, epoch=2, benchmarks=["math500"], model="m",
                                            mlflow_parent_run_id="0123456789abcdef0123456789abcdef",
                                            extra={"lr": 1e-5}, final_step=5000, added_by_newer_trainer=True),
                                   [root])
    assert isinstance(ev, CheckpointEvent) and ev.final_step == 5000
    assert (ev.path, ev.step, ev.epoch, ev.benchmarks, ev.extra) == (str(ckpt), 1200, 2, ["math500"], {"lr": 1e-5})


def test_error_is_an_evaldag_error(root):
    with pytest.raises(EvalDagError):
        validate_checkpoint_event([], [root])


@pytest.mark.parametrize("payload, message", [
    (["not", "a", "mapping"], "must be a mapping"),
    ("path=/x", "must be a mapping"),
    ({}, "missing required field\\(s\\) 'path', 'step', 'train_run'"),
    ({"path": "/x", "train_run": "r"}, "missing required field\\(s\\) 'step'"),
    ({"path": "/x", "step": -1, "train_run": "r"}, "step: Input should be greater than or equal to 0"),
    ({"path": "/x", "step": "12", "train_run": "r"}, "step: Input should be a valid integer \\(got str '12'\\)"),
    ({"path": "/x", "step": True, "train_run": "r"}, "step: Input should be a valid integer \\(got bool True\\)"),
    ({"path": "/x", "step": 1.0, "train_run": "r"}, "step: Input should be a valid integer"),
    ({"path": 5, "step": 1, "train_run": "r"}, "path: Input should be a valid string"),
    ({"path": "/x", "step": 1, "train_run": "a/b"}, "train_run: String should match pattern"),
    ({"path": "/x", "step": 1, "train_run": "r", "epoch": "1"}, "epoch: Input should be a valid integer"),
    ({"path": "/x", "step": 1, "train_run": "r", "benchmarks": "math500"}, "benchmarks: Input should be a valid list"),
    ({"path": "/x", "step": 1, "train_run": "r", "benchmarks": ["MATH 500"]}, "benchmarks.0: .* neither a config name"),
    ({"path": "/x", "step": 1, "train_run": "r", "extra": []}, "extra: Input should be a valid dictionary"),
    ({"path": "/x", "step": 1, "train_run": "r", "final_step": 0}, "final_step: Input should be greater than or equal "
                                                                   "to 1"),
    ({"path": "/x", "step": 1, "train_run": "r", "final_step": "5000"}, "final_step: Input should be a valid integer"),
])
def test_bad_payloads(root, payload, message):
    with pytest.raises(CheckpointError, match=message):
        validate_checkpoint_event(payload, [root])


def test_relative_path_refused(root):
    with pytest.raises(CheckpointError, match="is not absolute"):
        validate_checkpoint_event(_payload("ckpts/checkpoint-1200"), [root])


def test_dotdot_traversal_refused_even_when_it_lands_inside(root):
    _complete(root / "checkpoint-1200")
    with pytest.raises(CheckpointError, match="'\\.\\.' components"):
        validate_checkpoint_event(_payload(f"{root}/../ckpts/checkpoint-1200"), [root])
    with pytest.raises(CheckpointError, match="'\\.\\.' components"):
        validate_checkpoint_event(_payload(f"{root}/../../etc"), [root])


def test_path_outside_roots_refused_naming_the_roots(root, tmp_path):
    other = _complete(tmp_path / "elsewhere" / "checkpoint-1")
    with pytest.raises(CheckpointError, match=f"not under an allowed checkpoint root \\({root}\\).*"
                                              "EVALDAG_CHECKPOINT_ROOTS"):
        validate_checkpoint_event(_payload(other), [root])


def test_prefix_sibling_is_not_inside(root, tmp_path):
    sibling = _complete(tmp_path / "ckpts-evil" / "checkpoint-1")     # /x/ckpts-evil starts with /x/ckpts
    with pytest.raises(CheckpointError, match="not under an allowed checkpoint root"):
        validate_checkpoint_event(_payload(sibling), [root])


def test_symlink_escaping_the_root_refused(root, tmp_path):
    outside = _complete(tmp_path / "secret" / "checkpoint-9")
    (root / "checkpoint-9").symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"resolves to {outside}.*not under an allowed"):
        validate_checkpoint_event(_payload(root / "checkpoint-9"), [root])


def test_symlinked_root_and_link_inside_root_are_fine(root, tmp_path):
    ckpt = _complete(root / "run" / "checkpoint-3")
    (tmp_path / "ckpts-link").symlink_to(root)
    ev = validate_checkpoint_event(_payload(tmp_path / "ckpts-link" / "run" / "checkpoint-3"), [root])
    assert ev.path == str(ckpt)                                       # the resolved folder is what gets evaluated
    ev = validate_checkpoint_event(_payload(ckpt), [tmp_path / "ckpts-link"])
    assert ev.path == str(ckpt)


def test_no_roots_refuses_everything_and_says_what_to_set(root):
    ckpt = _complete(root / "checkpoint-1")
    with pytest.raises(CheckpointError, match="no checkpoint roots are allowed.*set EVALDAG_CHECKPOINT_ROOTS"):
        validate_checkpoint_event(_payload(ckpt), [])


def test_missing_folder_refused(root):
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_checkpoint_event(_payload(root / "checkpoint-404"), [root])


def test_incomplete_checkpoint_no_tokenizer(root):
    ckpt = _complete(root / "checkpoint-1200")
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="train_run=grpo-42, step=1200.*has no tokenizer"):
        validate_checkpoint_event(_payload(ckpt), [root])


def test_incomplete_checkpoint_missing_index_shard(root):
    ckpt = _complete(root / "checkpoint-1")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"w")
    with pytest.raises(CheckpointError, match="missing or empty.*model-00002-of-00002"):
        validate_checkpoint_event(_payload(ckpt), [root])


def test_marker(root):
    ckpt = _complete(root / "checkpoint-1200")
    with pytest.raises(CheckpointError, match="has no COMPLETE marker"):
        validate_checkpoint_event(_payload(ckpt), [root], marker="COMPLETE")
    (ckpt / "COMPLETE").write_text("")
    assert validate_checkpoint_event(_payload(ckpt), [root], marker="COMPLETE").step == 1200
    with pytest.raises(CheckpointError, match="marker must be a file name"):
        validate_checkpoint_event(_payload(ckpt), [root], marker="../COMPLETE")


# ----------------------------------------------------------------------------------------------------------------
# allowed_roots_from_env
# ----------------------------------------------------------------------------------------------------------------

def test_allowed_roots_from_env(monkeypatch, tmp_path):
    monkeypatch.delenv("EVALDAG_CHECKPOINT_ROOTS", raising=False)
    assert allowed_roots_from_env() == []
    monkeypatch.setenv("EVALDAG_CHECKPOINT_ROOTS", f"{tmp_path / 'a'}{os.pathsep}{os.pathsep} {tmp_path / 'b'} ")
    assert allowed_roots_from_env() == [tmp_path / "a", tmp_path / "b"]
    monkeypatch.setenv("EVALDAG_CHECKPOINT_ROOTS", "relative/ckpts")
    with pytest.raises(CheckpointError, match="not an absolute path"):
        allowed_roots_from_env()


# ----------------------------------------------------------------------------------------------------------------
# discover_checkpoints
# ----------------------------------------------------------------------------------------------------------------

def test_discover_checkpoints(root, tmp_path, caplog):
    a = _complete(root / "checkpoint-200")
    b = _complete(root / "global_step_100")
    c = _complete(root / "run-7" / "step_150")                  # <run>/<checkpoint> layout
    _complete(root / "run-7" / "notes")                        # complete but no step in its name
    no_tok = _complete(root / "checkpoint-300")
    (no_tok / "tokenizer.json").unlink()                       # incomplete: skipped
    _complete(root / "tmp-checkpoint-400")                     # still being written by the Trainer
    _complete(root / ".hidden" / "checkpoint-500")
    _complete(root / "a" / "b" / "checkpoint-600")             # two levels down: not scanned
    (root / "checkpoint-700").mkdir()                          # empty
    (root / "step_800").write_text("a file, not a folder")
    (root / "checkpoint-900").symlink_to(_complete(tmp_path / "outside" / "checkpoint-900"))
    with caplog.at_level(logging.INFO, logger="evaldag.events.checkpoint_event"):
        found = discover_checkpoints(root)
    assert found == [(100, b), (150, c), (200, a)]
    assert "checkpoint-300" in caplog.text and "has no tokenizer" in caplog.text
    assert "checkpoint-900" in caplog.text and "outside" in caplog.text


def test_discover_with_marker(root):
    done = _complete(root / "checkpoint-2")
    (done / "COMPLETE").write_text("")
    _complete(root / "checkpoint-1")
    assert discover_checkpoints(root, marker="COMPLETE") == [(2, done)]


def test_discover_missing_root(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        discover_checkpoints(tmp_path / "nope")


def test_oversized_extra_is_refused(root):
    """`extra` is free-form and untrusted; it travels into flow-run parameters and the database: it is capped."""
    from evaldag.events.checkpoint_event import MAX_EXTRA_BYTES

    ckpt = _complete(root / "checkpoint-1200")
    with pytest.raises(CheckpointError, match=r"extra is \d+ bytes of JSON; at most 16384"):
        validate_checkpoint_event(_payload(ckpt, extra={"blob": "x" * 200_000}), [root])
    assert MAX_EXTRA_BYTES == 16384
    validate_checkpoint_event(_payload(ckpt, extra={"limit": 4, "note": "y" * 1000}), [root])

"""RL frameworks' checkpoint folders, built as their code writes them: each is accepted at the right step, or refused
with the setting that makes a Hugging Face model (evaldag.request.layouts).

Shapes: verl's FSDP checkpoint manager (`<default_local_dir>/global_step_N/actor/` with
`model_world_size_W_rank_R.pt` shards, `fsdp_config.json` and `huggingface/`; its model merger or
`checkpoint.save_contents` with `hf_model` puts the weights into `huggingface/`); OpenRLHF's `save_checkpoint`
(`strategy.save_ckpt(model, <ckpt_path>/_actor, tag="global_stepN")` and, with `--save_hf_ckpt`,
`strategy.save_model(..., <ckpt_path>/global_stepN_hf)`); transformers' Trainer under DeepSpeed ZeRO-3 without
`stage3_gather_16bit_weights_on_model_save` (`checkpoint-N/` with config and tokenizer, its weights removed, and
`model_wrapped.save_checkpoint(checkpoint-N)`: `global_stepN/zero_pp_rank_R_mp_rank_00_model_states.pt`,
`bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt`, `latest`, `zero_to_fp32.py`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import complete_checkpoint
from evaldag.errors import CheckpointError
from evaldag.events.checkpoint_event import discover_checkpoints, parse_step, validate_checkpoint_event
from evaldag.events.identity import train_run_of
from evaldag.request.checkpoint import validate_checkpoint
from evaldag.request.plan import _default_train_run


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"x" * 16)


def verl_step(exp: Path, step: int, merged: bool) -> Path:
    """verl's global_step_N: 2 FSDP ranks' shards, and huggingface/ with config and tokenizer (and weights once
    merged)."""
    actor = exp / f"global_step_{step}" / "actor"
    _touch(actor, *(f"{kind}_world_size_2_rank_{r}.pt" for kind in ("model", "optim", "extra_state") for r in (0, 1)))
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}')
    hf = actor / "huggingface"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    (hf / "generation_config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    if merged:
        _touch(hf, "model.safetensors")
    (exp / "latest_checkpointed_iteration.txt").write_text(str(step))
    return exp / f"global_step_{step}"


def openrlhf_step(ckpt_path: Path, step: int, hf: bool) -> Path:
    """OpenRLHF's PPO save: DeepSpeed states under _actor/global_stepN, and with --save_hf_ckpt global_stepN_hf."""
    ds = ckpt_path / "_actor" / f"global_step{step}"
    _touch(ds, "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (ckpt_path / "_actor" / "latest").write_text(f"global_step{step}")
    if hf:
        complete_checkpoint(ckpt_path / f"global_step{step}_hf")
    return ds


def zero3_trainer_checkpoint(out: Path, step: int, gathered: bool) -> Path:
    """transformers' Trainer checkpoint-N under DeepSpeed ZeRO-3."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "trainer_state.json").write_text("{}")
    (folder / "latest").write_text(f"global_step{step}")
    _touch(folder, "zero_to_fp32.py")
    _touch(folder / f"global_step{step}", "zero_pp_rank_0_mp_rank_00_model_states.pt",
           "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    if gathered:
        _touch(folder, "model.safetensors")
    return folder


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "ckpts"
    r.mkdir()
    return r


def _event(path: Path, step: int) -> dict:
    return {"path": str(path), "step": step, "train_run": "rl-job"}


# -- verl ----------------------------------------------------------------------------------------------------------

def test_verl_merged_model_is_accepted_at_its_global_step(root):
    step_dir = verl_step(root / "proj" / "exp", 100, merged=True)
    model = step_dir / "actor" / "huggingface"
    for sent in (model, step_dir, step_dir / "actor"):          # the model, or the step folder that holds it
        assert validate_checkpoint_event(_event(sent, 100), [root]).path == str(model)
    with pytest.raises(CheckpointError, match="'global_step_100' says step 100, the event says step 90"):
        validate_checkpoint_event(_event(model, 90), [root])
    assert discover_checkpoints(root / "proj") == [(100, model)]
    assert train_run_of(model, root / "proj") == "exp"
    validate_checkpoint(step_dir / "actor" / "huggingface")


def test_verl_shards_without_a_merge_are_refused_naming_the_merger(root):
    step_dir = verl_step(root / "exp", 200, merged=False)
    actor = step_dir / "actor"
    for sent in (step_dir, actor / "huggingface"):
        with pytest.raises(CheckpointError) as err:
            validate_checkpoint_event(_event(sent, 200), [root])
        assert f"verl.model_merger merge --backend fsdp --local_dir {actor}" in str(err.value)
        assert "save_contents=[model,optimizer,extra,hf_model]" in str(err.value)
    assert discover_checkpoints(root) == []
    with pytest.raises(CheckpointError, match="is a verl checkpoint"):
        validate_checkpoint(actor / "huggingface")
    # a verl that wrote no huggingface/ folder at all: the same advice
    shutil.rmtree(actor / "huggingface")
    with pytest.raises(CheckpointError, match=r"is a verl checkpoint.*--target_dir .*actor/huggingface"):
        validate_checkpoint_event(_event(step_dir, 200), [root])


def test_plain_evaldag_run_of_a_verl_model_names_the_job_after_the_run_folder(root):
    from evaldag.request.checkpoint import resolve_model

    step_dir = verl_step(root / "exp", 100, merged=True)
    model = resolve_model(str(step_dir))
    assert model.path == str((step_dir / "actor" / "huggingface").resolve())
    assert model.name == "global_step_100"
    assert _default_train_run(str(step_dir), model) == "exp"


# -- OpenRLHF ------------------------------------------------------------------------------------------------------

def test_openrlhf_hf_folders_are_accepted_and_its_deepspeed_states_refused(root):
    ckpt_path = root / "ppo-run"
    ds = openrlhf_step(ckpt_path, 20, hf=True)
    hf = ckpt_path / "global_step20_hf"
    assert parse_step(hf.name) == 20
    assert validate_checkpoint_event(_event(hf, 20), [root]).path == str(hf)
    with pytest.raises(CheckpointError, match="says step 20, the event says step 21"):
        validate_checkpoint_event(_event(hf, 21), [root])
    refusal = r"DeepSpeed checkpoint .* `--save_hf_ckpt` \(<ckpt_path>/global_stepN_hf\)"
    with pytest.raises(CheckpointError, match=refusal):
        validate_checkpoint_event(_event(ds, 20), [root])
    # the sweeper over the run folder finds the Hugging Face folder and skips the engine states
    assert discover_checkpoints(ckpt_path) == [(20, hf)]


# -- DeepSpeed ZeRO-3 under transformers' Trainer ----------------------------------------------------------------

def test_zero3_without_gathered_weights_is_refused_naming_the_setting(root):
    folder = zero3_trainer_checkpoint(root / "sft", 30, gathered=False)
    with pytest.raises(CheckpointError) as err:
        validate_checkpoint_event(_event(folder, 30), [root])
    message = str(err.value)
    assert "ZeRO-3 checkpoint saved without gathered weights" in message
    assert '"stage3_gather_16bit_weights_on_model_save": true' in message and "zero_to_fp32.py" in message
    with pytest.raises(CheckpointError, match="stage3_gather_16bit_weights_on_model_save"):
        validate_checkpoint(folder)
    assert discover_checkpoints(root / "sft") == []


def test_zero3_with_gathered_weights_is_an_ordinary_checkpoint(root):
    folder = zero3_trainer_checkpoint(root / "sft", 30, gathered=True)
    assert validate_checkpoint_event(_event(folder, 30), [root]).path == str(folder)
    assert discover_checkpoints(root / "sft") == [(30, folder)]


def test_a_folder_of_no_known_framework_keeps_the_plain_message(root):
    folder = root / "run" / "checkpoint-5"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"has no weights \(expected one of"):
        validate_checkpoint(folder)

"""Training frameworks' checkpoint folders: where the Hugging Face-format model is, and which setting to change when a
folder holds none.

transformers' Trainer (and TRL's trainers) write `checkpoint-N` folders that are Hugging Face models. RL frameworks
write their own engine states and, depending on a setting, a Hugging Face copy beside them:

- verl: `<default_local_dir>/global_step_N/actor/` holds FSDP (or Megatron) shards, `model_world_size_W_rank_R.pt`;
  `actor/huggingface/` holds the config and tokenizer, and the weights too once verl's model merger has written
  them there or `checkpoint.save_contents` includes `hf_model`. The model is `global_step_N/actor/huggingface`.
- OpenRLHF: DeepSpeed states under `<ckpt_path>/_actor/global_stepN/` (`<ckpt_path>/global_stepN/` for SFT), and,
  with `--save_hf_ckpt`, a Hugging Face folder `<ckpt_path>/global_stepN_hf`.
- DeepSpeed ZeRO-3 under transformers' Trainer: without `stage3_gather_16bit_weights_on_model_save` the
  `checkpoint-N` folder has config and tokenizer but no weights, only `global_stepN/zero_pp_rank_*_model_states.pt`.

Standard library only: evaldag.request.rules (the trainer-side rules) uses it.
"""

from __future__ import annotations

import re
from pathlib import Path

VERL_HF = ("actor", "huggingface")          # verl's Hugging Face folder inside global_step_N
_VERL_SHARD = re.compile(r"model_world_size_\d+_rank_\d+\.pt")
_ZERO3_MODEL = re.compile(r".*zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt")
_DEEPSPEED_STATE = re.compile(r".*(mp_rank_\d+_model_states|_optim_states)\.pt")
_OPENRLHF_ROLES = ("_actor", "_critic", "_policy")


def hf_folder(folder: Path) -> Path:
    """The Hugging Face-format folder that a framework's checkpoint folder stands for: verl's `global_step_N` and
    `global_step_N/actor` mean `global_step_N/actor/huggingface`; any other folder is itself."""
    if (folder / Path(*VERL_HF)).is_dir():
        return folder / Path(*VERL_HF)
    if folder.name == VERL_HF[0] and (folder / VERL_HF[1]).is_dir():
        return folder / VERL_HF[1]
    return folder


def step_folder(folder: Path) -> Path:
    """The folder whose name carries the training step: `global_step_N` for verl's
    `global_step_N/actor/huggingface` (and `global_step_N/actor`), else `folder` itself."""
    if folder.name == VERL_HF[1] and folder.parent.name == VERL_HF[0]:
        return folder.parent.parent
    if folder.name == VERL_HF[0] and (folder / VERL_HF[1]).is_dir():
        return folder.parent
    return folder


def _files(folder: Path, depth: int = 1) -> list[Path]:
    """Files in `folder` and, down to `depth`, its subfolders (DeepSpeed puts its states in `global_stepN/`)."""
    found: list[Path] = []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return found
    for entry in entries:
        if entry.is_file():
            found.append(entry)
        elif entry.is_dir() and depth > 0:
            found += _files(entry, depth - 1)
    return found


def why_not_hf(folder: Path) -> str | None:
    """When `folder` is a framework's checkpoint without Hugging Face weights: what it is and the setting (or the
    conversion) that makes one; None when it looks like no framework's layout known here."""
    folder = Path(folder)
    actor = (folder.parent if (folder.parent.name, folder.name) == VERL_HF
             else folder / VERL_HF[0] if (folder / VERL_HF[0]).is_dir() else folder)
    if any(_VERL_SHARD.fullmatch(f.name) for f in _files(actor, 0)):
        return (f"{actor} is a verl checkpoint: FSDP/Megatron shards, and {actor / VERL_HF[1]} has no weights. "
                f"Merge them into it (`python -m verl.model_merger merge --backend fsdp --local_dir {actor} "
                f"--target_dir {actor / VERL_HF[1]}`), or have verl save them with "
                "`actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]`")
    files = _files(folder)
    if not any(_DEEPSPEED_STATE.fullmatch(f.name) for f in files):
        return None
    if any(part in _OPENRLHF_ROLES for part in folder.parts) or not (folder / "config.json").is_file():
        return (f"{folder} is a DeepSpeed checkpoint (engine states, no Hugging Face model). OpenRLHF writes a "
                "Hugging Face folder beside each one with `--save_hf_ckpt` (<ckpt_path>/global_stepN_hf): "
                "evaluate those; elsewhere convert it with DeepSpeed's zero_to_fp32.py")
    if any(_ZERO3_MODEL.fullmatch(f.name) for f in files):
        return (f"{folder} is a DeepSpeed ZeRO-3 checkpoint saved without gathered weights: it has only "
                "zero_pp_rank_* shards, no model.safetensors. Set `\"stage3_gather_16bit_weights_on_model_save\": "
                "true` under zero_optimization in the DeepSpeed config so the Trainer saves the full model, or "
                f"convert this one with its zero_to_fp32.py (`python {folder / 'zero_to_fp32.py'} {folder} <out> "
                "--safe_serialization`)")
    return None


__all__ = ["VERL_HF", "hf_folder", "step_folder", "why_not_hf"]

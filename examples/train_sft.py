"""A real, short supervised fine-tuning run whose checkpoints get evaluated by themselves.

The loop this example closes:

1. Start the stack: `make up` (or `.venv/bin/evaldag up`), then `eval "$(.venv/bin/evaldag env)"` so that
   PREFECT_API_URL points at it.
2. Run this trainer: `.venv/bin/python examples/train_sft.py --train-run sft-demo`. It fine-tunes the default
   model (SmolLM2-135M-Instruct) on GSM8K train problems, on the CPU, with a plain torch loop.
3. Every `--save-every-steps` steps (or epochs, or seconds: `evaldag.client.notifier.EvalTrigger`) it writes a Hugging
   Face checkpoint folder `<output-dir>/checkpoint-<step>` atomically and announces it with
   `evaldag.client.notifier.CheckpointNotifier`: one `evaldag.checkpoint.saved` event per checkpoint. The evaluation of
   that checkpoint on `--benchmarks` (default gsm8k) then starts by itself; training does not wait for it.
4. In MLflow, the parent run of the training run shows GSM8K accuracy against the training step.

When the Prefect server is down (or PREFECT_API_URL is unset) training goes on: events are spooled to
`$EVALDAG_HOME/spool/<train-run>` and re-sent at the next checkpoint, or later with
`evaldag.client.notifier.flush_spool(spool_dir, api_url)`.

Training, kept readable:

- Data: GSM8K rows `{"question", "answer"}`, where the answer is a worked solution ending in `#### N`. Each row
  becomes a chat: user = the question with the instruction evaldag's gsm8k benchmark uses ("Please reason step by
  step, and put your final answer within \\boxed{}."), assistant = the solution with the calculator annotations
  (`<<48/2=24>>`) removed and the final `#### N` turned into `\\boxed{N}`, i.e. the format the evaluation grades.
  The prompt tokens are masked in the labels (-100): the loss is on the answer (and its end-of-turn token) only.
- Order: a fixed function of (seed, step): each epoch is a seeded permutation of the rows, so a resumed run sees
  exactly the batches the uninterrupted run would have seen.
- Model: loaded in float32 for training (bf16 weights lose small AdamW updates to rounding), AdamW, gradient
  clipping at 1.0; checkpoints are saved in bfloat16 (half the disk; the evaluation runs them in its host's
  default dtype, float32 on a CPU without bf16 instructions, which holds bf16 values exactly).
- Checkpoint folder: config.json, model.safetensors, generation_config.json, the tokenizer files,
  trainer_state.json (step, epoch, EvalTrigger state, loss history) and optimizer.pt (AdamW state). It is written
  to `<output-dir>/.tmp-checkpoint-<step>` and renamed into place, and only then announced: an evaluation never
  sees half a checkpoint. An existing checkpoint-<step> is never overwritten.
- `--resume` continues from the latest checkpoint in the output dir: weights, optimizer state, step and the
  EvalTrigger state, so the resumed run neither re-announces passed checkpoints nor skips a due one. (The weights
  come back from the bf16 checkpoint, i.e. exactly what was evaluated; the float32 digits below bf16 precision
  are not kept.)

Examples:

    .venv/bin/python examples/train_sft.py --train-run sft-demo                      # 60 steps, ckpt every 20
    .venv/bin/python examples/train_sft.py --train-run sft-demo --resume --max-steps 120
    .venv/bin/python examples/train_sft.py --max-steps 10 --save-every-secs 120 --benchmarks gsm8k,math500
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from evaldag import paths
from evaldag.errors import EvalDagError
from evaldag.request.rules import check_train_run
from evaldag.client import CheckpointNotifier, EvalTrigger

DEFAULT_MODEL = "smollm2-135m-instruct"
BENCHMARK = "gsm8k"                       # whose prompt instruction the training data uses
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.pt"
_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
_FINAL_ANSWER = re.compile(r"####\s*(\S[^\n]*?)\s*$")
_CALCULATOR = re.compile(r"<<[^<>]*>>")


class UsageError(Exception):
    """A problem with the command line, the data or the output folder: printed as one message, exit status 2."""


def default_data_path() -> Path:
    """`$EVALDAG_DATA_DIR/gsm8k/train.jsonl` when set, else `../shared/data/gsm8k/train.jsonl` from the repo root."""
    data_dir = paths.data_dir()
    return (data_dir if data_dir is not None else paths.REPO_ROOT.parent / "shared" / "data") / "gsm8k" / "train.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Short SFT of the default model on GSM8K; every checkpoint it saves is "
                                "announced to evaldag and evaluated by itself.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model alias (configs/models) or a Hugging Face folder")
    p.add_argument("--data", type=Path, default=None,
                   help=f"GSM8K-style JSONL with question/answer fields (default: {default_data_path()})")
    p.add_argument("--output-dir", type=Path, default=None, help="checkpoint folder (default: ./runs/<train-run>)")
    p.add_argument("--train-run", default=None,
                   help="training run name in the events (default: sft-<timestamp>; with --resume, the saved one)")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps in total (resumed runs included)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-length", type=int, default=384, help="tokens per example (longer ones are cut)")
    p.add_argument("--save-every-steps", type=int, default=20, help="0 disables the step frequency")
    p.add_argument("--save-every-epochs", type=int, default=None)
    p.add_argument("--save-every-secs", type=float, default=None)
    p.add_argument("--benchmarks", default="gsm8k", help="comma-separated benchmarks to evaluate each checkpoint on")
    p.add_argument("--eval-limit", type=int, default=None,
                   help="ask for quick evaluations of the first N problems only (sent in the event; default: all)")
    p.add_argument("--decide", action="store_true",
                   help="stop each evaluation as soon as its verdict against the job's best checkpoint so far is "
                        "decided (docs/stop-early.md)")
    p.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"),
                   help="Prefect API URL (default: $PREFECT_API_URL); without one, events are spooled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --output-dir (optimizer, step, EvalTrigger state)")
    args = p.parse_args(argv)
    for name in ("max_steps", "batch_size", "max_length", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_length < 32:
        p.error(f"--max-length must be >= 32 (the chat template alone takes ~30 tokens), got {args.max_length}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.save_every_steps is not None and args.save_every_steps < 0:
        p.error(f"--save-every-steps must be >= 0 (0 disables it), got {args.save_every_steps}")
    args.save_every_steps = args.save_every_steps or None
    args.benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    if args.train_run is not None:
        try:
            check_train_run(args.train_run)
        except ValueError as e:
            p.error(f"--{e}".replace("train_run", "train-run", 1))
    if args.resume and args.output_dir is None and args.train_run is None:
        p.error("--resume needs the run to continue: pass --output-dir (or the --train-run whose default "
                "./runs/<train-run> folder holds the checkpoints)")
    return args


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------

def load_rows(path: Path) -> list[dict]:
    """The GSM8K rows of a JSONL file; UsageError naming the file (and line) when it is missing or malformed."""
    if not path.is_file():
        raise UsageError(f"training data {path} does not exist. It is the GSM8K train split as JSONL (fields "
                         f"'question' and 'answer'); put it there (the local mirror is ../shared/data beside the "
                         f"repository, or set EVALDAG_DATA_DIR) or pass --data /path/to/train.jsonl")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno} is not valid JSON ({e})") from None
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("question", "answer")):
                raise UsageError(f"{path}:{lineno} needs string fields 'question' and 'answer' (GSM8K format)")
            if not _FINAL_ANSWER.search(row["answer"]):
                raise UsageError(f"{path}:{lineno}: the answer does not end with '#### <final answer>' (GSM8K "
                                 "format), so there is nothing to put in \\boxed{}")
            rows.append(row)
    return rows


def format_solution(answer: str) -> str:
    """A GSM8K worked solution in the format the evaluation grades: no `<<calc>>` annotations, final \\boxed{N}."""
    m = _FINAL_ANSWER.search(answer)
    body = _CALCULATOR.sub("", answer[:m.start()]).rstrip()
    final = m.group(1).replace(",", "")
    return f"{body}\n\\boxed{{{final}}}" if body else f"\\boxed{{{final}}}"


class Examples:
    """Turns rows into token ids and labels (prompt masked), and a step into its batch, deterministically."""

    def __init__(self, rows: list[dict], tokenizer, render_prompt, batch_size: int, max_length: int, seed: int):
        self.rows, self.tok, self.render_prompt = rows, tokenizer, render_prompt
        self.batch_size, self.max_length, self.seed = batch_size, max_length, seed
        self.steps_per_epoch = len(rows) // batch_size          # the last partial batch of an epoch is dropped
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.truncated = 0
        self._perm: tuple[int, list[int]] | None = None

    def encode(self, row: dict) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of one row; labels are -100 on the prompt, so only the answer is learnt."""
        user = [{"role": "user", "content": self.render_prompt(row["question"])}]
        prompt = self.tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = self.tok.apply_chat_template(user + [{"role": "assistant", "content": format_solution(row["answer"])}],
                                            tokenize=False)
        if not full.startswith(prompt):
            raise UsageError("the tokenizer's chat template does not render the prompt as a prefix of the "
                             "conversation; this example cannot mask the prompt for it")
        # Prompt and answer are tokenized apart, as at generation time (the model continues the prompt's tokens).
        prompt_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = self.tok(full[len(prompt):], add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + answer_ids)[:self.max_length]
        if len(ids) < len(prompt_ids) + len(answer_ids):
            self.truncated += 1
        labels = ([-100] * len(prompt_ids) + answer_ids)[:self.max_length]
        return ids, labels

    def batch(self, step: int):
        """The batch of optimizer step `step` (0-based): a slice of the seeded permutation of the rows for the
        epoch the step falls in (step // steps_per_epoch)."""
        import torch

        epoch, index = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.rows), generator=g).tolist())
        picked = self._perm[1][index * self.batch_size:(index + 1) * self.batch_size]
        encoded = [self.encode(self.rows[i]) for i in picked]
        width = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(encoded), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for r, (ids, lab) in enumerate(encoded):          # right padding: pads are masked and carry no loss
            input_ids[r, :len(ids)] = torch.tensor(ids)
            labels[r, :len(lab)] = torch.tensor(lab)
            attention_mask[r, :len(ids)] = 1
        return input_ids, attention_mask, labels


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------

def checkpoints_in(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the finished checkpoints in output_dir (ones with a trainer_state.json), by step."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in output_dir.iterdir()
             if d.is_dir() and (m := _CHECKPOINT_NAME.fullmatch(d.name)) and (d / TRAINER_STATE).is_file()]
    return sorted(found)


def _fsync_tree(folder: Path) -> None:
    """Flush the folder's files and the folder itself to disk, so the rename publishes complete bytes."""
    for f in folder.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, most often); nothing of it is left behind or announced."""


def save_checkpoint(output_dir: Path, step: int, model, tokenizer, optimizer, state: dict) -> Path | None:
    """Write `<output_dir>/checkpoint-<step>` atomically; None (and nothing written) when it exists already."""
    import torch

    final = output_dir / f"checkpoint-{step}"
    if final.exists():
        print(f"[save] {final} exists already; not overwriting it (and not announcing it again)", flush=True)
        return None
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if tmp.exists():                      # left over by a run that crashed while saving: never announced
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        # A bf16 copy of the weights (the training model stays float32). Tied tensors (embeddings / lm_head) share
        # storage, so convert each storage once: save_pretrained then sees the tie and writes the tensor once.
        converted: dict[int, torch.Tensor] = {}
        bf16 = {name: converted.setdefault(t.data_ptr(), t.detach().to(torch.bfloat16))
                for name, t in model.state_dict().items()}
        model.save_pretrained(tmp, state_dict=bf16, safe_serialization=True)
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = "bfloat16"          # save_pretrained writes the in-memory dtype (float32); the file is bf16
        config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_STATE)
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        _fsync_tree(tmp)
    except Exception as exc:
        # A half-written folder is never announced, but it holds up to a checkpoint's size of a disk that may be full
        shutil.rmtree(tmp, ignore_errors=True)
        free_gib = shutil.disk_usage(output_dir).free / 2**30
        raise CheckpointWriteError(f"could not write checkpoint {final} ({exc}); {free_gib:.1f} GiB free on its "
                                   "disk. Free space or choose another --output-dir, then run again with --resume"
                                   ) from exc
    os.rename(tmp, final)                 # atomic: the folder appears complete or not at all
    _fsync_tree(output_dir)
    return final


# ---------------------------------------------------------------------------------------------------------------
# The training run
# ---------------------------------------------------------------------------------------------------------------

class _Start(NamedTuple):
    """Where a run starts: its data, name and output folder, and when resuming the checkpoint and its saved state."""

    data_path: Path
    rows: list[dict]
    train_run: str
    output_dir: Path
    resume_from: tuple[int, Path] | None
    saved: dict
    start_step: int


def run(args: argparse.Namespace) -> int:
    """Train from the start point to --max-steps, saving and announcing checkpoints; returns the exit status."""
    start = _start_point(args)
    if start.start_step >= args.max_steps:
        print(f"[resume] {start.resume_from[1]} is at step {start.start_step} >= --max-steps {args.max_steps}; "
              "nothing to do", flush=True)
        return 0
    if not args.resume and checkpoints_in(start.output_dir):
        print(f"[warn] {start.output_dir} already holds checkpoints; they are kept and not re-announced. Pass "
              "--resume to continue from the latest one instead of training again from the start", flush=True)
    try:
        trigger = EvalTrigger(freq_steps=args.save_every_steps, freq_epochs=args.save_every_epochs,
                              freq_secs=args.save_every_secs)
        # final_step: the job's parent MLflow run forecasts the accuracy at the planned end (evaldag.decisions.forecast)
        notifier = CheckpointNotifier(train_run=start.train_run, api_url=args.api_url, benchmarks=args.benchmarks,
                                      spool_dir=paths.home() / "spool" / start.train_run, final_step=args.max_steps,
                                      decide="vs_best" if args.decide else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if notifier.api_url is None:
        print(f"[warn] no Prefect API URL (--api-url or PREFECT_API_URL): checkpoint events are spooled to "
              f"{notifier.spool_dir}; send them later with evaldag.client.notifier.flush_spool", flush=True)

    # Heavy imports only once the cheap checks passed.
    import torch

    from evaldag.request.config import load_benchmark

    base_model, tokenizer, model, optimizer = _load_model(args, start, trigger)
    examples = Examples(start.rows, tokenizer, load_benchmark(BENCHMARK).render_prompt, args.batch_size,
                        args.max_length, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] run {start.train_run}: {base_model} ({n_params / 1e6:.0f}M params, float32) on {len(start.rows)} "
          f"rows of {start.data_path}; steps {start.start_step + 1}..{args.max_steps}, batch {args.batch_size}, lr "
          f"{args.lr}, max_length {args.max_length}, {examples.steps_per_epoch} steps/epoch, "
          f"{torch.get_num_threads()} threads; checkpoints in {start.output_dir}", flush=True)
    return _train(args, start, base_model, tokenizer, model, optimizer, examples, trigger, notifier)


def _start_point(args: argparse.Namespace) -> _Start:
    """The data, and where training starts: from scratch, or with --resume from the latest checkpoint."""
    data_path = (args.data if args.data is not None else default_data_path()).expanduser().resolve()
    rows = load_rows(data_path)
    if len(rows) < args.batch_size:
        raise UsageError(f"{data_path} has {len(rows)} rows, fewer than --batch-size {args.batch_size}")

    output_dir = args.output_dir
    resume_from: tuple[int, Path] | None = None
    saved: dict = {}
    if args.resume:
        if output_dir is None:
            output_dir = Path("runs") / args.train_run
        existing = checkpoints_in(output_dir.expanduser())
        if existing:
            resume_from = existing[-1]
            saved = json.loads((resume_from[1] / TRAINER_STATE).read_text())
            if not (resume_from[1] / OPTIMIZER_STATE).is_file():
                raise UsageError(f"cannot resume from {resume_from[1]}: it has no {OPTIMIZER_STATE}")
        else:
            print(f"[resume] no checkpoint in {output_dir}; starting from scratch", flush=True)
    train_run = args.train_run or saved.get("train_run") or f"sft-{datetime.now():%Y%m%d-%H%M%S}"
    output_dir = (output_dir if output_dir is not None else Path("runs") / train_run).expanduser().absolute()
    return _Start(data_path, rows, train_run, output_dir, resume_from, saved, int(saved.get("step", 0)))


def _load_model(args: argparse.Namespace, start: _Start, trigger: EvalTrigger) -> tuple[str, Any, Any, Any]:
    """(base model name, tokenizer, model in float32 training mode, AdamW), from the model alias or, when
    resuming, from the checkpoint with its optimizer and trigger state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from evaldag.request.checkpoint import resolve_model

    hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    resume_from, saved = start.resume_from, start.saved
    if resume_from is not None:
        base_model = saved.get("base_model", args.model)
        load_from = resume_from[1]
    else:
        resolved = resolve_model(args.model)         # exports the default model once if needed; validates folders
        base_model, load_from = resolved.name, Path(resolved.path)
    tokenizer = AutoTokenizer.from_pretrained(load_from)
    model = AutoModelForCausalLM.from_pretrained(load_from, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if resume_from is not None:
        optimizer.load_state_dict(torch.load(load_from / OPTIMIZER_STATE, weights_only=True))
        for group in optimizer.param_groups:
            group["lr"] = args.lr                     # the command line wins over the saved learning rate
        trigger.load_state_dict(saved["trigger"])
        now = {"seed": args.seed, "batch_size": args.batch_size, "data": str(start.data_path)}
        for key, value in now.items():
            if key in saved and saved[key] != value:
                print(f"[resume] note: {key} changed from {saved[key]!r} to {value!r}; the batches differ from "
                      "those of an uninterrupted run", flush=True)
        print(f"[resume] from {load_from} at step {start.start_step} (trigger: last at step {trigger.last_step}, "
              f"{trigger.num_triggers} so far)", flush=True)
    return base_model, tokenizer, model, optimizer


def _train(args: argparse.Namespace, start: _Start, base_model: str, tokenizer: Any, model: Any, optimizer: Any,
           examples: Examples, trigger: EvalTrigger, notifier: CheckpointNotifier) -> int:
    """The training loop: a step per batch, a log line every --log-every steps, a checkpoint whenever the trigger
    is due; returns the exit status (1 when the loss stops being finite)."""
    import torch

    history: list[dict] = list(start.saved.get("log_history", []))
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "start": time.perf_counter()}
    run_start, run_tokens, saves = time.perf_counter(), 0, 0
    last_saved_step = start.resume_from[0] if start.resume_from else None
    for step in range(start.start_step, args.max_steps):
        input_ids, attention_mask, labels = examples.batch(step)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        global_step, loss_value = step + 1, loss.item()
        if not math.isfinite(loss_value):
            print(f"[train] loss is {loss_value} at step {global_step}; stopping (lower --lr?)", file=sys.stderr,
                  flush=True)
            return 1
        tokens = int(attention_mask.sum())
        window["loss"] += loss_value
        window["steps"] += 1
        window["tokens"] += tokens
        run_tokens += tokens
        epochs_done = global_step // examples.steps_per_epoch
        if global_step == start.start_step + 1 or global_step % args.log_every == 0 or global_step == args.max_steps:
            history.append(_log_window(args, window, global_step, examples.steps_per_epoch, float(grad_norm)))
            window = {"loss": 0.0, "steps": 0, "tokens": 0, "start": time.perf_counter()}

        if trigger.check(epochs_done, global_step):
            t0 = time.perf_counter()
            state = {"step": global_step, "epoch": epochs_done, "epoch_progress": global_step /
                     examples.steps_per_epoch, "loss": loss_value, "train_run": start.train_run,
                     "base_model": base_model, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
                     "max_length": args.max_length, "data": str(start.data_path), "trigger": trigger.state_dict(),
                     "trigger_reasons": list(trigger.last_reasons), "log_history": history}
            path = save_checkpoint(start.output_dir, global_step, model, tokenizer, optimizer, state)
            if path is not None:
                saves += 1
                last_saved_step = global_step
                extra = {"limit": args.eval_limit} if args.eval_limit else {}
                event_id = notifier.notify(path, global_step, epoch=epochs_done, model=base_model, **extra)
                print(f"[save] {path} ({', '.join(trigger.last_reasons)}) in {time.perf_counter() - t0:.1f} s; "
                      f"event {event_id}", flush=True)
            window["start"] += time.perf_counter() - t0     # saving time does not count against tokens/s

    _report_done(args, start, time.perf_counter() - run_start, run_tokens, saves, last_saved_step, examples)
    _report_pending(notifier)
    notifier.close()
    return 0


def _log_window(args: argparse.Namespace, window: dict, global_step: int, steps_per_epoch: int,
                grad_norm: float) -> dict:
    """The log-history entry of the steps since the last one (`window`), printed as one [train] line."""
    elapsed = time.perf_counter() - window["start"]
    entry = {"step": global_step, "epoch": round(global_step / steps_per_epoch, 4),
             "loss": round(window["loss"] / window["steps"], 6), "grad_norm": round(grad_norm, 6),
             "tokens_per_s": round(window["tokens"] / elapsed, 1),
             "s_per_step": round(elapsed / window["steps"], 3)}
    print(f"[train] step {global_step}/{args.max_steps} epoch {entry['epoch']:.2f} loss {entry['loss']:.4f} "
          f"grad_norm {entry['grad_norm']:.3f} {entry['tokens_per_s']:.0f} tokens/s "
          f"{entry['s_per_step']:.2f} s/step", flush=True)
    return entry


def _report_done(args: argparse.Namespace, start: _Start, total: float, run_tokens: int, saves: int,
                 last_saved_step: int | None, examples: Examples) -> None:
    steps_run = args.max_steps - start.start_step
    print(f"[done] {steps_run} steps in {total:.1f} s ({total / steps_run:.2f} s/step incl. saving, "
          f"{run_tokens / total:.0f} tokens/s), {saves} checkpoint(s) saved; last checkpoint: "
          f"{'step ' + str(last_saved_step) if last_saved_step is not None else 'none'}"
          + (f"; {examples.truncated} example(s) cut to --max-length {args.max_length}" if examples.truncated else ""),
          flush=True)
    if last_saved_step != args.max_steps:
        print(f"[done] note: step {args.max_steps} is not a checkpoint (no trigger was due); its weights are not saved",
              flush=True)


def _report_pending(notifier: CheckpointNotifier) -> None:
    pending = notifier.pending()
    if pending:
        print(f"[done] {len(pending)} checkpoint event(s) wait in {notifier.spool_dir}; they go out with the next "
              f"run's first checkpoint or evaldag.client.notifier.flush_spool({str(notifier.spool_dir)!r}, api_url)",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the fine-tuning; returns the exit status (0 ok, 1 training failed, 2 bad input)."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (UsageError, EvalDagError) as e:      # bad data, output folder, model alias or checkpoint folder
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except CheckpointWriteError as e:            # the checkpoints before this one are complete and announced
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())

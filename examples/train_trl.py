"""TRL's SFTTrainer with one evaldag line: every checkpoint it saves is evaluated by itself, and the accuracy lands
in the trainer's own MLflow run, beside its training loss.

1. Start the stack (`make up`) and point this shell at it: `eval "$(.venv/bin/evaldag env)"` (PREFECT_API_URL,
   MLFLOW_TRACKING_URI). Run it from the repository: its checkpoints go to ./runs, the stack's default
   EVALDAG_CHECKPOINT_ROOTS.
2. `.venv/bin/python examples/train_trl.py --train-run trl-demo --max-steps 4 --save-steps 2 --eval-limit 20`
   fine-tunes the default model (SmolLM2-135M-Instruct) on GSM8K train problems, on the CPU, with TRL's
   SFTTrainer; transformers' MLflowCallback logs the loss to MLflow (experiment `trainers`), and

       trainer.add_callback(EvaldagCallback(benchmarks=["gsm8k"], limit=20))

   announces `<output-dir>/checkpoint-<step>` at every save. Each is evaluated on GSM8K's first 20 problems; the
   accuracy is logged to the trainer's MLflow run at the checkpoint's step (`gsm8k.limit20/accuracy`).

The data is what examples/train_sft.py trains on (GSM8K rows as prompt/completion chats with the gsm8k benchmark's
instruction and a final \\boxed{N}); SFTTrainer computes the loss on the completion only. Checkpoints hold the model
only (`save_only_model`), in float32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))     # train_sft's data helpers, beside this file

from train_sft import DEFAULT_MODEL, UsageError, default_data_path, format_solution, load_rows  # noqa: E402

from evaldag.client import EvaldagCallback  # noqa: E402
from evaldag.request.rules import check_train_run  # noqa: E402

EXPERIMENT = "trainers"          # the MLflow experiment of the trainer's runs (MLFLOW_EXPERIMENT_NAME wins)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; errors name the option."""
    p = argparse.ArgumentParser(description="Short TRL SFT of the default model on GSM8K; evaldag evaluates every "
                                "checkpoint it saves.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model alias (configs/models) or a Hugging Face folder")
    p.add_argument("--data", type=Path, default=None, help=f"GSM8K-style JSONL (default: {default_data_path()})")
    p.add_argument("--rows", type=int, default=64, help="training rows taken from the top of --data")
    p.add_argument("--output-dir", type=Path, default=None, help="checkpoint folder (default: ./runs/<train-run>)")
    p.add_argument("--train-run", default=f"trl-{time.strftime('%Y%m%d-%H%M%S')}", help="the job's name")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--max-length", type=int, default=256, help="tokens per example (longer ones are cut)")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--benchmarks", default="gsm8k", help="comma-separated benchmarks to evaluate each checkpoint on")
    p.add_argument("--eval-limit", type=int, default=None, help="evaluate the first N problems only (quick slices)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rows", "max_steps", "save_steps", "batch_size", "max_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        check_train_run(args.train_run)
    except ValueError as e:
        p.error(f"--{e}".replace("train_run", "train-run", 1))
    args.benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    return args


def dataset(args: argparse.Namespace):
    """GSM8K rows as TRL's conversational prompt/completion records."""
    from datasets import Dataset

    from evaldag.request.config import load_benchmark

    render = load_benchmark("gsm8k").render_prompt       # the instruction the evaluation prompts with
    rows = load_rows(args.data or default_data_path())[:args.rows]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": render(r["question"])}],
                               "completion": [{"role": "assistant", "content": format_solution(r["answer"])}]}
                              for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Train, announcing every save; prints where the checkpoints and the MLflow run are."""
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from evaldag.request.checkpoint import resolve_model

    try:
        train = dataset(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = (args.output_dir or Path("runs") / args.train_run).resolve()
    mlflow = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    if mlflow:
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
    config = SFTConfig(output_dir=str(output), run_name=args.train_run, max_steps=args.max_steps,
                       save_steps=args.save_steps, save_only_model=True, per_device_train_batch_size=args.batch_size,
                       learning_rate=args.lr, max_length=args.max_length, logging_steps=1, seed=args.seed,
                       use_cpu=True, report_to=["mlflow"] if mlflow else [], disable_tqdm=True,
                       # TRL turns both on by default; on a CPU without bf16 instructions bf16 autocast is
                       # emulated (one step of this run took 410 s with both, under load)
                       bf16=False, gradient_checkpointing=False)
    # float32 for training (bf16 weights lose small AdamW updates to rounding), loaded here so the dtype is ours
    folder = resolve_model(args.model).path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train,
                         processing_class=AutoTokenizer.from_pretrained(folder))
    callback = EvaldagCallback(benchmarks=args.benchmarks, limit=args.eval_limit)
    trainer.add_callback(callback)                       # the one evaldag line
    t0 = time.monotonic()
    trainer.train()
    print(f"trained {trainer.state.global_step} steps in {time.monotonic() - t0:.0f} s; announced "
          f"{len(callback.announced)} checkpoint(s) of job {callback.notifier.train_run} from {output}; MLflow run "
          f"{callback.notifier.mlflow_parent_run_id or '(none: MLFLOW_TRACKING_URI is unset)'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Evaluation loss: how likely the model finds a benchmark's reference solutions, as a per-token loss.

For each problem with a reference solution (MATH-500's `solution`, GSM8K's worked `answer`, AIME 2024's
`solution`), the solution's tokens are scored after the same chat-formatted prompt the model is evaluated with,
teacher-forced, by the shard's own engine (`Engine.score`: vLLM's prompt log-probs, a transformers forward pass; the
machinery KL uses). A problem's loss is the mean negative log-likelihood per solution token; `eval_loss` is the mean
of the problems' losses, so every problem weighs the same (as in accuracy) and the jump between two checkpoints is
exactly the mean of the paired per-problem differences (evaldag.scoring.diagnostics.eval_loss_jump).

The solution is scored as the assistant's reply, without an end-of-turn token: it measures the text, not where the
model would stop. GSM8K's calculator annotations (`<<48/2=24>>`) are removed first: they are a tool format of the
dataset's authors that no chat model is trained to write, and would dominate its loss.
"""

from __future__ import annotations

import hashlib
import math
import re

import polars as pl

# Bumped whenever what is scored changes (the text's clean-up, the tokens counted): it keys the shards' loss files.
EVAL_LOSS_VERSION = 1

# One row per problem: the summed negative log-likelihood of its reference solution and the tokens it is over.
LOSS_SCHEMA: dict[str, pl.DataType] = {
    "sample_id": pl.Utf8,
    "eval_loss_nll": pl.Float64,
    "eval_loss_tokens": pl.Int64,
}

_CALCULATOR = re.compile(r"<<[^<>]*>>")


def reference_text(raw: str, gold_format: str) -> str:
    """The reference solution as the model is asked to score it: the dataset's text, with GSM8K's calculator
    annotations removed (see the module doc)."""
    text = str(raw)
    if gold_format == "gsm8k":
        text = _CALCULATOR.sub("", text)
    return text.strip()


def solutions_digest(sample_ids: list[str], solutions: list[str]) -> str:
    """16 hex digits over (version, each problem's id and reference text): what keys a shard's loss file, since the
    dataset hash of the generation key does not cover a solution column."""
    h = hashlib.sha256(f"eval_loss:{EVAL_LOSS_VERSION}\n".encode())
    for sid, text in zip(sample_ids, solutions, strict=True):
        h.update(f"{len(sid)}:{sid}{len(text)}:{text}".encode())
    return h.hexdigest()[:16]


def solution_token_ids(tokenizer, solutions: list[str]) -> list[list[int]]:
    """Each solution's token ids, as the reply after the chat template's generation prompt (no special tokens:
    the template already holds them)."""
    if not solutions:
        return []
    return [list(ids) for ids in tokenizer(solutions, add_special_tokens=False)["input_ids"]]


def score_solutions(engine, prompts: list[str], solutions: list[str]) -> list[list[float]]:
    """Per-token log-probabilities of each reference solution after its chat-formatted prompt, by `engine` (one
    that has a tokenizer and `score`: the vllm and hf engines). Raises ValueError for an engine without them."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not callable(getattr(engine, "score", None)):
        raise ValueError(f"engine {type(engine).__name__} cannot score given text (no local tokenizer or score); "
                         "eval_loss needs engine vllm or hf")
    return engine.score(prompts, solution_token_ids(tokenizer, solutions))


def per_problem_losses(sample_ids: list[str], logprobs: list[list[float]]) -> pl.DataFrame:
    """LOSS_SCHEMA rows from each problem's per-token log-probabilities (a problem with no token: nll 0, 0 tokens,
    left out of the metrics)."""
    if len(sample_ids) != len(logprobs):
        raise ValueError(f"{len(sample_ids)} problems but {len(logprobs)} scored solutions")
    return pl.DataFrame({"sample_id": sample_ids,
                         "eval_loss_nll": [-math.fsum(lp) for lp in logprobs],
                         "eval_loss_tokens": [len(lp) for lp in logprobs]}, schema=LOSS_SCHEMA)


def with_loss(losses: pl.DataFrame) -> pl.DataFrame:
    """`losses` (LOSS_SCHEMA) with each problem's `eval_loss`: mean nll per token; null where it has no token."""
    return losses.with_columns(eval_loss=pl.when(pl.col("eval_loss_tokens") > 0)
                               .then(pl.col("eval_loss_nll") / pl.col("eval_loss_tokens")))


def eval_loss_metrics(losses: pl.DataFrame) -> dict[str, float]:
    """The evaluation's figures from its per-problem losses (LOSS_SCHEMA, one row per problem):

    - eval_loss: the mean over problems of each one's mean nll per token (see the module doc);
    - eval_loss_se: its standard error over problems (sample std / sqrt(problems); absent with one problem);
    - eval_loss/token_weighted: total nll / total tokens, the loss a trainer's evaluation loop reports;
    - eval_loss_problems, eval_loss_tokens: what it is over.
    Raises ValueError when no problem has a scored token.
    """
    dup = losses.filter(pl.col("sample_id").is_duplicated())
    if dup.height:
        raise ValueError(f"eval_loss: problems {dup['sample_id'].unique().sort().to_list()[:3]} appear more than once")
    per = with_loss(losses).filter(pl.col("eval_loss").is_not_null())
    if per.height == 0:
        raise ValueError("eval_loss: no problem has a scored reference token")
    out = {"eval_loss": float(per["eval_loss"].mean()),
           "eval_loss/token_weighted": float(per["eval_loss_nll"].sum() / per["eval_loss_tokens"].sum()),
           "eval_loss_problems": float(per.height), "eval_loss_tokens": float(per["eval_loss_tokens"].sum())}
    if per.height > 1:
        out["eval_loss_se"] = float(per["eval_loss"].std(ddof=1) / math.sqrt(per.height))
    return out


__all__ = ["EVAL_LOSS_VERSION", "LOSS_SCHEMA", "eval_loss_metrics", "per_problem_losses", "reference_text",
           "score_solutions", "solution_token_ids", "solutions_digest", "with_loss"]

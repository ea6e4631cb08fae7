"""Adaptive samples in the flows: the second round's plan (the request's checks: evaldag.request.adaptive_rules).

An adaptive evaluation (the request's `adaptive`, evaldag.decisions.adaptive) runs in two rounds:
1. Its plan (evaldag.request.plan.resolve) is the first round: n0 samples of every problem, a plain generation that a
   fixed n = n0 evaluation with the same shards shares row for row.
2. Once that round is graded, the parent flow calls `resolve_second_round`: the adaptive design gives each problem
   its further samples n0 .. n0 + more - 1 (only the floor where the first round was all right or all wrong), and
   they become a plan of their own, in a folder inside the evaluation's, whose shards hold runs (first sample index,
   count) of problems as split shards do (evaldag.request.sharding.plan_split_shards).

vLLM seeds sample j of a problem `seed + j`, so the second round draws exactly the samples a fixed-n evaluation
would draw at those indices; that is also why only vLLM can run it. The second round's plan depends on the first
round's graded rows alone, which are kept: a retried evaluation makes the same plan again and finds its
generations where the first attempt left them.
"""

from __future__ import annotations

import polars as pl
from upath import UPath

from evaldag.decisions.adaptive import AdaptiveSettings, counts_from_samples, next_round
from evaldag.request.plan import EvalPlan, compute_eval_key, load_plan
from evaldag.request.sharding import MIN_SEQUENCES_PER_SHARD, ranked_ids
from evaldag.storage import store
from evaldag.storage.schema import INPUT_SCHEMA, write_table

ROUND_FOLDER = "round-2"


def plan_runs(more: list[tuple[str, int]], num_shards: int, first: int) -> tuple[list[list[str]],
                                                                                 list[list[tuple[int, int]]]]:
    """Shards of a second round: each problem's `more` samples (indices first .. first + more - 1) cut into
    min(more, num_shards) near-equal runs, dealt round-robin with one cursor across problems, so every shard gets
    about total / num_shards samples and a problem's long completions spread over shards. Empty shards are dropped."""
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    runs: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]
    cursor = 0
    for sid, count in more:
        if count <= 0:
            continue
        pieces = min(count, num_shards)
        size, extra = divmod(count, pieces)
        start = first
        for j in range(pieces):
            n = size + (j < extra)
            shards[cursor % num_shards].append(sid)
            runs[cursor % num_shards].append((start, n))
            start += n
            cursor += 1
    kept = [s for s in range(num_shards) if shards[s]]
    return [shards[s] for s in kept], [runs[s] for s in kept]


def second_round_path(plan: EvalPlan) -> UPath:
    """Where the second round's plan.json of an adaptive evaluation lives (inside the evaluation's folder)."""
    return plan.path(f"{ROUND_FOLDER}/plan.json")


def resolve_second_round(plan: EvalPlan, first_round: pl.DataFrame) -> EvalPlan | None:
    """The second round's plan of the adaptive evaluation `plan`, written beside it, from the first round's graded
    rows (sample_id, sample_index, correct); None when the design draws nothing more (e.g. a floor of 0 and every
    problem all right or all wrong). Raises ValueError when the rows are not exactly the first round."""
    settings: AdaptiveSettings = plan.request.adaptive
    n0 = settings.n0
    rows = first_round.filter(pl.col("sample_index") < n0)
    try:
        counts = counts_from_samples(rows, n0)
    except ValueError as e:
        raise ValueError(f"the first round of {plan.benchmark.name}: {e}; a shard's graded file is missing or from "
                         "another evaluation") from None
    if set(counts["sample_id"]) != set(plan.sample_ids()) or (counts["n"] != n0).any():
        raise ValueError(f"the first round of {plan.benchmark.name} holds {counts.height} problems with "
                         f"{sorted(set(counts['n'].to_list()))} samples each; the plan has {plan.n_problems} other "
                         f"or more problems with n0={n0}: a shard's graded file is missing or from another "
                         "evaluation")
    more = dict(next_round(counts, settings).select("sample_id", "more").iter_rows())
    total = sum(more.values())
    if total == 0:
        # a plan an earlier attempt made from other first-round rows (regenerated since) must not be reduced with
        second_round_path(plan).unlink(missing_ok=True)
        return None
    ordered = [(sid, more[sid]) for sid in ranked_ids(plan.inputs()) if more.get(sid, 0) > 0]
    num_shards = max(1, min(plan.num_shards, total // MIN_SEQUENCES_PER_SHARD))
    shards, runs = plan_runs(ordered, num_shards, n0)
    generation_key = compute_eval_key({"second_round_of": plan.generation_key, "shards": shards, "sample_runs": runs})
    stage_root = store.as_path(plan.stage_dir).parent
    second = plan.model_copy(update={
        "eval_key": compute_eval_key({"second_round_of": plan.eval_key}), "round": 2,
        "num_shards": len(shards), "shards": shards, "sample_runs": runs,
        "generation_key": generation_key,
        "grade_key": compute_eval_key({"generation": generation_key, "first_round_grade": plan.grade_key}),
        "result_dir": str(store.as_path(plan.result_dir) / ROUND_FOLDER),
        "stage_dir": str(stage_root / f"gen-{generation_key[:24]}"),
    })
    write_table(plan.inputs(), second.path("inputs.parquet"), INPUT_SCHEMA)
    path = store.write_text(second_round_path(plan), second.model_dump_json(indent=2))
    return load_plan(path)


__all__ = ["ROUND_FOLDER", "plan_runs", "resolve_second_round", "second_round_path"]

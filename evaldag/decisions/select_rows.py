"""A selection's rows in the result store: the reads and writes around evaldag.decisions.select, which is pure.

Each checkpoint of a selection has an evaluation plan asking decide="select" (`select_request`). Its generation key
is a full evaluation's on vLLM (on a static-batch engine it is decide's, whose batches follow the decision order:
evaldag.request.plan), so every row generated earlier for the checkpoint (a full evaluation, one stopped early, an
earlier selection) is in its stage folder and counts. Its shards generate in the shared problem order
(evaldag.decisions.decide.decision_order: a hash of the seed and each problem's id, the same for every checkpoint
of the benchmark) and only the prefix the selection names before it launches them (`ask_prefix`: decide's stop
file, which a shard reads when it starts). `CheckpointRows` reads a checkpoint's rows back, grades each once, and
gives select_step the per-problem scores of the longest complete prefix of that order; `summarize` turns the
Selection into what is logged and printed, every figure re-derivable from the rows it names.
"""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl

from evaldag.decisions.decide import decision_order, stop_path, stopped_problems, ungated_path
from evaldag.decisions.select import Selection
from evaldag.request.plan import EvalPlan, EvalRequest
from evaldag.storage import store
from evaldag.storage.schema import GENERATION_SCHEMA, GRADED_SCHEMA, read_table

SELECT_MODE = "select"
_KEYS = ["sample_id", "sample_index"]
_KEPT = [*_KEYS, "correct", "completion_tokens"]


def select_request(benchmark: str, checkpoint: str, step: int, train_run: str, **settings: object) -> EvalRequest:
    """The evaluation request of one checkpoint of a selection: decide="select" (its own result folder, its
    shards generating in the decision order up to the prefix asked), and the settings every checkpoint shares
    (limit, num_shards, sampling, engine), which must be those of the evaluations whose rows it should reuse."""
    return EvalRequest.parse(benchmark=benchmark, checkpoint=checkpoint, step=step, train_run=train_run,
                             decide=SELECT_MODE, **settings)


def ask_prefix(plan: EvalPlan, problems: int) -> int:
    """Ask the plan's shards (launched next) to generate the first `problems` problems of the decision order, and
    no more; returns the prefix asked. It never shrinks: a concurrent selection of the same checkpoint asking less
    must not cut short what another asked for. The round gate of stopping early is lifted: the prefix is known."""
    asked = max(problems, stopped_problems(plan) or 0)
    store.write_text(ungated_path(plan), json.dumps({"select": True}))
    store.write_text(stop_path(plan), json.dumps({"problems": asked}))
    return asked


class CheckpointRows:
    """One checkpoint's rows in the store, graded once each (a graded file of a full evaluation as it is; the
    generations or chunks of others graded here), and what they are worth to a selection."""

    def __init__(self, label: str, plan: EvalPlan) -> None:
        self.label, self.plan = label, plan
        self.order = decision_order(plan.sample_ids(), plan.sampling.seed)
        self._files: dict[str, pl.DataFrame] = {}       # a file's graded rows (a written file never changes)
        self.rows = pl.DataFrame(schema={k: GRADED_SCHEMA[k] for k in _KEPT})
        self.refresh()
        self._found = self.rows.select(_KEYS)         # rows there before the selection: reused, not generated

    def _sources(self) -> list[tuple[object, bool]]:
        """(file, graded) of every row of the plan's stage folder: a shard's graded file, else its generations,
        else its chunks."""
        out: list[tuple[object, bool]] = []
        for s in range(self.plan.num_shards):
            graded, gens = self.plan.graded_path(s), self.plan.generations_path(s)
            if graded.is_file():
                out.append((graded, True))
            elif gens.is_file():
                out.append((gens, False))
            else:
                out.extend((p, False) for p in store.chunk_files(store.chunks_dir(gens)))
        return out

    def refresh(self) -> None:
        """Read (and grade) the rows written since the last call."""
        from evaldag.pipeline.grade import grade_rows

        frames = []
        for path, graded in self._sources():
            key = str(path)
            if key not in self._files:
                try:
                    table = read_table(path, GRADED_SCHEMA if graded else GENERATION_SCHEMA)
                except FileNotFoundError:      # merged and removed since the listing: read next time
                    continue
                self._files[key] = (table if graded else grade_rows(self.plan, table)).select(_KEPT)
            frames.append(self._files[key])
        if frames:
            self.rows = pl.concat(frames).unique(_KEYS, keep="first", maintain_order=True)

    def scores(self) -> np.ndarray:
        """Per-problem mean correctness over the longest prefix of the decision order whose problems have all n
        samples (what select_step reads)."""
        n = self.plan.sampling.n
        per = self.rows.group_by("sample_id").agg(pl.col("correct").fill_null(False).cast(pl.Int64).sum()
                                                  .alias("right"), pl.len().alias("known"))
        right = dict(zip(per["sample_id"].to_list(), per["right"].to_list()))
        known = dict(zip(per["sample_id"].to_list(), per["known"].to_list()))
        out = []
        for sid in self.order:
            if known.get(sid, 0) < n:
                break
            out.append(right[sid] / n)
        return np.asarray(out, dtype=np.float64)

    def tokens(self, problems: int) -> dict[str, int]:
        """Completion tokens: generated during this selection, found already (reused), and a full evaluation's
        estimate (those that exist, and for the missing samples the mean of the first `problems` problems of the
        order: a random sample of them, unlike whichever rows happen to exist)."""
        rows = self.rows
        reused = int(rows.join(self._found, on=_KEYS, how="semi")["completion_tokens"].sum() or 0)
        total = int(rows["completion_tokens"].sum() or 0)
        prefix = rows.filter(pl.col("sample_id").is_in(self.order[:problems]))
        per_sample = float(prefix["completion_tokens"].mean() or 0.0) if prefix.height else 0.0
        missing = max(0, len(self.order) * self.plan.sampling.n - rows.height)
        return {"generated": total - reused, "reused": reused, "full_est": round(total + per_sample * missing)}


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def summarize(sel: Selection, rows: dict[str, CheckpointRows], steps: dict[str, int], train_run: str,
              wall_s: float) -> dict:
    """The selection as data (JSON: the flow's result, the MLflow table, the CLI's output): status, the chosen
    step and the set, each checkpoint's elimination round and interval, the tokens, and the rows each was decided
    on (its stage folder and problem count: `scores()[:problems]` of those rows replays it)."""
    read = {r.checkpoint: r for r in sel.records}
    checkpoints, seen, tokens = [], set(), {"generated": 0, "reused": 0, "full_est": 0}
    for label, r in rows.items():
        rec = read[label]
        spent = r.tokens(max(sel.look, 1))
        if r.plan.stage_dir not in seen:          # identical weights share one generation: counted once
            seen.add(r.plan.stage_dir)
            tokens = {k: tokens[k] + spent[k] for k in tokens}
        checkpoints.append({
            "label": label, "step": steps[label], "checkpoint": r.plan.model.path, "in_set": label in sel.chosen,
            "problems": rec.problems, "mean": _finite(rec.mean), "dropped_round": rec.dropped_round,
            "dropped_at": rec.dropped_at, "vs": rec.vs, "diff": _finite(rec.diff), "ci_low": _finite(rec.ci_low),
            "ci_high": _finite(rec.ci_high), "settled_at": rec.settled_at, "plan": str(r.plan.path("plan.json")), "rows": r.plan.stage_dir,
            "generation_key": r.plan.generation_key,
            "rows_available": r.rows.height, "tokens": spent})
    first = next(iter(rows.values())).plan
    return {"train_run": train_run, "benchmark": first.benchmark.name, "status": sel.status, "best": sel.best,
            "best_step": steps[sel.best] if sel.status == "best" else None,
            "set": [steps[c] for c in sel.chosen], "settled": [steps[c] for c in sel.settled],
            "reason": sel.reason, "alpha": sel.alpha, "margin": sel.margin,
            "looks": list(sel.looks), "look": sel.look, "n_problems": len(rows[sel.best].order),
            "n": first.sampling.n, "seed": first.sampling.seed, "checkpoints": checkpoints, "tokens": tokens,
            "tokens_ratio": tokens["generated"] / tokens["full_est"] if tokens["full_est"] else None,
            "wall_s": wall_s}


__all__ = ["CheckpointRows", "SELECT_MODE", "ask_prefix", "select_request", "summarize"]

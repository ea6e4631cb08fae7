"""Sequential stopping: end an evaluation's generation as soon as its paired verdict against the job's best
checkpoint so far is decided (the request's `decide="vs_best"`).

How it stays valid. The problems are put in one seeded random order (`decision_order`, fixed before any result and
the same on every shard), and every shard submits its requests in that order, few at a time (`in_flight`), so that
problems finish roughly in it. The parent reads the rows the shards make durable (their chunks) and uses only the
longest *prefix* of the order whose problems are all generated: finished problems are a biased sample (short answers
finish first), a prefix of a random order is not. At the end of each round (`round_ends`: `rounds` equal steps of
the problems) it reads the repeated confidence interval of the paired difference over that prefix
(evaldag.decisions.sequential: one boundary for all the round ends, planned before any result) and stops at the
first round whose verdict is decided. Reading the verdict only at round ends is what keeps its error rate at alpha,
and makes a stopped evaluation reproducible: its metrics are those of exactly the first `problems` problems of the
order, whenever the polls happened.

What is kept. The rows generated before the stop (the prefix and whatever else finished) stay in the shards' chunks,
under the generation key, which `decide` is not part of: a later full evaluation of the same checkpoint resumes from
them and generates only the rest. The stopped evaluation's own files (graded prefix, decision) live in its result
folder, whose eval_key holds the decide settings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl
from upath import UPath

from evaldag.storage import store
from evaldag.request.plan import EvalPlan
from evaldag.storage.schema import GENERATION_SCHEMA, GRADED_SCHEMA, read_table, write_table
from evaldag.decisions.pacing import RoundGate, pace_sample, worth_gating
from evaldag.decisions.reach import reach
from evaldag.decisions.sequential import boundaries, selection_bounds, sequential_verdict

# Sequences (one request each) a shard keeps in its engine at once when the evaluation may stop early. Default: the
# model's batch_size x n, what a full evaluation holds. Scheduling only: the rows do not depend on it (seeds are per
# sample).
IN_FLIGHT_ENV = "EVALDAG_DECIDE_IN_FLIGHT"
# How often the parent reads the shards' chunks while they generate.
POLL_S_ENV, POLL_S = "EVALDAG_DECIDE_POLL_S", 10.0


def decision_order(sample_ids: list[str], seed: int) -> list[str]:
    """The problems in a random order fixed by `seed` alone (a hash per id, so every shard agrees on it and a
    problem's rank does not depend on which others are in the evaluation)."""
    def rank(sid: str) -> bytes:
        return hashlib.sha256(f"{seed}:decide:{sid}".encode()).digest()

    return sorted(dict.fromkeys(sample_ids), key=rank)


def round_ends(n_problems: int, rounds: int) -> list[int]:
    """Prefix lengths at which the verdict is read: `rounds` near-equal steps of the problems, the last one all."""
    rounds = max(1, min(rounds, n_problems))
    return sorted({math.ceil(n_problems * r / rounds) for r in range(1, rounds + 1)})


def in_flight(plan: EvalPlan, environ: dict | None = None) -> int | None:
    """Requests (a sample each) a shard keeps in its engine at once: None (all) unless the plan may stop early;
    then $EVALDAG_DECIDE_IN_FLIGHT, default the model's batch_size x n. Raises ValueError naming a bad value."""
    if plan.request.decide is None:
        return None
    raw = (os.environ if environ is None else environ).get(IN_FLIGHT_ENV, "").strip()
    try:
        value = int(raw) if raw else plan.model.batch_size * plan.sampling.n
    except ValueError:
        raise ValueError(f"{IN_FLIGHT_ENV}={raw!r} is not an integer (requests in flight per shard)") from None
    if value < 1:
        raise ValueError(f"{IN_FLIGHT_ENV} must be >= 1, got {value}")
    return value


def poll_seconds(environ: dict | None = None) -> float:
    """$EVALDAG_DECIDE_POLL_S (default POLL_S): how often the parent reads the shards' chunks."""
    raw = (os.environ if environ is None else environ).get(POLL_S_ENV, "").strip()
    value = float(raw) if raw else POLL_S
    if value <= 0:
        raise ValueError(f"{POLL_S_ENV} must be > 0, got {value}")
    return value


# ---- the files of a decision, in the evaluation's own folder --------------------------------------------------

def stop_path(plan: EvalPlan) -> UPath:
    """Written by the parent when the verdict is decided; the plan's shards stop generating when they see it."""
    return plan.path("decide/stop")


def ungated_path(plan: EvalPlan) -> UPath:
    """Written by the parent when no verdict is in sight within the gated rounds (worth_gating): the shards drop
    their round gate."""
    return plan.path("decide/ungated")


def ungated(plan: EvalPlan) -> bool:
    """Whether the parent told this evaluation's shards to drop their round gate."""
    return plan.request.decide is not None and ungated_path(plan).is_file()


def decision_path(plan: EvalPlan) -> UPath:
    return plan.path("decide/decision.json")


def withdrawn_path(plan: EvalPlan, shard: int, attempt: str) -> UPath:
    """Written by a shard's attempt once it withdrew requests at the stop: the tokens they had generated, which no
    row holds (the engine counts them at the abort)."""
    return plan.path(f"decide/withdrawn-{shard}-{attempt}.json")


def record_withdrawn(plan: EvalPlan, shard: int, attempt: str, tokens: int) -> None:
    """Keep the tokens of the requests shard `shard`'s attempt `attempt` withdrew so far (the total, rewritten)."""
    store.write_json(withdrawn_path(plan, shard, attempt), {"tokens": int(tokens)})


def withdrawn_tokens(plan: EvalPlan) -> int:
    """The tokens every shard attempt of this evaluation generated for requests it then withdrew."""
    folder = plan.path("decide")
    if not folder.is_dir():
        return 0
    total = 0
    for path in folder.glob("withdrawn-*.json"):
        try:
            total += int(store.read_json(path)["tokens"])
        except FileNotFoundError:
            continue
    return total


def graded_prefix_path(plan: EvalPlan) -> UPath:
    """The graded rows of the problems the stopped evaluation's metrics are over."""
    return plan.path("decide/graded-prefix.parquet")


def stop_requested(plan: EvalPlan) -> bool:
    """Whether the parent has decided this evaluation and asked its shards to stop."""
    return plan.request.decide is not None and stop_path(plan).is_file()


def stopped_problems(plan: EvalPlan) -> int | None:
    """The number of problems of the decision order whose verdict stopped the evaluation (the shards finish those
    and withdraw the rest), or None while it goes on."""
    if not stop_requested(plan):
        return None
    try:
        return int(store.read_json(stop_path(plan))["problems"])
    except FileNotFoundError:
        return None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{stop_path(plan)} names no number of problems ({e}); it is written by the evaluation's "
                         "parent flow: delete it to let the evaluation decide again") from None


def stopped_prefix(plan: EvalPlan) -> set[str] | None:
    """The sample ids a stopped evaluation's shards still generate (its decided prefix), or None while it goes on."""
    end = stopped_problems(plan)
    return None if end is None else set(decision_order(plan.sample_ids(), plan.sampling.seed)[:end])


@dataclass
class Decision:
    """The state of a sequential comparison, as logged to MLflow and kept in decision.json."""

    status: str                 # stopped / completed (never decided early) / no_incumbent
    verdict: str = "undecided"  # better / worse / equivalent / undecided, at `problems`
    vs: str = ""                # JOB@STEP of the incumbent
    problems: int = 0           # problems the verdict (and a stopped evaluation's metrics) is over
    n_problems: int = 0         # problems of the full evaluation
    pairs: int = 0              # of those, the ones the incumbent also has
    diff: float = float("nan")
    ci_low: float = -1.0
    ci_high: float = 1.0
    alpha: float = 0.05
    margin: float = 0.02
    tokens_generated: int = 0   # in the rows generated for this evaluation (rows beyond the prefix included: kept)
    tokens_reused: int = 0      # found in the result store when it started (an earlier evaluation's rows)
    tokens_full_est: int = 0    # the full evaluation's tokens: those that exist, the prefix's mean for the rest
    prefix: list[str] = field(default_factory=list)
    tokens_withdrawn: int = 0   # generated by requests withdrawn at the stop: spent, in no row (withdrawn_tokens)
    note: str = ""              # what these settings cannot decide on this benchmark (evaldag.decisions.reach)

    @property
    def stopped(self) -> bool:
        return self.status == "stopped"

    def metrics(self) -> dict[str, float]:
        """Numeric figures for the MLflow run (`decide.*`)."""
        out = {"decide.stopped": float(self.stopped), "decide.problems": float(self.problems),
               "decide.n_problems": float(self.n_problems), "decide.pairs": float(self.pairs),
               "decide.alpha": self.alpha, "decide.margin": self.margin}
        if self.pairs:
            out.update({"decide.diff": self.diff, "decide.ci_low": self.ci_low, "decide.ci_high": self.ci_high})
        if self.stopped:
            out.update({"decide.tokens_generated": float(self.tokens_spent),
                        "decide.tokens_withdrawn": float(self.tokens_withdrawn),
                        "decide.tokens_reused": float(self.tokens_reused),
                        "decide.tokens_saved_est": float(self.tokens_saved_est)})
        return out

    @property
    def tokens_spent(self) -> int:
        """Tokens generated for this evaluation: those of its rows and those of the requests withdrawn at the stop
        (the metric `decide.tokens_generated`)."""
        return self.tokens_generated + self.tokens_withdrawn

    @property
    def tokens_saved_est(self) -> int:
        """Tokens a full evaluation would still have generated: its estimated total less what exists now and what
        the withdrawn requests had generated (their samples are among the missing ones the estimate counts)."""
        return max(0, self.tokens_full_est - self.tokens_spent - self.tokens_reused)

    def tags(self) -> dict[str, str]:
        tags = {"decide.status": self.status, "decide.verdict": self.verdict, "decide.vs": self.vs}
        if self.note:
            tags["decide.note"] = self.note[:5000]          # MLflow's limit on a tag's value
        return tags

    def describe(self) -> str:
        """One line for people (evaldag run, the Prefect artifact, the log)."""
        if self.status == "no_incumbent":
            text = "decide vs best: no earlier evaluation of this job to compare with; evaluated in full"
            return f"{text}. {self.note}" if self.note else text
        text = (f"decide vs best ({self.vs}): {self.verdict} after {self.problems} of {self.n_problems} problems "
                f"({self.pairs} paired")
        if self.pairs:
            text += f", {self.diff * 100:+.1f} points [{self.ci_low * 100:+.1f}, {self.ci_high * 100:+.1f}]"
        text += f", alpha {self.alpha:g}, margin {self.margin:g})"
        if self.stopped:
            text += f"; stopped early, about {self.tokens_saved_est} of {self.tokens_full_est} tokens saved"
            if self.tokens_reused:
                text += f" ({self.tokens_reused} found already generated)"
        return f"{text}. {self.note}" if self.note else text

    def save(self, plan: EvalPlan) -> None:
        store.write_json(decision_path(plan), asdict(self))

    @classmethod
    def load(cls, plan: EvalPlan) -> "Decision | None":
        """The saved decision, with the tokens of withdrawn requests as the shards have recorded them by now (a
        shard may record them after the decision was made final)."""
        path = decision_path(plan)
        if not path.is_file():
            return None
        decision = cls(**store.read_json(path))
        decision.tokens_withdrawn = max(decision.tokens_withdrawn, withdrawn_tokens(plan))
        return decision


# ---- the parent's side ------------------------------------------------------------------------------------------

class Decider:
    """Reads the shards' durable rows as they come, grades them, and decides at the ends of rounds. `incumbent`:
    sample_id and score (per-problem mean correctness) of the evaluation compared with, or a list of them: every
    candidate for the job's best (evaldag.tracking.incumbent), labelled `vs` (the one of highest accuracy). Against
    k candidates the verdict is about the best of them, with the selection accounted for
    (evaldag.decisions.sequential.selection_bounds: lower bounds at alpha, upper bounds at alpha / k), on the
    problems every candidate has. Grading is `grade(rows) -> graded rows` (evaldag.pipeline.grade.grade_rows with
    the plan's settings).

    A verdict does not wait for the longest answers: every problem of a round is counted with the samples that
    finished, each unfinished one bounded by its extremes (right or wrong), and the round decides when the
    round's interval over those ranges does (evaldag.decisions.sequential: it contains the one the complete
    rows will give). Then the stop file names the round's prefix: the shards withdraw every other request and
    finish the prefix's own, and the decision is made final on the complete prefix (poll returns it)."""

    def __init__(self, plan: EvalPlan, incumbent: pl.DataFrame | list[pl.DataFrame], vs: str, grade) -> None:
        alpha, margin, rounds = plan.decide_settings
        self.plan, self.vs, self._grade = plan, vs, grade
        self.alpha, self.margin = alpha, margin
        self.order = decision_order(plan.sample_ids(), plan.sampling.seed)
        self.ends = round_ends(len(self.order), rounds)
        frames = [incumbent] if isinstance(incumbent, pl.DataFrame) else list(incumbent)
        if not frames:
            raise ValueError("no earlier evaluation to compare with: a Decider needs one or more")
        self.incumbents = [dict(zip(f["sample_id"].to_list(), f["score"].to_list())) for f in frames]
        # paired: the problems every candidate has (their differences then share one planned look list)
        self.paired = [sid for sid in self.order if all(sid in c for c in self.incumbents)]
        paired = set(self.paired)
        # the planned looks: paired problems at each round end, fixed before any result
        at = np.cumsum([sid in paired for sid in self.order]) if self.order else np.zeros(0, dtype=int)
        self._paired_at = {end: int(at[end - 1]) for end in self.ends}
        self.looks = tuple(sorted({t for t in self._paired_at.values() if t > 0}))
        # the boundaries every look reads, lower and upper (none without a paired problem: no look then decides)
        self.z, self.z_k = boundaries(self.looks, alpha, len(frames)) if self.looks else (math.inf, math.inf)
        # what these looks cannot decide against these candidates, said before anything is generated
        self.note = reach(self.looks, alpha, margin, len(frames), plan.sampling.n).statement(plan.benchmark.name,
                                                                                             rounds) or ""
        self._chunks: dict[str, pl.DataFrame] = {}      # chunk path -> rows (a chunk never changes once written)
        self._graded: list[pl.DataFrame] = []
        self._right: dict[str, int] = {}                 # correct samples so far, per problem
        self._known: dict[str, int] = {}                 # graded samples so far, per problem
        # a stop an earlier attempt of this evaluation wrote: its prefix is the one the shards finish
        self.stopped_at: int | None = stopped_problems(plan)
        self._ungated = ungated(plan)
        # rows already in the store (an earlier evaluation's): reused, not generated for this one
        self._reused = self._rows().select("sample_id", "sample_index", "shard_index").unique()

    def _rows(self) -> pl.DataFrame:
        """Every row the shards have made durable: their chunks, or their merged generations once complete."""
        frames = []
        for s in range(self.plan.num_shards):
            out = self.plan.generations_path(s)
            paths = [out] if out.is_file() else store.chunk_files(store.chunks_dir(out))
            for p in paths:
                key = str(p)
                if key not in self._chunks:
                    try:
                        self._chunks[key] = read_table(p, GENERATION_SCHEMA)
                    except FileNotFoundError:   # merged and removed since the listing: read next time
                        continue
                frames.append(self._chunks[key])
        return pl.concat(frames) if frames else pl.DataFrame(schema=GENERATION_SCHEMA)

    def _grade_new(self, rows: pl.DataFrame) -> None:
        """Grade the rows not graded yet (each sample once, whichever copy came first)."""
        keys = ["sample_id", "sample_index"]
        fresh = rows.unique(keys, keep="first", maintain_order=True)
        if self._graded:
            fresh = fresh.join(pl.concat([g.select(keys) for g in self._graded]), on=keys, how="anti")
        if not fresh.height:
            return
        graded = self._grade(fresh)
        self._graded.append(graded)
        for sid, correct in graded.select("sample_id", "correct").iter_rows():
            self._known[sid] = self._known.get(sid, 0) + 1
            self._right[sid] = self._right.get(sid, 0) + int(bool(correct))

    def _complete_prefix(self) -> int:
        n = self.plan.sampling.n
        length = 0
        for sid in self.order:
            if self._known.get(sid, 0) < n:
                break
            length += 1
        return length

    def _ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Each paired problem's difference to each candidate (k, paired), in the decision order, as a range: its
        unfinished samples all wrong, all right (equal once every sample is in)."""
        n = self.plan.sampling.n
        right = np.array([self._right.get(sid, 0) for sid in self.paired], dtype=np.float64)
        unknown = np.array([n - self._known.get(sid, 0) for sid in self.paired], dtype=np.float64)
        score = np.array([[c[sid] for sid in self.paired] for c in self.incumbents], dtype=np.float64)
        score = score.reshape(len(self.incumbents), len(self.paired))
        return right / n - score, (right + unknown) / n - score

    def _decided_end(self, low_d: np.ndarray, high_d: np.ndarray) -> int | None:
        """The first round end (before the last) whose verdict is decided whatever the unfinished samples of its
        problems turn out to be (their ranges `low_d`..`high_d`, one row per candidate), or None."""
        for end in self.ends[:-1]:
            t = self._paired_at[end]
            if not t:
                continue
            bounds = selection_bounds(list(low_d[:, :t]), self.z, self.z_k, list(high_d[:, :t]))
            if bounds.verdicts(self.margin)[0] != "undecided":
                return end
        return None

    def _pace(self, low_d: np.ndarray, high_d: np.ndarray) -> None:
        """Tell the shards to drop the round gate once no verdict is in sight within the gated rounds."""
        if self._ungated:
            return
        # pacing reads the candidate the new checkpoint looks worst against (the one that sets the upper bound)
        j = int(np.argmin(low_d.sum(axis=1))) if low_d.size else 0
        d = pace_sample(low_d[j], high_d[j], list(self.looks))
        if not d.size:
            return          # no round's worth yet
        gated_end = self.ends[min(len(self.ends), RoundGate([], len(self.ends)).gated) - 1]
        if not worth_gating(d, self._paired_at[gated_end], self.alpha, self.margin, self.z):
            self._ungated = True
            store.write_text(ungated_path(self.plan), json.dumps({"read_problems": int(d.size)}))

    def poll(self) -> Decision | None:
        """Read and grade what is new. Once a round is decided, ask the shards to stop (the stop file); once that
        round's prefix is complete, return the final decision (kept with the prefix's graded rows), else None."""
        rows = self._rows()
        self._grade_new(rows)
        if self.stopped_at is None:
            ranges = self._ranges()
            end = self._decided_end(*ranges)
            if end is None:
                self._pace(*ranges)
                return None
            self.stopped_at = end
            store.write_text(stop_path(self.plan), json.dumps({"problems": end}))
        if self._complete_prefix() < self.stopped_at:
            return None
        decision = self._decision(self.stopped_at, rows)
        write_table(self.graded_prefix(decision), graded_prefix_path(self.plan), GRADED_SCHEMA)
        decision.save(self.plan)
        return decision

    def _decision(self, end: int, rows: pl.DataFrame, status: str = "stopped") -> Decision:
        prefix = self.order[:end]
        n = self.plan.sampling.n
        in_prefix_ids = set(prefix)
        ds = [np.array([self._right[sid] / n - c[sid] for sid in self.paired if sid in in_prefix_ids])
              for c in self.incumbents]
        v = sequential_verdict(ds, self.looks, self.alpha, self.margin)
        keys = ["sample_id", "sample_index", "shard_index"]
        rows = rows.unique(keys)
        generated = int(rows.join(self._reused, on=keys, how="anti")["completion_tokens"].sum() or 0)
        reused = int(rows.join(self._reused, on=keys, how="semi")["completion_tokens"].sum() or 0)
        # the full evaluation's tokens: those of the samples that exist, and for the others the prefix's mean (a
        # random sample of the problems, unlike the finished ones)
        in_prefix = rows.filter(pl.col("sample_id").is_in(prefix))
        per_sample = float(in_prefix["completion_tokens"].mean() or 0.0) if in_prefix.height else 0.0
        missing = max(0, len(self.order) * n - rows.unique(["sample_id", "sample_index"]).height)
        return Decision(status, v.verdict, self.vs, end, len(self.order), int(ds[0].size), v.mean, v.ci_low,
                        v.ci_high, self.alpha, self.margin, generated, reused,
                        round(generated + reused + per_sample * missing), prefix, withdrawn_tokens(self.plan),
                        self.note)

    def graded_prefix(self, decision: Decision) -> pl.DataFrame:
        """The graded rows of the decision's prefix, each (sample, index) once."""
        graded = pl.concat(self._graded) if self._graded else pl.DataFrame(schema=GRADED_SCHEMA)
        return graded.filter(pl.col("sample_id").is_in(decision.prefix))

    def final(self, samples: pl.DataFrame) -> Decision:
        """The decision of an evaluation that ran to the end without stopping: the verdict over every problem, from
        its graded samples (sample_id, sample_index, shard_index, correct, completion_tokens)."""
        samples = samples.unique(["sample_id", "sample_index"], keep="first")
        counts = samples.group_by("sample_id").agg(pl.col("correct").cast(pl.Int64).sum().alias("right"),
                                                   pl.len().alias("known"))
        for sid, right, known in counts.iter_rows():
            self._right[sid], self._known[sid] = int(right), int(known)
        rows = samples.select("sample_id", "sample_index", "shard_index", "completion_tokens")
        return self._decision(len(self.order), rows, status="completed")


__all__ = ["Decider", "Decision", "decision_order", "graded_prefix_path", "in_flight", "poll_seconds",
           "record_withdrawn", "round_ends", "stop_path", "stop_requested", "stopped_prefix", "stopped_problems",
           "ungated", "ungated_path", "withdrawn_path", "withdrawn_tokens"]

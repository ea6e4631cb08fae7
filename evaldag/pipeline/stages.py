"""The per-shard stages (generate, grade) and the reduce stage, as plain functions over plan and files.

Each stage reads the previous stage's file and writes its own. Output paths derive from the keys of what decides
them (generation_key for generations, grade_key for grades, the reference fingerprint for log-probs), and are
written atomically, so an existing file is always a complete result of the same inputs: a stage that finds its
output reuses it instead of computing it again (and records that, for the cache hit rate).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import time
import uuid
from collections.abc import Callable
from os import PathLike

import polars as pl
from upath import UPath

from evaldag.pipeline import faults
from evaldag.decisions import adaptive as adaptive_metrics
from evaldag.scoring import metrics as metricsmod
from evaldag.decisions import decide
from evaldag.storage import store
from evaldag.errors import ConfigError
from evaldag.request.plan import EvalPlan, load_plan, sample_pieces, splits_samples, SAMPLE_ROUNDS
from evaldag.request.second_round import second_round_path
from evaldag.decisions.verdicts import PROBLEM_SCORE
from evaldag.pipeline.progress import ShardProgress
from evaldag.storage.schema import (GENERATION_SCHEMA, GRADED_SCHEMA, INPUT_SCHEMA, LOGPROB_SCHEMA, read_table,
                            write_table)
from evaldag.pipeline.time_left import BASE_FRACTION, TimeLeft

log = logging.getLogger("evaldag")


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the peak of this process, i.e. of this shard's flow run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_gpu_mb() -> float:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**20


def _record_stage(plan: EvalPlan, shard: int, stage: str, computed: bool) -> None:
    path = plan.cache_record_path(shard)
    record = store.read_json(path) if path.is_file() else {}
    record[stage] = "computed" if computed else "reused"
    store.write_json(path, record)


def _shard_outputs(plan: EvalPlan, shard: int) -> dict[str, UPath]:
    """Each stage of one shard and the file it writes."""
    outputs = {"generate": plan.generations_path(shard), "grade": plan.graded_path(shard)}
    if plan.reference is not None:
        outputs["score"] = plan.logprobs_path(shard)
    return outputs


def shard_done(plan: EvalPlan, shard: int) -> UPath | None:
    """The shard's graded file when every stage of the shard is already in the store, else None; reads only.
    A re-run of a finished evaluation then needs no shard run at all: no worker slot, no process start, no model
    load (record that with `record_reused`)."""
    outputs = _shard_outputs(plan, shard)
    if not all(path.is_file() for path in outputs.values()):
        return None
    if _timed_out(outputs["grade"]):     # not a result: the shard runs again to grade those rows (grade_shard)
        return None
    return outputs["grade"]


def record_reused(plan: EvalPlan, shard: int) -> None:
    """Record every stage of a done shard (`shard_done`) as reused, for the evaluation's cache hit rate."""
    for stage in _shard_outputs(plan, shard):
        _record_stage(plan, shard, stage, computed=False)


# progress(ShardProgress): called as generation starts, as requests finish and running requests generate tokens (at
# most every PROGRESS_S seconds; a static-batch engine: after each batch), and at the end; the orchestration layer
# publishes it (evaldag.pipeline.progress.artifact_progress: a Prefect progress artifact)
Progress = Callable[[ShardProgress], None]


def generate_shard(plan: EvalPlan, shard: int, progress: Progress | None = None) -> UPath | None:
    """Generate `n` completions for every problem of one shard; write and return the generations file, or None when
    the evaluation was decided early and its parent asked the shard to stop (evaldag.decisions.decide; what was generated
    stays in the shard's chunks for a later evaluation).

    When the plan names a reference model, also score the completions under both models (log-probs for KL).
    `progress`, when given, hears how many of the shard's samples are done and how many tokens were generated,
    while it generates (see Progress).
    """
    out = plan.generations_path(shard)
    with store.lock(out):
        if out.is_file():
            log.info("shard %d: generations already in %s, reusing them", shard, out)
            _record_stage(plan, shard, "generate", computed=False)
            if progress is not None:     # its tokens too: a retried shard's count must not fall back to 0
                total = sum(count for _, count in plan.shard_runs(shard))
                progress(ShardProgress(total, total, _tokens_of(out), tokens_left=0, seconds_left=0.0,
                                       unit=plan.progress_unit))
        else:
            if not _generate(plan, shard, out, progress):
                return None
            _record_stage(plan, shard, "generate", computed=True)
    if plan.reference is not None:
        score_shard(plan, shard)
    return out


def _generate(plan: EvalPlan, shard: int, out: UPath, progress: Progress | None = None) -> bool:
    """Generate the shard's missing completions, made durable as parquet chunks while they come (a shard killed
    midway, by node loss, OOM or kill -9, resumes from its chunks and loses at most one chunk's worth), then merge
    the chunks into `out`. An engine that reports per request (generate_requests: vLLM) gets every missing request
    at once and its rows are written in chunks of finished requests (_PerRequest); a static-batch engine gets every
    missing batch (Engine.generate_batches) and each batch is written as it completes (_PerBatch). Seeds are per
    request or per batch, never per chunk, so the resumed output equals an uninterrupted one. Returns False when it
    stopped on its parent's request (evaldag.decisions.decide) before the end: the chunks stay, nothing is merged."""
    from evaldag.engines import engine_for
    from evaldag.request.checkpoint import check_unchanged

    inputs = plan.shard_inputs(shard)
    prompts = inputs["prompt"].to_list()
    chunks = store.chunks_dir(out)
    t0 = time.perf_counter()
    check_unchanged(plan.resolved_model)          # before the tokenizer and the engine read the folder
    with engine_for(plan.resolved_model, workload(plan, shard)) as got:
        load_s = time.perf_counter() - t0
        if got.loaded:      # and after: weights rewritten while the engine read them are caught here
            check_unchanged(plan.resolved_model)
        mode = _PerRequest if hasattr(got.engine, "generate_requests") else _PerBatch
        run = mode(plan, shard, got.engine, inputs, chunks, progress)
        if run.todo:
            check_context(plan, got.engine, prompts)
        run.generate()
    if run.stopped:
        log.info("shard %d: stopped at its parent's request (the evaluation is decided); %d of %d problems "
                 "generated, kept in %s", shard, run.done, len(run.prompts), chunks)
        return False
    write_table(_merge_chunks(chunks, inputs, plan.shard_runs(shard), shard), out, GENERATION_SCHEMA)
    store.write_json(plan.stats_path("generate", shard), {
        "model_load_s": load_s, "engine_loads": int(got.loaded), "generation_s": run.seconds,
        "generation_tokens": float(run.tokens), **run.resumed,
        "peak_rss_mb": _peak_rss_mb(), "peak_gpu_mb": _peak_gpu_mb()})
    store.remove_tree(chunks)
    return True


# How often generated rows are made durable, for engines that report per request: a chunk is written once this
# many requests are waiting to be written, or once the oldest of them has waited this many seconds, whichever comes
# first. A chunk costs one small parquet file in the result store; these defaults bound the loss of a killed shard
# to half a minute of generation and keep a 500-problem shard to about 10-30 files.
CHUNK_REQUESTS_ENV, CHUNK_REQUESTS = "EVALDAG_CHUNK_REQUESTS", 64
CHUNK_S_ENV, CHUNK_S = "EVALDAG_CHUNK_S", 30.0
# Progress is published at most this often while generating (each publication is a Prefect API call); the first
# and the last are always published.
PROGRESS_S = 5.0


def chunk_policy() -> tuple[int, float]:
    """(requests, seconds) after which finished requests are written as a chunk ($EVALDAG_CHUNK_REQUESTS,
    $EVALDAG_CHUNK_S; defaults CHUNK_REQUESTS, CHUNK_S)."""
    requests = int(os.environ.get(CHUNK_REQUESTS_ENV) or CHUNK_REQUESTS)
    seconds = float(os.environ.get(CHUNK_S_ENV) or CHUNK_S)
    if requests < 1 or seconds <= 0:
        raise ValueError(f"{CHUNK_REQUESTS_ENV} must be >= 1 and {CHUNK_S_ENV} > 0, got {requests} and {seconds}")
    return requests, seconds


class _ShardRun:
    """What both ways of generating a shard share: its rows, its progress (samples done, tokens generated) and the
    figures for its stats."""

    def __init__(self, plan: EvalPlan, shard: int, engine, inputs: pl.DataFrame, chunks: UPath,
                 progress: Progress | None) -> None:
        self.plan, self.shard, self.engine, self.chunks, self._progress = plan, shard, engine, chunks, progress
        self.records = inputs.to_dicts()
        self.prompts = inputs["prompt"].to_list()
        self.runs = plan.shard_runs(shard)     # (first sample index, samples) of each problem here
        self.done = 0                   # problems whose rows are generated (resumed ones included)
        self.samples = sum(count for _, count in self.runs)
        self.samples_done = 0           # samples whose rows are generated: what progress counts (a problem's samples
                                        # finish at several times)
        # Two token counts, both right: `tokens` is this attempt's (its rate, log lines and stats), progress adds
        # `resumed_tokens`, those of the rows an earlier attempt kept, so the evaluation's count never falls back
        self.tokens = 0                 # tokens of this run's finished requests
        self.resumed_tokens = 0
        self.running_tokens = 0         # tokens of its requests still running, as the engine last reported them
        self.seconds = 0.0
        self._published = -float("inf")
        self._reported_tokens = 0
        self.todo: list = []
        self.resumed: dict[str, int] = {}
        self.running_counts: tuple[int, ...] | None = None    # each running sequence's tokens, where reported
        self.engine_queued: int | None = None                 # sequences the engine holds but has not started
        self.time_left: TimeLeft | None = None                # set once `todo` is known
        self.stopped = False                                  # the parent decided the evaluation (evaldag.decisions.decide)
        self._stop_checked = 0.0

    def stop_asked(self) -> bool:
        """Whether the parent asked this evaluation's shards to stop (a file in the store: looked at once a second
        at most, with the one that lifts the round gate)."""
        if self.plan.request.decide is None or time.perf_counter() - self._stop_checked < 1.0:
            return False
        self._stop_checked = time.perf_counter()
        gate = getattr(self, "_gate", None)
        if gate is not None and gate.gated and decide.ungated(self.plan):
            gate.lift()         # the parent sees no verdict in sight within the gated rounds
        return decide.stop_requested(self.plan)

    def decision_rank(self) -> dict[str, int]:
        """Each problem's place in the evaluation's decision order (evaldag.decisions.decide), the same on every shard."""
        return {sid: k for k, sid in enumerate(decide.decision_order(self.plan.sample_ids(), self.plan.sampling.seed))}

    def start_forecast(self, completions: int) -> None:
        """Forecast the end of this many completions (evaldag.pipeline.time_left), with the step-time prior of the
        engine's device."""
        device = "cpu" if getattr(self.engine, "on_cpu", False) else "cuda"
        self.time_left = TimeLeft(completions, self.plan.sampling.max_new_tokens, base_fraction=BASE_FRACTION[device])

    def report(self, force: bool = False) -> None:
        """Publish the progress, at most every PROGRESS_S seconds unless forced."""
        now = time.perf_counter()
        if self._progress is None or (not force and now - self._published < PROGRESS_S):
            return
        self._published = now
        # never backwards: a finished request's final count can be below what its last running report estimated
        self._reported_tokens = max(self._reported_tokens, self.resumed_tokens + self.tokens + self.running_tokens)
        est = self.time_left.estimate(self.tokens + self.running_tokens, self.running_counts,
                                      self.not_started()) if self.time_left is not None else None
        self._progress(ShardProgress(self.samples_done, self.samples, self._reported_tokens,
                                     est.tokens_per_s if est else None, est.tokens_left if est else None,
                                     est.seconds_left if est else None, self.plan.progress_unit))

    def not_started(self) -> int | None:
        """Sequences not handed to the engine yet, where known (None: every unfinished one that is not running)."""
        return None

    def rows(self, i: int, completions: list, first: int | None = None) -> list[dict]:
        """One row per completion of problem `i`, samples `first` (default: its run's first) on: its input row plus
        what the engine returned."""
        first = self.runs[i][0] if first is None else first
        return [{**self.records[i], "sample_index": first + k, "shard_index": self.shard, "completion": c.text,
                 "completion_ids": c.token_ids, "prompt_tokens": c.prompt_tokens,
                 "completion_tokens": c.completion_tokens, "finish_reason": c.finish_reason,
                 "latency_s": c.latency_s, "batch_size": c.batch_size} for k, c in enumerate(completions)]

    def log_rate(self, what: str) -> None:
        log.info("shard %d: %s; %d of %d problems, %d tokens, %.0f tok/s", self.shard, what, self.done,
                 len(self.prompts), self.tokens, self.tokens / max(self.seconds, 1e-9))


class _PerBatch(_ShardRun):
    """A static-batch engine (transformers, a server): the engine's batches, each written as one chunk and reported
    as it completes; a resumed shard skips the batches whose chunk exists (seeds are per batch)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        if self.plan.sample_runs is not None:
            raise ConfigError(f"{self.plan.benchmark.name}: the plan splits problems' samples over shards, which "
                              "only an engine that seeds each sample alone can generate (vllm's per-request "
                              f"generation); {type(self.engine).__name__} samples a prompt's n completions "
                              "together. Evaluate it again with engine=vllm, or with num_shards=1")
        self.batches = self.engine.plan_batches(self.prompts, self.plan.sampling)
        if self.plan.request.decide is not None:
            self.batches = self._along_the_decision_order(self.batches)
        self.todo = [(b, [self.prompts[i] for i in idx]) for b, idx in enumerate(self.batches)
                     if not self._chunk(b).is_file()]
        if (prefix := decide.stopped_prefix(self.plan)) is not None:
            # decided already (a relaunch after the stop): only the batches of its decided prefix are wanted
            self.todo = [(b, p) for b, p in self.todo if any(self.records[i]["sample_id"] in prefix
                                                             for i in self.batches[b])]
            self.stopped = True
        todo_ids = {b for b, _ in self.todo}
        self.done = sum(len(idx) for b, idx in enumerate(self.batches) if b not in todo_ids)
        self.samples_done = sum(self.runs[i][1] for b, idx in enumerate(self.batches) if b not in todo_ids
                                for i in idx)
        self.resumed_tokens = sum(_tokens_of(self._chunk(b)) for b in range(len(self.batches)) if b not in todo_ids)
        self.resumed = {"resumed_batches": len(self.batches) - len(self.todo), "resumed_problems": self.done,
                        "resumed_samples": self.samples_done}
        self.start_forecast(sum(self.runs[i][1] for b, _ in self.todo for i in self.batches[b]))

    def _along_the_decision_order(self, batches: list[list[int]]) -> list[list[int]]:
        """The same number of prompts per batch, cut along the evaluation's decision order (evaldag.decisions.decide)
        instead of by length: batches by length each hold a few problems of every round, so the first round would be
        complete only when nearly every batch is. This costs padding (a batch runs until its longest completion),
        and changes what each batch generates, so the plan's generation key says so (evaldag.request.plan)."""
        per_batch = max((len(b) for b in batches), default=1)
        rank = self.decision_rank()
        order = sorted(range(len(self.prompts)), key=lambda i: rank[self.records[i]["sample_id"]])
        return [order[lo:lo + per_batch] for lo in range(0, len(order), per_batch)]

    def _chunk(self, b: int) -> UPath:
        return self.chunks / f"batch-{b:05d}-of-{len(self.batches):05d}.parquet"

    def generate(self) -> None:
        t1 = time.perf_counter()
        self.report(force=True)
        todo = self._run(self.todo, t1)
        if todo:
            # the parent decided the evaluation: only the batches holding problems of its decided prefix go on
            prefix = decide.stopped_prefix(self.plan) or set()
            self.stopped = True
            self._run([(b, prompts) for b, prompts in todo
                       if any(self.records[i]["sample_id"] in prefix for i in self.batches[b])], t1)
        self.seconds = time.perf_counter() - t1

    def _run(self, todo: list, t1: float) -> list:
        """Generate the batches `todo`, each written as it completes; returns those not generated because the
        parent stopped the evaluation meanwhile (none when it did not)."""
        left = len(todo)
        sampling = self.plan.shard_sampling(self.shard)      # a random stream of its own per shard
        # closing(): a failure between batches must also withdraw the requests still in the engine, which stays
        # loaded for the retry (engines.keep_loaded)
        with contextlib.closing(self.engine.generate_batches(todo, sampling)) as stream:
            for b, completions in stream:
                rows = [r for i, comps in zip(self.batches[b], completions) for r in self.rows(i, comps)]
                write_table(pl.DataFrame(rows, schema=GENERATION_SCHEMA), self._chunk(b), GENERATION_SCHEMA)
                self.tokens += sum(r["completion_tokens"] for r in rows)
                self.time_left.finish([r["completion_tokens"] for r in rows])
                self.done += len(self.batches[b])
                self.samples_done += sum(self.runs[i][1] for i in self.batches[b])
                self.seconds = time.perf_counter() - t1
                left -= 1
                self.report(force=True)         # a batch is minutes of work: every one is news
                self.log_rate(f"batch {b + 1} of {len(self.batches)} done ({left} left)")
                if left and not self.stopped and self.stop_asked():
                    written = {b for b in range(len(self.batches)) if self._chunk(b).is_file()}
                    return [(b, prompts) for b, prompts in todo if b not in written]
                if left:
                    faults.maybe_fail("generate")
        return []


class _PerRequest(_ShardRun):
    """An engine that reports per request (vLLM): every missing sample at once, each seeded by (evaluation seed,
    sample id, sample index) whatever request, batch or chunk it falls in; finished requests are written in chunks
    (chunk_policy), and progress counts finished samples and the tokens of running ones. Where the engine seeds
    each sample alone and the evaluation does not stop early, every sample is a request of its own, dealt round by
    round over the shard's problems (evaldag.request.plan.sample_pieces); otherwise a problem's samples are one
    request. A resumed shard generates only the samples no chunk holds."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        written, self.resumed_tokens = _written_samples(self.chunks)
        # a request per sample where the engine seeds them alone: dealt round by round, or, for an evaluation that
        # may stop early, in its decision order (its verdict hears each sample as it ends)
        per_sample = splits_samples(self.plan.resolved_model.engine, self.plan.sampling.n)
        deciding = self.plan.request.decide is not None
        # the requests (problem, first sample, samples, round), keyed by their place here: for a fresh shard with
        # one request per problem, request k is problem k
        pieces = sample_pieces(self.runs, 1 if deciding or not per_sample else SAMPLE_ROUNDS)
        if (prefix := decide.stopped_prefix(self.plan)) is not None:
            # the evaluation was decided: only the decided prefix's samples are still wanted (a relaunch after it)
            pieces = [p for p in pieces if self.records[p[0]]["sample_id"] in prefix]
            self.stopped = True
        self.pieces = _missing_requests(pieces, [r["sample_id"] for r in self.records], written,
                                        one_per_sample=per_sample)
        self.todo = list(range(len(self.pieces)))
        self._left = [0] * len(self.prompts)        # each problem's requests not finished
        for i, _, _, _ in self.pieces:
            self._left[i] += 1
        self.done = sum(left == 0 for left in self._left)
        left = sum(count for _, _, count, _ in self.pieces)
        self.samples_done = self.samples - left
        self.resumed = {"resumed_problems": self.done, "resumed_samples": self.samples_done}
        self.start_forecast(left)
        self._next_chunk = 1 + max((int(p.stem.split("-")[1]) for p in self.chunks.glob("requests-*.parquet")),
                                   default=0)
        # in every chunk's name: two attempts of one shard can generate at once on an object store (its lock holds
        # on one machine; a parent's retry beside a revived original), and a number alone let one's chunk replace
        # the other's
        self._attempt = uuid.uuid4().hex[:8]
        self._pending: list[dict] = []      # rows of finished requests not yet written
        self._unsubmitted: list[int] = []   # sequences of the requests from the k-th on (set by generate)
        self._window = self._finished_here = 0
        self._pending_requests = 0
        self._pending_since = 0.0
        self._gate: decide.RoundGate | None = None      # pacing of an evaluation that may stop early
        self._position: dict[int, int] = {}
        self._withdrawn: frozenset | None = None

    def generate(self) -> None:
        from evaldag.engines.base import Finished, Request, request_seed

        every_requests, every_s = chunk_policy()
        t1 = time.perf_counter()
        self.report(force=True)
        seed = self.plan.sampling.seed
        # a run of samples first..first+count-1 is one request of n = count seeded `seed + first`: vLLM seeds its
        # k-th sample `seed + k`, so the run's samples equal those of the whole request (evaldag.request.plan.splits_samples)
        requests = [Request(k, self.prompts[i], request_seed(seed, self.records[i]["sample_id"]) + first, n=count)
                    for k in self.todo for i, first, count, _ in [self.pieces[k]]]
        # Submitted round by round (every problem's first piece, then every second...), each round in a seeded random
        # order, not the plan's (longest prompt first: harder problems, longer answers, docs/performance.md): the
        # forecast of the end (evaldag.pipeline.time_left) reads the requests finished so far as a fair sample of
        # all, which holds only when the order says nothing of length. It is the evaluation's decision order, the
        # same on every shard, so that a prefix of it completes first where the evaluation may stop early
        # (evaldag.decisions.decide). Samples do not depend on it (seeds are per sample), beyond the floating-point
        # effect of what runs beside them.
        rank = self.decision_rank()
        requests.sort(key=lambda r: (self.pieces[r.key][3], rank[self.records[self.pieces[r.key][0]]["sample_id"]]))
        window = decide.in_flight(self.plan)
        options = {} if window is None else self._pacing(requests, window, rank)
        # the engine takes requests in this order, `window` at a time (all when None), the next as one finishes
        sizes = [r.n or self.plan.sampling.n for r in requests]
        self._unsubmitted = [sum(sizes[k:]) for k in range(len(sizes) + 1)]     # sequences from request k on
        self._window = len(requests) if window is None else window
        self._finished_here = 0
        if window is not None:      # the parent decides on written rows: a window's worth at a time at least
            every_requests = min(every_requests, window)
        # closing(): a failure must also withdraw the requests still in the engine, which stays loaded for the
        # retry (engines.keep_loaded)
        try:
            with contextlib.closing(self.engine.generate_requests(requests, self.plan.sampling, **options)) as events:
                for event in events:
                    if isinstance(event, Finished):
                        self._finished(event.key, event.completions)
                        if self._gate is not None:
                            self._gate.finished(self._position[event.key])
                    elif event.tokens is not None:
                        self.running_tokens, self.running_counts = event.tokens, event.counts
                        self.engine_queued = event.queued
                    self.seconds = time.perf_counter() - t1
                    if (self._pending_requests >= every_requests
                            or (self._pending and time.perf_counter() - self._pending_since >= every_s)):
                        self._flush()
                        if self.done < len(self.prompts):
                            faults.maybe_fail("generate")
                    self.report()
                    # the decided prefix's requests go on, the others are withdrawn (the engine drops them)
                    if self._withdrawn is None and self.stop_asked():
                        self._withdraw()
        except BaseException:
            # a failure the process survives (engine error, Ctrl-C) keeps what finished before it for the retry;
            # a failed write must not hide the failure itself
            with contextlib.suppress(Exception):
                self._flush()
            raise
        self._flush()
        self.seconds = time.perf_counter() - t1
        self.running_tokens, self.running_counts, self.engine_queued = 0, (), 0
        self.report(force=True)

    def _pacing(self, requests: list, window: int, rank: dict[str, int]) -> dict:
        """The engine options of an evaluation that may stop early (evaldag.decisions.decide): `window` requests in
        flight, held back by the round gate, and withdrawn once the parent stops it."""
        self._position = {r.key: k for k, r in enumerate(requests)}
        _, _, rounds = self.plan.decide_settings
        places = [rank[self.records[self.pieces[r.key][0]]["sample_id"]] for r in requests]
        self._gate = decide.RoundGate(decide.round_of(places, len(rank), rounds), rounds)
        return {"max_in_flight": window, "hold": self._gate.hold, "withdrawn": lambda: self._withdrawn}

    def _withdraw(self) -> None:
        """The parent decided the evaluation: withdraw every request outside its decided prefix."""
        prefix = decide.stopped_prefix(self.plan) or set()
        self._withdrawn = frozenset(k for k, (i, _, _, _) in enumerate(self.pieces)
                                    if self.records[i]["sample_id"] not in prefix)
        self.stopped = bool(self._withdrawn) or self.stopped
        log.info("shard %d: the evaluation is decided; %d requests outside its prefix withdrawn, its own go on",
                 self.shard, len(self._withdrawn))

    def not_started(self) -> int | None:
        """The sequences not started yet: those of the requests not handed to the engine, and those the engine
        queues behind its running set, where it says (Running.queued). With the engine's running counts known,
        any other unfinished sequence is a finished sample of a request whose siblings still run (vLLM drops it
        from its running set), which has nothing left to generate."""
        if self.running_counts is None or not self._unsubmitted:
            return None
        unsubmitted = self._unsubmitted[min(len(self._unsubmitted) - 1, self._window + self._finished_here)]
        return unsubmitted + (self.engine_queued or 0)

    def _finished(self, key: int, completions: list) -> None:
        i, first, count, _ = self.pieces[key]
        self._finished_here += 1
        self.samples_done += count
        if not self._pending:
            self._pending_since = time.perf_counter()
        self._pending.extend(self.rows(i, completions, first))
        self._pending_requests += 1
        self.tokens += sum(c.completion_tokens for c in completions)
        self.time_left.finish([c.completion_tokens for c in completions])
        # the engine's running count still holds this request's tokens until its next report
        self.running_tokens = max(0, self.running_tokens - sum(c.completion_tokens for c in completions))
        self._left[i] -= 1
        self.done += self._left[i] == 0

    def _flush(self) -> None:
        """Write the finished requests not yet written as one chunk."""
        if not self._pending:
            return
        path = self.chunks / f"requests-{self._next_chunk:06d}-{self._attempt}.parquet"
        write_table(pl.DataFrame(self._pending, schema=GENERATION_SCHEMA), path, GENERATION_SCHEMA)
        self.log_rate(f"{self._pending_requests} requests written to {path.name}")
        self._next_chunk += 1
        self._pending, self._pending_requests = [], 0


def _tokens_of(path: UPath) -> int:
    """The completion tokens of a generations file or chunk."""
    return int(read_table(path, GENERATION_SCHEMA, columns=["completion_tokens"])["completion_tokens"].sum())


def _missing_requests(pieces: list[tuple[int, int, int, int]], sample_ids: list[str], written: set[tuple[str, int]],
                      one_per_sample: bool) -> list[tuple[int, int, int, int]]:
    """The requests (problem, first sample index, samples, round) that generate the samples of `pieces`
    (evaldag.request.plan.sample_pieces) not in `written`: one per sample where `one_per_sample`, else one per
    stretch of consecutive missing samples. Per sample, not per piece: chunks written by an attempt that cut the
    samples otherwise (a dealt evaluation, then one that may stop early, on the same generation key) hold parts
    of pieces."""
    out = []
    for i, first, count, rnd in pieces:
        missing = [k for k in range(first, first + count) if (sample_ids[i], k) not in written]
        if one_per_sample:
            out.extend((i, k, 1, rnd) for k in missing)
            continue
        for k in missing:
            if out and out[-1][0] == i and out[-1][1] + out[-1][2] == k and out[-1][3] == rnd:
                out[-1] = (i, out[-1][1], out[-1][2] + 1, rnd)
            else:
                out.append((i, k, 1, rnd))
    return out


def _written_samples(chunks: UPath) -> tuple[set[tuple[str, int]], int]:
    """The (sample id, sample index) pairs whose rows are already in a chunk (a request's rows are written
    together), and the tokens of those rows."""
    if not chunks.is_dir():
        return set(), 0
    ids, tokens = set(), 0
    for p in store.chunk_files(chunks):
        t = read_table(p, GENERATION_SCHEMA, columns=["sample_id", "sample_index", "completion_tokens"])
        ids.update(zip(t["sample_id"].to_list(), t["sample_index"].to_list()))
        tokens += int(t["completion_tokens"].sum())
    return ids, tokens


def check_context(plan: EvalPlan, engine, prompts: list[str]) -> None:
    """Refuse, before any generation, a shard whose prompt + max_new_tokens overflow the engine's context window
    (evaldag.engines.context: one behaviour for every engine). The error counts the overflowing prompts of the whole
    benchmark, not only this shard's, so every shard that fails says the same thing. An engine that cannot measure
    (a stand-in, a server without a tokenizer endpoint) is not checked."""
    from evaldag.engines.context import check_fits, overflow_error

    measure = getattr(engine, "prompt_fit", None)
    fit = measure(prompts) if measure is not None else None
    if fit is None:
        log.info("%s: the %s engine cannot measure the context window; prompt + max_new_tokens unchecked",
                 plan.benchmark.name, plan.resolved_model.engine)
        return
    cap = plan.sampling.max_new_tokens
    if not fit.overflowing(cap):
        return
    everything = measure(plan.inputs()["prompt"].to_list())
    check_fits(plan.benchmark.name, plan.resolved_model.engine, everything, cap)
    # reached only where the whole benchmark could not be measured (a server that stopped answering /tokenize)
    raise overflow_error(f"{plan.benchmark.name} (this shard)", plan.resolved_model.engine, fit, cap)


def workload(plan: EvalPlan, shard: int):
    """What generating this shard asks of the engine (an evaldag.engines.Workload), for engines that size themselves
    to it; None for the others."""
    from evaldag import engines

    prompts = plan.shard_inputs(shard)["prompt"].to_list()
    return engines.workload(plan.resolved_model, prompts, plan.sampling,
                            sum(count for _, count in plan.shard_runs(shard)))


def _merge_chunks(chunks: UPath, inputs: pl.DataFrame, runs: list[tuple[int, int]], shard: int) -> pl.DataFrame:
    """The chunks of a shard as one table in the plan's order, each (problem, sample) once, checked to hold each
    problem's run of samples.

    A sample in several chunks was generated by two attempts of the shard at once (an object store's lock holds on
    one machine only): both drew it with the same seed, so the first chunk's row (in name order) is kept. Refusing
    it would fail every later attempt the same way, since no retry removes a chunk."""
    order = pl.DataFrame({"sample_id": inputs["sample_id"], "_pos": list(range(inputs.height))})
    df = (pl.concat([read_table(p, GENERATION_SCHEMA) for p in store.chunk_files(chunks)])
          .unique(["sample_id", "sample_index"], keep="first", maintain_order=True)
          .join(order, on="sample_id").sort("_pos", "sample_index").drop("_pos"))
    want = {(sid, first + k) for sid, (first, count) in zip(inputs["sample_id"], runs) for k in range(count)}
    got = set(zip(df["sample_id"], df["sample_index"]))
    if got != want:
        raise RuntimeError(f"shard {shard}: the rows in {chunks} are not the shard's samples: {len(want - got)} "
                           f"missing, {len(got - want)} not of this shard; its next attempt generates the missing "
                           "ones (delete that folder to regenerate the whole shard)")
    return df


def score_shard(plan: EvalPlan, shard: int) -> UPath:
    """Per-token log-probs of the shard's completions under the evaluated model and the reference model."""
    out = plan.logprobs_path(shard)
    with store.lock(out):
        if out.is_file():
            _record_stage(plan, shard, "score", computed=False)
            return out
        return _score(plan, shard, out)


def _score(plan: EvalPlan, shard: int, out: UPath) -> UPath:
    """Log-probabilities under both models, and where both run on an engine that can (EXACT_KL_ENGINES), the exact
    per-position KL over the vocabulary (both models loaded together); otherwise one model at a time, and kl_exact
    stays null."""
    from dataclasses import replace

    from evaldag.engines import EXACT_KL_ENGINES, load_engine
    from evaldag.request.checkpoint import check_unchanged

    check_unchanged(plan.resolved_model)
    check_unchanged(plan.resolved_reference, "reference model")
    gens = read_table(plan.generations_path(shard), GENERATION_SCHEMA)
    prompts, ids = gens["prompt"].to_list(), gens["completion_ids"].to_list()
    t0 = time.perf_counter()
    # Scoring needs the logits, not the generator: a model generated by another engine (vLLM, a server) is scored
    # on transformers, which gives the exact per-position KL whatever decoding produced the tokens.
    models = tuple(m if m.engine in EXACT_KL_ENGINES else replace(m, engine="hf", engine_args={})
                   for m in (plan.resolved_model, plan.resolved_reference))

    def load(m):
        return contextlib.closing(load_engine(m.engine, m.path, m.dtype, m.batch_size, m.engine_args))

    def check_vocabulary(vocab: list[int]) -> None:
        if len(vocab) == 2 and vocab[0] != vocab[1]:
            raise ConfigError(f"reference model {models[1].path} has a different tokenizer than the evaluated model; "
                              "KL needs both to score the same token ids")

    kl = None
    if all(m.engine in EXACT_KL_ENGINES for m in models):
        with load(models[0]) as policy, load(models[1]) as reference:
            check_vocabulary([policy.vocabulary_fingerprint(), reference.vocabulary_fingerprint()])
            logp, ref_logp, kl = policy.score_with_reference(prompts, ids, reference)
    else:           # one model at a time, sampled tokens' log-probabilities only (kl_exact stays null)
        scores, vocab = [], []
        for m in models:
            with load(m) as engine:
                vocab.append(engine.vocabulary_fingerprint())
                check_vocabulary(vocab)
                scores.append(engine.score(prompts, ids))
        logp, ref_logp = scores
    df = gens.select("sample_id", "sample_index").with_columns(
        pl.Series("logp", logp, dtype=pl.List(pl.Float64)),
        pl.Series("ref_logp", ref_logp, dtype=pl.List(pl.Float64)),
        pl.Series("kl_exact", kl, dtype=pl.List(pl.Float64)) if kl is not None
        else pl.lit(None, dtype=pl.List(pl.Float64)).alias("kl_exact"))
    write_table(df, out, LOGPROB_SCHEMA)
    store.write_json(plan.stats_path("score", shard), {"scoring_s": time.perf_counter() - t0,
                                                   "peak_rss_mb": _peak_rss_mb()})
    _record_stage(plan, shard, "score", computed=True)
    return out


def grade_shard(plan: EvalPlan, shard: int, workers: int = 2) -> UPath:
    """Grade one shard's generations (and group equivalent answers for maj@k); write and return the graded file."""
    out = plan.graded_path(shard)
    with store.lock(out):
        if out.is_file():
            if _timed_out(out):
                return _regrade_timeouts(plan, shard, out, workers)
            log.info("shard %d: grades already in %s, reusing them", shard, out)
            _record_stage(plan, shard, "grade", computed=False)
            return out
        return _grade(plan, shard, out, workers)


def _timed_out(graded: UPath) -> bool:
    """Whether a graded file holds rows whose grading timed out."""
    with graded.open("rb") as fh:
        return bool((pl.read_parquet(fh, columns=["status"])["status"] == "timeout").any())


def _regrade_timeouts(plan: EvalPlan, shard: int, out: UPath, workers: int) -> UPath:
    """Grade the timed-out rows of a graded file again (the machine may have been loaded, or the limit raised) and
    rewrite the file; rows that time out again stay "timeout" until the next run."""
    from evaldag.scoring.grading import grade_table

    graded = read_table(out, GRADED_SCHEMA).with_row_index("_row")
    todo = graded.filter(pl.col("status") == "timeout")
    log.info("shard %d: grading %d timed-out rows of %s again", shard, todo.height, out)
    t0 = time.perf_counter()
    redone = grade_table(todo.drop("_row"), timeout_s=plan.benchmark.grading_timeout_s, workers=workers,
                         strip_thinking=plan.benchmark.strip_thinking).with_columns(todo["_row"])
    merged = (pl.concat([graded.filter(pl.col("status") != "timeout"), redone.select(graded.columns)])
              .sort("_row").drop("_row"))
    merged, grouping_timeouts = _group_answers(plan, merged, workers)
    stats_path = plan.stats_path("grade", shard)
    stats = store.read_json(stats_path) if stats_path.is_file() else {}
    stats["grouping_timeouts"] = grouping_timeouts
    stats["grading_s"] = stats.get("grading_s", 0.0) + time.perf_counter() - t0
    stats["regraded_timeouts"] = stats.get("regraded_timeouts", 0) + todo.height
    store.write_json(stats_path, stats)
    write_table(merged, out, GRADED_SCHEMA)
    _record_stage(plan, shard, "grade", computed=True)
    return out


def with_current_inputs(gens: pl.DataFrame, plan: EvalPlan, shard: int) -> pl.DataFrame:
    """The generations with their input columns (gold, gold_raw, subject, level) taken from this plan's inputs.

    Generations are shared by every evaluation with the same generation_key, and the input rows copied into them are
    those of the evaluation that generated them: a gold-normalisation fix or a gold_format change since then would
    be graded against the old gold. The plan's inputs.parquet is the current truth."""
    inputs = plan.shard_inputs(shard)
    missing = set(gens["sample_id"].unique()) - set(inputs["sample_id"])
    if missing:
        raise RuntimeError(f"shard {shard}: generations hold samples {sorted(missing)[:3]} that are not in the plan's "
                           f"inputs {plan.path('inputs.parquet')}; delete {plan.generations_path(shard)} to regenerate")
    own = [c for c in INPUT_SCHEMA if c not in ("sample_id", "prompt")]
    return (gens.drop(own).join(inputs.select("sample_id", *own), on="sample_id", how="left", maintain_order="left")
            .select(list(GENERATION_SCHEMA)))


def _group_answers(plan: EvalPlan, graded: pl.DataFrame, workers: int) -> tuple[pl.DataFrame, int]:
    """assign_answer_groups with every math-verify comparison bounded by the grading timeout, in a worker process
    (workers >= 1; workers=0, the debugging mode, compares in this process without a bound). A comparison that
    times out counts as "not the same answer". Returns the table and the number of comparisons cut."""
    from evaldag.scoring.grading import BoundedCalls
    from evaldag.scoring.sampling_metrics import assign_answer_groups, math_equivalent

    if workers == 0:
        return assign_answer_groups(graded), 0
    with BoundedCalls(plan.benchmark.grading_timeout_s) as calls:
        grouped = assign_answer_groups(graded, lambda a, b: calls.call(math_equivalent, a, b, default=False))
    return grouped, calls.timeouts


def grade_rows(plan: EvalPlan, gens: pl.DataFrame, workers: int = 1) -> pl.DataFrame:
    """Grade generated rows of this plan (any shards'; the parent grades a stopped evaluation's prefix with it):
    their gold taken from the plan's inputs (see with_current_inputs), answers graded and grouped for maj@k."""
    from evaldag.scoring.grading import grade_table

    own = [c for c in INPUT_SCHEMA if c not in ("sample_id", "prompt")]
    gens = (gens.drop(own).join(plan.inputs().select("sample_id", *own), on="sample_id", how="left",
                                maintain_order="left").select(list(GENERATION_SCHEMA)))
    graded = grade_table(gens, timeout_s=plan.benchmark.grading_timeout_s, workers=workers,
                         strip_thinking=plan.benchmark.strip_thinking)
    return _group_answers(plan, graded, workers)[0]


def _grade(plan: EvalPlan, shard: int, out: UPath, workers: int) -> UPath:
    from evaldag.scoring.grading import grade_table

    faults.maybe_fail("grade")
    gens = with_current_inputs(read_table(plan.generations_path(shard), GENERATION_SCHEMA), plan, shard)
    t0 = time.perf_counter()
    graded = grade_table(gens, timeout_s=plan.benchmark.grading_timeout_s, workers=workers,
                         strip_thinking=plan.benchmark.strip_thinking)
    grading_s = time.perf_counter() - t0
    graded, grouping_timeouts = _group_answers(plan, graded, workers)
    store.write_json(plan.stats_path("grade", shard), {"grading_s": grading_s, "grading_samples": graded.height,
                                                   "grouping_s": time.perf_counter() - t0 - grading_s,
                                                   "grouping_timeouts": grouping_timeouts})
    write_table(graded, out, GRADED_SCHEMA)
    _record_stage(plan, shard, "grade", computed=True)
    return out


_STAT_COLUMNS = ("model_load_s", "engine_loads", "generation_s", "generation_tokens", "grading_s", "grading_samples", "scoring_s",
                 "peak_rss_mb", "peak_gpu_mb")


def _stats_table(plan: EvalPlan) -> pl.DataFrame:
    """One row per shard with every stage's figures (missing figures are 0: e.g. no scoring without reference)."""
    rows = []
    for i in range(plan.num_shards):
        row: dict = {"shard_index": i, **dict.fromkeys(_STAT_COLUMNS, 0.0)}
        for stage in ("generate", "grade", "score"):
            path = plan.stats_path(stage, i)
            if path.is_file():
                stats = store.read_json(path)
                row["peak_rss_mb"] = max(row["peak_rss_mb"], stats.pop("peak_rss_mb", 0.0))
                row.update(stats)
        rows.append(row)
    return pl.DataFrame(rows)


def _cache_hit_rate(*plans: EvalPlan) -> float:
    """Share of the stages of every shard of `plans` (an adaptive evaluation's rounds) found done."""
    states = [v for plan in plans for i in range(plan.num_shards) if plan.cache_record_path(i).is_file()
              for v in store.read_json(plan.cache_record_path(i)).values()]
    return sum(s == "reused" for s in states) / len(states) if states else 0.0


def _adaptive_figures(plan: EvalPlan, graded: pl.DataFrame) -> tuple[dict[str, float], pl.DataFrame]:
    """An adaptive evaluation's figures and per-problem estimates (evaldag.decisions.adaptive.evaluation_metrics);
    raises unless its rows are exactly what its rounds planned."""
    try:
        counts = adaptive_metrics.counts_from_samples(graded, plan.request.adaptive.n0)
        return adaptive_metrics.evaluation_metrics(counts, plan.request.adaptive)
    except ValueError as e:
        raise ValueError(f"{plan.benchmark.name}: the adaptive rounds' rows are not what their plans ask for "
                         f"({e}); a second-round shard's graded file is missing or counted twice") from None


def _second_round(plan: EvalPlan) -> list[EvalPlan]:
    """The second round's plan of an adaptive evaluation, where it drew one (evaldag.request.second_round)."""
    path = second_round_path(plan)
    return [load_plan(path)] if path.is_file() else []


def _rounds(plan: EvalPlan, graded: pl.DataFrame, expected: list[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the first round's rows, all rows), sorted, answer groups made per problem; raises unless the first round is
    complete. The first round is every row but where the evaluation is adaptive: then its n0 = sampling.n samples of
    every problem; the second round's (indices n0 on, evaldag.request.second_round) are checked by the estimate."""
    n = plan.sampling.n
    graded = graded.sort(["sample_id", "sample_index"])
    first = graded if plan.request.adaptive is None else graded.filter(pl.col("sample_index") < n)
    metricsmod.check_complete(first, expected, n)
    if plan.sample_runs is not None or plan.request.adaptive is not None:
        # a problem's samples come from several shards (or rounds), whose graders numbered answer groups each on
        # its own: maj@k must vote over groups of the whole problem, and samples.parquet's groups span it. Rows
        # are in sample order, so the first round's groups are the same whether the later rows are grouped or not.
        graded = _group_answers(plan, graded.drop("answer_group"), workers=1)[0]
        first = graded if plan.request.adaptive is None else graded.filter(pl.col("sample_index") < n)
    return first, graded


def reduce_results(plan: EvalPlan, graded_paths: list[str | PathLike], only: list[str] | None = None) -> dict:
    """Merge the shards' graded files, check completeness, compute every metric and the shard diagnostic;
    write samples.parquet (with per-sample rewards) and metrics.json; return the metrics. `only`: the problems the
    metrics are over when not all of the plan's (an evaluation stopped early: its prefix, evaldag.decisions.decide)."""
    from evaldag.scoring.diagnostics import shard_disagreement
    from evaldag.scoring.rewards import combined_reward, reward_metrics
    from evaldag.scoring.sampling_metrics import sampling_metrics

    t0 = time.perf_counter()
    graded = pl.concat([read_table(p, GRADED_SCHEMA) for p in graded_paths])
    expected = plan.sample_ids() if only is None else only
    adaptive = plan.request.adaptive
    first, graded = _rounds(plan, graded, expected)
    plans = [plan] if adaptive is None else [plan, *_second_round(plan)]
    # pass@k, maj@k, by subject and level, rewards: over the first round, where every problem has n samples alike
    result = {
        **metricsmod.task_metrics(first),
        **metricsmod.step_metrics(first),
        **sampling_metrics(first, plan.pass_k),
        **reward_metrics(first, plan.benchmark.rewards),
        **metricsmod.system_metrics(pl.concat([_stats_table(p) for p in plans]), graded),
        "cache_hit_rate": _cache_hit_rate(*plans),
    }
    n = plan.sampling.n    # accuracy is avg@n: give it avg@n's interval under its own name too
    result["accuracy_ci_low"], result["accuracy_ci_high"] = result[f"avg@{n}_ci_low"], result[f"avg@{n}_ci_high"]
    scores = None
    if adaptive is not None:      # accuracy is the adaptive estimate over both rounds
        figures, per_problem = _adaptive_figures(plan, graded)
        result.update(figures)
        # rewards are over the first round: their standard error is over its samples, not all of them
        result["reward/se"] = result.get("reward/std", float("nan")) / math.sqrt(first.height)
        scores = per_problem.rename({"estimate": PROBLEM_SCORE})
    if plan.reference is not None:
        from evaldag.scoring.kl import kl_metrics

        logprobs = pl.concat([read_table(plan.logprobs_path(i), LOGPROB_SCHEMA) for i in range(plan.num_shards)])
        result.update(kl_metrics(logprobs, sampling=plan.sampling))
    if plan.benchmark.metrics:    # a team's own statistics (evaldag.scoring.plugins), over the first round too
        from evaldag.scoring.plugins import plugin_metrics

        taken = {*result, "reduce_s", "shard_disagreement_p"}
        result.update(plugin_metrics(first, plan.benchmark.metrics, taken=taken))
    diagnostic = shard_disagreement(first, num_shards=plan.num_shards) if plan.num_shards > 1 else None
    if diagnostic is not None:
        result["shard_disagreement_p"] = float(diagnostic.details.get("p_value", 1.0))
    samples = graded.with_columns(combined_reward(plan.benchmark.rewards).alias("reward"))
    if scores is not None:        # what paired verdicts compare per problem (evaldag.decisions.verdicts)
        samples = samples.join(scores, on="sample_id", how="left", maintain_order="left")
    store.write_parquet(plan.path("samples.parquet"), samples.drop("completion_ids"))
    if plan.request.decide is not None and (decision := decide.Decision.load(plan)) is not None:
        # the sequential verdict's figures (decide.*): metrics.json holds all the MLflow run gets, so sync logs them
        result.update(decision.metrics())
    result["reduce_s"] = time.perf_counter() - t0
    store.write_json(plan.path("metrics.json"), result)
    if diagnostic is not None:
        store.write_json(plan.path("diagnostics.json"), {"shard_disagreement": diagnostic.__dict__})
    return result

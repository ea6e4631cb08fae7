"""The two ways a shard generates on an engine: per batch (a static-batch engine: each batch a chunk) and per
request (an engine that reports per request, vLLM: finished requests written in chunks, paced and withdrawn where
the evaluation may stop early); what both share (rows, progress, the forecast of the end, the parent's stop); and
the check, before any generation, that the shard's prompts fit the engine's context window."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable

import polars as pl
from upath import UPath

from evaldag.decisions import decide, pacing
from evaldag.errors import ConfigError
from evaldag.pipeline import faults
from evaldag.pipeline.chunks import missing_requests, tokens_of, written_samples
from evaldag.pipeline.progress import ShardProgress
from evaldag.pipeline.time_left import BASE_FRACTION, TimeLeft, without_finished
from evaldag.request.plan import EvalPlan
from evaldag.request.shard_plan import ShardPlan
from evaldag.request.sharding import SAMPLE_ROUNDS, sample_pieces, splits_samples
from evaldag.storage.schema import GENERATION_SCHEMA, write_table

log = logging.getLogger("evaldag")


# progress(ShardProgress): called as generation starts, as requests finish and running requests generate tokens (at
# most every PROGRESS_S seconds; a static-batch engine: after each batch), and at the end; the orchestration layer
# publishes it (evaldag.pipeline.progress.artifact_progress: a Prefect progress artifact)
Progress = Callable[[ShardProgress], None]


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
                 plan.benchmark.name, plan.model.engine)
        return
    cap = plan.sampling.max_new_tokens
    if not fit.overflowing(cap):
        return
    everything = measure(plan.inputs()["prompt"].to_list())
    check_fits(plan.benchmark.name, plan.model.engine, everything, cap)
    # reached only where the whole benchmark could not be measured (a server that stopped answering /tokenize)
    raise overflow_error(f"{plan.benchmark.name} (this shard)", plan.model.engine, fit, cap)


class ShardRun:
    """What both ways of generating a shard share: its rows, its progress (samples done, tokens generated) and the
    figures for its stats."""

    def __init__(self, shard: ShardPlan, engine, chunks: UPath, progress: Progress | None) -> None:
        self.view, self.plan, self.shard = shard, shard.plan, shard.index
        self.engine, self.chunks, self._progress = engine, chunks, progress
        self.records = shard.inputs.to_dicts()
        self.prompts = shard.prompts
        self.runs = shard.runs          # (first sample index, samples) of each problem here
        self.done = 0                   # problems whose rows are generated (resumed ones included)
        self.samples = shard.samples
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
        self.counts_fresh = True                              # no completion finished since those counts
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
        return {sid: k for k, sid in enumerate(decide.decision_order(self.view.evaluation_ids, self.plan.sampling.seed))}

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
        est = self.time_left.estimate(self.tokens + self.running_tokens, self.running_counts, self.not_started(),
                                      fresh=self.counts_fresh) if self.time_left is not None else None
        self._progress(ShardProgress(self.samples_done, self.samples, self._reported_tokens,
                                     est.tokens_per_s if est else None, est.tokens_left if est else None,
                                     est.seconds_left if est else None, self.view.unit))

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


class PerBatch(ShardRun):
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
        # written: not every batch outside `todo` is (a stopped evaluation's beyond its prefix are not wanted)
        done_ids = {b for b in range(len(self.batches)) if self._chunk(b).is_file()}
        self.done = sum(len(idx) for b, idx in enumerate(self.batches) if b in done_ids)
        self.samples_done = sum(self.runs[i][1] for b, idx in enumerate(self.batches) if b in done_ids for i in idx)
        self.resumed_tokens = sum(tokens_of(self._chunk(b)) for b in done_ids)
        self.resumed = {"resumed_batches": len(done_ids), "resumed_problems": self.done,
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
        sampling = self.view.sampling      # a random stream of its own per shard
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


class PerRequest(ShardRun):
    """An engine that reports per request (vLLM): every missing sample at once, each seeded by (evaluation seed,
    sample id, sample index) whatever request, batch or chunk it falls in; finished requests are written in chunks
    (chunk_policy), and progress counts finished samples and the tokens of running ones. Where the engine seeds
    each sample alone and the evaluation does not stop early, every sample is a request of its own, dealt round by
    round over the shard's problems (evaldag.request.sharding.sample_pieces); otherwise a problem's samples are one
    request. A resumed shard generates only the samples no chunk holds."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        written, self.resumed_tokens = written_samples(self.chunks)
        # a request per sample where the engine seeds them alone: dealt round by round, or, for an evaluation that
        # may stop early, in its decision order (its verdict hears each sample as it ends)
        per_sample = splits_samples(self.plan.model.engine, self.plan.sampling.n)
        deciding = self.plan.request.decide is not None
        # the requests (problem, first sample, samples, round), keyed by their place here: for a fresh shard with
        # one request per problem, request k is problem k
        pieces = sample_pieces(self.runs, 1 if deciding or not per_sample else SAMPLE_ROUNDS)
        if (prefix := decide.stopped_prefix(self.plan)) is not None:
            # the evaluation was decided: only the decided prefix's samples are still wanted (a relaunch after it)
            pieces = [p for p in pieces if self.records[p[0]]["sample_id"] in prefix]
            self.stopped = True
        self.pieces = missing_requests(pieces, [r["sample_id"] for r in self.records], written,
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
        self._gate: pacing.RoundGate | None = None      # pacing of an evaluation that may stop early
        self._position: dict[int, int] = {}
        self._withdrawn: frozenset | None = None

    def generate(self) -> None:
        from evaldag.engines.base import Finished, Withdrawn

        every_requests, every_s = chunk_policy()
        t1 = time.perf_counter()
        self.report(force=True)
        requests, rank = self._ordered_requests()
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
                    elif isinstance(event, Withdrawn):
                        # spent on requests no row will hold: kept for the decision's token count
                        decide.record_withdrawn(self.plan, self.shard, self._attempt, event.tokens)
                    elif event.tokens is not None:
                        self.running_tokens, self.running_counts = event.tokens, event.counts
                        self.counts_fresh = True
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
        self.counts_fresh = True
        self.report(force=True)

    def _ordered_requests(self) -> tuple[list, dict[str, int]]:
        """The engine requests of the pieces to do, in the order they are submitted, and the decision order's rank
        of each problem."""
        from evaldag.engines.base import Request, request_seed

        seed = self.plan.sampling.seed
        # a run of samples first..first+count-1 is one request of n = count seeded `seed + first`: vLLM seeds its
        # k-th sample `seed + k`, so the run's samples equal those of the whole request (evaldag.request.sharding.splits_samples)
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
        return requests, rank

    def _pacing(self, requests: list, window: int, rank: dict[str, int]) -> dict:
        """The engine options of an evaluation that may stop early (evaldag.decisions.decide): `window` requests in
        flight, held back by the round gate, and withdrawn once the parent stops it."""
        self._position = {r.key: k for k, r in enumerate(requests)}
        _, _, rounds = self.view.decide
        places = [rank[self.records[self.pieces[r.key][0]]["sample_id"]] for r in requests]
        self._gate = pacing.RoundGate(pacing.round_of(places, decide.round_ends(len(rank), rounds)), rounds)
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
        # the engine's running counts still hold this request's tokens until its next report
        self.running_tokens = max(0, self.running_tokens - sum(c.completion_tokens for c in completions))
        if self.running_counts:
            self.running_counts = without_finished(self.running_counts, [c.completion_tokens for c in completions])
            self.counts_fresh = False
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

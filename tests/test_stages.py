"""Stage caching and locking, with a counting stand-in engine (the real engine runs in test_engine_hf/test_e2e):
identical evaluations at once compute once; a grading-only change re-grades without regenerating."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import polars as pl
import pytest
from upath import UPath

from conftest import complete_checkpoint
from index_engine import ByIndexEngine
from evaldag import engines, paths
from evaldag.pipeline import generate, shard_runs
from evaldag.engines.base import Completion, EngineBase, request_seed
from evaldag.request.plan import EvalRequest, resolve
from evaldag.storage.schema import GENERATION_SCHEMA, write_table
from evaldag.pipeline.chunks import merge_chunks, missing_requests
from evaldag.pipeline.generate import generate_shard
from evaldag.pipeline.grade import grade_shard
from evaldag.pipeline.reduce import reduce_results
from evaldag.storage import store


class CountingEngine(EngineBase):
    """A stand-in engine: batches of 2 prompts, answers derived from the prompt and the batch seed, slow enough for
    a concurrent duplicate to arrive meanwhile; counts batches and can crash at a chosen batch."""

    calls = 0            # generate_batch calls
    crash_at = None      # batch index that raises (a node dying mid-shard)

    def plan_batches(self, prompts, sampling):
        return [list(range(lo, min(lo + 2, len(prompts)))) for lo in range(0, len(prompts), 2)]

    def generate_batch(self, prompts, sampling, batch_index):
        if batch_index == type(self).crash_at:
            raise ConnectionError("node lost")
        type(self).calls += 1
        time.sleep(0.3)
        return [[Completion(text=f"{len(p)}-{sampling.seed + batch_index}-{k}", token_ids=[1, 2, 3],
                            prompt_tokens=5, completion_tokens=3, finish_reason="stop", latency_s=0.3,
                            batch_size=len(prompts)) for k in range(sampling.n)] for p in prompts]

    def close(self):
        pass


@pytest.fixture
def setup(tmp_path, monkeypatch):
    ckpt = complete_checkpoint(tmp_path / "ckpt")
    CountingEngine.calls, CountingEngine.crash_at = 0, None
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: CountingEngine())
    configs = tmp_path / "configs"
    shutil.copytree(paths.REPO_ROOT / "configs", configs)
    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(configs))
    return ckpt, configs, tmp_path / "results"


def _plan(ckpt, results):
    return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=3, num_shards=1), results)


def test_identical_evaluations_at_once_generate_once(setup, caplog):
    ckpt, _, results = setup
    plan = _plan(ckpt, results)
    out = []
    threads = [threading.Thread(target=lambda: out.append(generate_shard(plan, 0))) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="evaldag"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert CountingEngine.calls == 2          # 3 problems in batches of 2: generated once, not twice
    assert out[0] == out[1] and out[0].is_file()
    # they really ran at once: one found the lock taken and waited (the e2e twins test does this across processes)
    assert caplog.text.count("is being written by another process (an identical evaluation): waiting for it") == 1, caplog.text


def test_grading_change_regrades_without_regenerating(setup):
    ckpt, configs, results = setup
    plan = _plan(ckpt, results)
    generate_shard(plan, 0)
    first = grade_shard(plan, 0, workers=0)
    cfg = configs / "benchmarks" / "aime24.yaml"
    cfg.write_text(cfg.read_text() + "strip_thinking: true\n")
    changed = _plan(ckpt, results)
    assert changed.generation_key == plan.generation_key and changed.grade_key != plan.grade_key
    generate_shard(changed, 0)
    second = grade_shard(changed, 0, workers=0)
    assert CountingEngine.calls == 2                  # generations reused (2 batches, generated once)
    assert second != first and second.is_file()       # grades recomputed into their own file
    record = json.loads(changed.cache_record_path(0).read_text())
    assert record == {"generate": "reused", "grade": "computed"}


def test_killed_shard_resumes_from_its_last_batch(setup):
    """A shard that dies after its first batch regenerates only the rest, and the result equals a clean run."""
    import polars as pl

    ckpt, _, results = setup
    plan = _plan(ckpt, results)
    CountingEngine.crash_at = 1
    with pytest.raises(ConnectionError):
        generate_shard(plan, 0)
    assert CountingEngine.calls == 1 and not plan.generations_path(0).exists()
    CountingEngine.crash_at = None
    resumed = pl.read_parquet(generate_shard(plan, 0))
    assert CountingEngine.calls == 2                          # only the missing batch
    stats = json.loads(plan.stats_path("generate", 0).read_text())
    assert stats["resumed_batches"] == 1

    clean_plan = _plan(ckpt, results.parent / "clean")
    clean = pl.read_parquet(generate_shard(clean_plan, 0))
    assert resumed.drop("latency_s").equals(clean.drop("latency_s"))
    assert resumed.height == 3 and resumed["sample_id"].n_unique() == 3


class BoxedSevenEngine(CountingEngine):
    """Every completion answers 7."""

    def generate_batch(self, prompts, sampling, batch_index):
        return [[Completion(text=r"The answer is $\boxed{7}$.", token_ids=[1, 2], prompt_tokens=5, completion_tokens=2,
                            finish_reason="stop", latency_s=0.1, batch_size=len(prompts))
                 for _ in range(sampling.n)] for _ in prompts]


def test_regrading_uses_the_current_gold_not_the_copy_in_the_generations(setup, monkeypatch):
    """A gold-normalisation fix changes the gold of the plan's inputs, not the generations (which are reused): the
    shard is regraded against the new gold, never against the gold frozen into the cached generations."""
    import polars as pl

    from evaldag.request import datasets
    from evaldag.scoring import gold

    ckpt, _, results = setup
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: BoxedSevenEngine())
    plan = _plan(ckpt, results)
    generate_shard(plan, 0)
    before = pl.read_parquet(grade_shard(plan, 0, workers=0))
    assert before["status"].to_list() == ["wrong"] * 3            # the real golds are not 7

    real = gold.normalize_gold
    monkeypatch.setattr(datasets, "normalize_gold", lambda raw, fmt: "7" if raw == "204" else real(raw, fmt))
    fixed = _plan(ckpt, results)
    assert fixed.generation_key == plan.generation_key            # the generations are reused...
    assert fixed.grade_key != plan.grade_key                      # ...the grades are not: a gold changed
    generate_shard(fixed, 0)
    after = pl.read_parquet(grade_shard(fixed, 0, workers=0)).sort("sample_id")
    changed = after.filter(pl.col("gold_raw") == "204")
    assert changed.height == 1 and changed["gold"].to_list() == ["7"] and changed["status"].to_list() == ["correct"]
    assert after.filter(pl.col("gold_raw") != "204")["status"].to_list() == ["wrong", "wrong"]


def test_grading_timeout_is_part_of_grade_key(setup):
    ckpt, configs, results = setup
    plan = _plan(ckpt, results)
    cfg = configs / "benchmarks" / "aime24.yaml"
    cfg.write_text(cfg.read_text().replace("grading_timeout_s: 10", "grading_timeout_s: 30"))
    longer = _plan(ckpt, results)
    assert longer.generation_key == plan.generation_key and longer.grade_key != plan.grade_key


def test_timed_out_grades_are_regraded_not_cached_for_good(setup, monkeypatch):
    """A grade that timed out on a loaded machine is not a result: the next run of the shard grades those rows
    again (and only those), and a finished-looking shard with timeouts is not skipped."""
    import polars as pl

    from evaldag.scoring import grading
    from evaldag.pipeline.records import shard_done

    ckpt, _, results = setup
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: BoxedSevenEngine())
    plan = _plan(ckpt, results)
    generate_shard(plan, 0)
    real, calls = grading._grade_inline, []

    def loaded_machine(completion, gold, finish_reason, timeout_s):
        calls.append(gold)
        return grading._timeout_grade(timeout_s) if len(calls) == 2 else real(completion, gold, finish_reason,
                                                                              timeout_s)

    monkeypatch.setattr(grading, "_grade_inline", loaded_machine)
    first = pl.read_parquet(grade_shard(plan, 0, workers=0))
    assert first["status"].to_list().count("timeout") == 1 and len(calls) == 3
    assert shard_done(plan, 0) is None, "a shard with timed-out grades must run again"
    again = pl.read_parquet(grade_shard(plan, 0, workers=0))
    assert len(calls) == 4                                   # only the timed-out row was graded again
    assert again["status"].to_list() == ["wrong"] * 3
    kept = [c for c in again.columns if c not in ("status", "pred", "grade_s", "answer_group")]
    assert again.select(kept).equals(first.select(kept))
    assert shard_done(plan, 0) is not None


class TwoPowersEngine(CountingEngine):
    """Two different huge powers per problem: comparing them makes sympy expand 2^(2^30), for minutes."""

    def generate_batch(self, prompts, sampling, batch_index):
        texts = [r"$\boxed{2^{2^{30}}}$", r"$\boxed{4^{2^{29}}}$"]
        return [[Completion(text=texts[k % 2], token_ids=[1], prompt_tokens=5, completion_tokens=1,
                            finish_reason="stop", latency_s=0.1, batch_size=len(prompts))
                 for k in range(sampling.n)] for _ in prompts]


def test_answer_grouping_is_bounded_like_grading(setup, monkeypatch):
    """maj@k's answer grouping compares wrong answers with math-verify; a pathological pair is cut at the grading
    timeout (and counted as two different answers) instead of hanging the grade stage."""
    import polars as pl

    from evaldag.scoring import grading

    ckpt, configs, results = setup
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: TwoPowersEngine())
    cfg = configs / "benchmarks" / "aime24.yaml"
    cfg.write_text(cfg.read_text().replace("grading_timeout_s: 10", "grading_timeout_s: 2"))
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=1, num_shards=1,
                               sampling={"n": 2, "temperature": 0.7}), results)
    generate_shard(plan, 0)

    def graded_as_wrong(df, timeout_s, workers, strip_thinking):    # grading itself is tested elsewhere
        return df.with_columns(pred=pl.Series(["2^{2^{30}}", "4^{2^{29}}"]), status=pl.lit("wrong"),
                               correct=pl.lit(False), grade_s=pl.lit(0.0),
                               answer_group=pl.lit(None, dtype=pl.Int64),
                               steps_checked=pl.lit(0, dtype=pl.Int64), steps_valid=pl.lit(0, dtype=pl.Int64))

    monkeypatch.setattr(grading, "grade_table", graded_as_wrong)
    done: list = []
    failed: list = []

    def grade() -> None:
        try:
            done.append(grade_shard(plan, 0, workers=1))
        except BaseException as e:      # re-raised below: a thread's exception would otherwise read as a hang
            failed.append(e)

    worker = threading.Thread(target=grade, daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(timeout=90)
    if failed:
        raise failed[0]
    assert done, f"the grade stage hung in answer grouping for {time.perf_counter() - t0:.0f} s"
    graded = pl.read_parquet(done[0])
    assert graded["answer_group"].to_list() == [0, 1]                  # not shown equal: two answers
    assert json.loads(plan.stats_path("grade", 0).read_text())["grouping_timeouts"] == 1


class SeedRecordingEngine(CountingEngine):
    seeds: list = []

    def generate_batch(self, prompts, sampling, batch_index):
        type(self).seeds.append(sampling.seed + batch_index)    # what the hf engine seeds torch with
        return super().generate_batch(prompts, sampling, batch_index)


def test_shards_draw_from_different_random_streams(setup, monkeypatch):
    """Two shards of one sampled evaluation must not share a random stream (the first batch of every shard was
    seeded alike), and a shard generated again repeats its own."""
    ckpt, _, results = setup
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: SeedRecordingEngine())
    SeedRecordingEngine.seeds = []
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=4, num_shards=2,
                               sampling={"n": 2, "temperature": 0.7}), results)
    for shard in (0, 1):
        generate_shard(plan, shard)
    first = list(SeedRecordingEngine.seeds)
    assert len(first) == 2 and len(set(first)) == 2, first         # one batch per shard, two streams
    again = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=4, num_shards=2,
                                sampling={"n": 2, "temperature": 0.7}), results.parent / "again")
    SeedRecordingEngine.seeds = []
    for shard in (0, 1):
        generate_shard(again, shard)
    assert SeedRecordingEngine.seeds == first


def test_progress_is_reported_per_batch_and_on_resume_and_reuse(setup):
    """The progress callback hears problems done after every batch, starts from the resumed batches, and a reused
    shard reports itself complete at once."""
    ckpt, _, results = setup
    plan = _plan(ckpt, results)
    heard = []
    CountingEngine.crash_at = 1
    with pytest.raises(ConnectionError):
        generate_shard(plan, 0, lambda p: heard.append((p.done, p.total, p.tokens)))
    assert heard == [(0, 3, 0), (2, 3, 6)]                     # 3 problems, batches of 2, 3 tokens each
    CountingEngine.crash_at = None
    heard.clear()
    generate_shard(plan, 0, lambda p: heard.append((p.done, p.total, p.tokens)))
    assert heard == [(2, 3, 6), (3, 3, 9)]     # resumed from the first batch's chunk, its tokens still counted
    heard.clear()
    generate_shard(plan, 0, lambda p: heard.append((p.done, p.total, p.tokens)))
    assert heard == [(3, 3, 9)]                  # reused: complete at once, with the tokens of its rows


# ---------------------------------------------------------------------- per-request engines (vLLM's way)


class StreamingEngine:
    """A stand-in for an engine that batches continuously (vLLM): every request in at once, shortest prompt
    finishing first, one request every `delay` seconds, with a Running report of the tokens of the unfinished
    ones before each; a request's `n` completions derive from its own seed as vLLM seeds them, the k-th from
    seed + k. Its plan_batches/generate_batches (one batch
    of 64, the whole shard, grouped from the same requests) are what a per-batch stage would use."""

    delay = 0.05
    run_cap = None              # sequences it runs at once (vLLM's max_num_seqs): the rest are reported queued
    crash_after = None          # finished requests after which it raises (a node dying mid-shard)
    generated: list = []        # keys of the requests it generated, over all instances
    on_finish = None            # called with the request just finished, before it is yielded
    submitted: list = []        # the keys of each call's requests, in the order they were handed over

    def plan_batches(self, prompts, sampling):
        return [list(range(lo, min(lo + 64, len(prompts)))) for lo in range(0, len(prompts), 64)]

    in_flight: list = []        # the max_in_flight each call was given (None: all at once)

    def generate_requests(self, requests, sampling, max_in_flight=None, hold=None, withdrawn=None):
        from evaldag.engines.base import Finished, Running

        type(self).submitted.append([r.key for r in requests])
        type(self).in_flight.append(max_in_flight)
        order = sorted(requests, key=lambda r: (len(r.prompt), r.key))
        for j, r in enumerate(order):
            if withdrawn is not None and r.key in (withdrawn() or ()):
                continue        # withdrawn by the caller (an evaluation decided early): never finished
            if j == type(self).crash_after:
                raise ConnectionError("node lost")
            time.sleep(type(self).delay)
            left = len(order) - j
            running = left if type(self).run_cap is None else min(left, type(self).run_cap)
            yield Running(tokens=7 * running,                         # 7 tokens so far per running request
                          counts=(7,) * running, queued=None if type(self).run_cap is None else left - running)
            type(self).generated.append(r.key)
            if type(self).on_finish is not None:
                type(self).on_finish(r)
            yield Finished(r.key, [Completion(text=f"sampled with seed {r.seed + k}", token_ids=[1, 2, 3],
                                              prompt_tokens=5, completion_tokens=10, finish_reason="stop",
                                              latency_s=0.01 * (j + 1), batch_size=len(requests))
                                   for k in range(r.n or sampling.n)])

    def generate_batches(self, batches, sampling):
        from evaldag.engines.base import Finished, Request, request_seed

        requests = [Request((b, k), p, request_seed(sampling.seed, f"{b}:{k}")) for b, ps in batches
                    for k, p in enumerate(ps)]
        got: dict = {}
        for event in self.generate_requests(requests, sampling):
            if isinstance(event, Finished):
                got[event.key] = event.completions
        for b, ps in batches:
            yield b, [got[(b, k)] for k in range(len(ps))]

    def close(self):
        pass


@pytest.fixture
def streaming(setup, monkeypatch):
    StreamingEngine.delay, StreamingEngine.crash_after, StreamingEngine.on_finish = 0.05, None, None
    StreamingEngine.run_cap = None
    StreamingEngine.generated = []
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: StreamingEngine())
    monkeypatch.setenv("EVALDAG_CHUNK_REQUESTS", "3")
    monkeypatch.setenv("EVALDAG_CHUNK_S", "60")
    return setup


def _generate_streaming(plan, delay: float) -> None:
    """generate_shard with the StreamingEngine, in a process of its own (the target of a spawned process)."""
    StreamingEngine.delay = delay
    engines.load_engine = lambda *a, **k: StreamingEngine()
    generate_shard(plan, 0)


def _plan_of(ckpt, results, limit=8, **sampling):
    return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=limit, num_shards=1,
                               sampling=sampling or None), results)


def _chunk_tokens(plan) -> int:
    """Completion tokens of the rows in shard 0's chunks."""
    chunks = plan.generations_path(0).with_name(plan.generations_path(0).stem + ".chunks")
    return sum(int(pl.read_parquet(p)["completion_tokens"].sum()) for p in chunks.glob("requests-*.parquet"))


def _chunk_rows(plan) -> list[int]:
    """Rows per chunk file of shard 0, in the order they were written."""
    import polars as pl

    chunks = plan.generations_path(0).with_name(plan.generations_path(0).stem + ".chunks")
    return [pl.read_parquet(p).height for p in sorted(chunks.glob("*.parquet"), key=str)]


def test_finished_requests_are_written_every_n_requests(streaming):
    """With 3 requests per chunk, 8 problems x n=2 become durable 3 problems at a time while they finish, not as
    one batch at the end."""
    ckpt, _, results = streaming
    plan = _plan_of(ckpt, results, n=2, temperature=0.7)
    seen = []
    StreamingEngine.on_finish = lambda r: seen.append(_chunk_rows(plan))
    generate_shard(plan, 0)
    # what was on disk as each request finished: a chunk of 3 problems (6 rows) after every third
    assert seen == [[]] * 3 + [[6]] * 3 + [[6, 6]] * 2, seen


def test_finished_requests_are_written_every_t_seconds(streaming, monkeypatch):
    """A chunk is also written when its oldest request has waited EVALDAG_CHUNK_S, however few requests it holds:
    slow requests become durable within that time, not when enough of them have finished."""
    ckpt, _, results = streaming
    monkeypatch.setenv("EVALDAG_CHUNK_REQUESTS", "64")
    monkeypatch.setenv("EVALDAG_CHUNK_S", "0.25")
    StreamingEngine.delay = 0.15
    plan = _plan_of(ckpt, results, limit=6)
    seen = []
    StreamingEngine.on_finish = lambda r: seen.append(sum(_chunk_rows(plan)))
    generate_shard(plan, 0)
    # the first rows are on disk well before the last request finishes, and never more than 2 requests behind
    assert seen[-1] >= 3 and all(len(seen[:j]) - rows <= 2 for j, rows in enumerate(seen)), seen


def test_shard_killed_mid_generation_resumes_with_every_row_exactly_once(streaming):
    """kill -9 in the middle of generation: the requests in written chunks are kept, the resumed run generates only
    the others, and the result equals an uninterrupted run's (seeds per request, not per batch or chunk)."""
    import multiprocessing
    import os
    import signal

    import polars as pl

    ckpt, _, results = streaming
    plan = _plan_of(ckpt, results, n=2, temperature=0.7)
    # spawn, not fork: a forked child of a process that has used polars' thread pool can deadlock
    child = multiprocessing.get_context("spawn").Process(target=_generate_streaming, args=(plan, 0.3))
    child.start()
    deadline = time.monotonic() + 60
    while sum(_chunk_rows(plan)) < 6 and time.monotonic() < deadline:   # the first chunk: 3 problems x n=2
        assert child.is_alive(), f"the shard process ended ({child.exitcode}) before it was killed"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    kept = sum(_chunk_rows(plan)) // 2
    assert 3 <= kept < 8 and not plan.generations_path(0).exists(), kept

    StreamingEngine.delay, StreamingEngine.generated = 0.0, []
    resumed = pl.read_parquet(generate_shard(plan, 0))
    assert len(StreamingEngine.generated) == 8 - kept                       # only what no chunk held
    assert json.loads(plan.stats_path("generate", 0).read_text())["resumed_problems"] == kept
    clean = pl.read_parquet(generate_shard(_plan_of(ckpt, results.parent / "clean", n=2, temperature=0.7), 0))
    assert resumed.height == 16 and resumed.select("sample_id", "sample_index").is_unique().all()
    assert resumed.drop("latency_s", "batch_size").equals(clean.drop("latency_s", "batch_size"))


def test_an_engine_failure_keeps_the_requests_that_finished_before_it(streaming):
    """A failure the process survives (the engine raising, a retried task) writes what finished before it."""
    import polars as pl

    ckpt, _, results = streaming
    StreamingEngine.crash_after = 5
    plan = _plan_of(ckpt, results)
    with pytest.raises(ConnectionError):
        generate_shard(plan, 0)
    assert sum(_chunk_rows(plan)) == 5
    kept = _chunk_tokens(plan)
    StreamingEngine.crash_after, StreamingEngine.generated = None, []
    heard = []
    out = pl.read_parquet(generate_shard(plan, 0, heard.append))
    assert out.height == 8 and len(StreamingEngine.generated) == 3
    # the retry's progress counts the tokens of the rows the failed attempt kept: its count never falls back
    assert heard[0].tokens == kept > 0 and heard[-1].tokens == out["completion_tokens"].sum()


def test_sampled_rows_do_not_depend_on_chunking_or_sharding(streaming, monkeypatch):
    """A request's seed derives from (evaluation seed, sample id) alone: the same rows whether written one request
    per chunk or all in one, and whether the problem is in shard 0 of 1 or shard 1 of 2."""
    import polars as pl

    ckpt, _, results = streaming
    monkeypatch.setenv("EVALDAG_CHUNK_REQUESTS", "1")
    one = pl.read_parquet(generate_shard(_plan_of(ckpt, results / "a", n=2, temperature=0.7), 0))
    monkeypatch.setenv("EVALDAG_CHUNK_REQUESTS", "64")
    many = pl.read_parquet(generate_shard(_plan_of(ckpt, results / "b", n=2, temperature=0.7), 0))
    assert one.drop("latency_s").equals(many.drop("latency_s"))
    assert one["completion"].n_unique() == one.height                     # every (sample, sample_index) its own
    two = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=2,
                              sampling={"n": 2, "temperature": 0.7}), results / "c")
    second = pl.read_parquet(generate_shard(two, 1))
    keys = ["sample_id", "sample_index", "completion"]
    assert second.height == 8 and second.select(keys).join(one.select(keys), on=keys, how="anti").height == 0


def test_requests_are_submitted_in_a_seeded_random_order(streaming):
    """The engine gets the shard's requests shuffled (the forecast of the end needs an order unrelated to length;
    the plan's is longest prompt first), the same shuffle every time: the evaluation's decision order, all at once
    (no in-flight limit unless the evaluation may stop early)."""
    from evaldag.decisions.decide import decision_order

    ckpt, _, results = streaming
    StreamingEngine.submitted, StreamingEngine.in_flight = [], []
    plan = _plan_of(ckpt, results / "a")
    generate_shard(plan, 0)
    generate_shard(_plan_of(ckpt, results / "b"), 0)
    first, second = StreamingEngine.submitted
    assert sorted(first) == list(range(8)) and first != list(range(8)) and first == second
    ids = plan.shard_inputs(0)["sample_id"].to_list()
    assert [ids[k] for k in first] == decision_order(ids, plan.sampling.seed)
    assert StreamingEngine.in_flight == [None, None]


def test_progress_carries_the_forecast_of_the_shards_end(streaming, monkeypatch):
    """Each report forecasts tokens and seconds left (evaldag.pipeline.time_left) once a rate is known; the last says none."""
    from evaldag.pipeline import time_left

    ckpt, _, results = streaming
    monkeypatch.setattr(shard_runs, "PROGRESS_S", 0.0, raising=False)
    monkeypatch.setattr(time_left, "MIN_SPAN_S", 0.1)
    heard, plan = [], _plan_of(ckpt, results)
    generate_shard(plan, 0, heard.append)
    cap = plan.sampling.max_new_tokens
    assert heard[0].tokens_left == 8 * cap and heard[0].seconds_left is None     # nothing known: all to the cap
    middle = [p for p in heard[1:-1] if p.seconds_left is not None and p.done < 8]
    assert middle and all(p.tokens_left > 0 and p.tokens_per_s > 0 for p in middle), heard
    # the report as the last request finishes, before the engine's next one, no longer counts it as running
    assert [p.tokens_left for p in heard[1:-1] if p.done == 8] == [0], heard
    # once requests of 10 tokens have finished, the running ones (7 tokens so far) have 3 left, like them
    assert any(p.tokens_left == 3 * (8 - p.done) for p in middle if p.done >= 2), heard
    assert (heard[-1].done, heard[-1].tokens_left, heard[-1].seconds_left) == (8, 0, 0.0)


def test_the_forecast_knows_when_the_running_counts_predate_a_finish(streaming, monkeypatch):
    """The forecast is told whether the engine's running counts are as of every finished request (right after
    an engine report) or older than the last finish (time_left.TimeLeft.estimate's `fresh`)."""
    from evaldag.engines.base import Finished, Running
    from evaldag.pipeline import time_left

    ckpt, _, results = streaming
    monkeypatch.setattr(shard_runs, "PROGRESS_S", 0.0, raising=False)
    events, calls = [], []
    original = StreamingEngine.generate_requests

    def recorded(self, *a, **k):
        for event in original(self, *a, **k):
            events.append(type(event))
            yield event

    def estimate(self, tokens, running, not_started=None, fresh=True):
        calls.append((len(events), fresh))
        return real_estimate(self, tokens, running, not_started, fresh)

    real_estimate = time_left.TimeLeft.estimate
    monkeypatch.setattr(StreamingEngine, "generate_requests", recorded)
    monkeypatch.setattr(time_left.TimeLeft, "estimate", estimate)
    generate_shard(_plan_of(ckpt, results), 0, lambda p: None)
    during = [(n, fresh) for n, fresh in calls if 0 < n < len(events)]
    assert during and {fresh for _, fresh in during} == {True, False}
    for n, fresh in during:
        assert fresh == (events[n - 1] is Running), (n, events[n - 1], fresh)
    assert calls[-1][1] is True                                  # the last report: nothing runs, nothing is old
    assert Finished in events


def test_the_forecast_counts_what_the_engine_queues_as_not_started(streaming, monkeypatch):
    """An engine that runs 2 sequences at once and reports the others as queued (vLLM's max_num_seqs,
    Running.queued): the queued ones are still to generate (10 tokens each, like the finished), not finished samples
    of running requests."""
    from evaldag.pipeline import time_left

    ckpt, _, results = streaming
    monkeypatch.setattr(shard_runs, "PROGRESS_S", 0.0, raising=False)
    monkeypatch.setattr(time_left, "MIN_SPAN_S", 0.1)
    StreamingEngine.run_cap = 2
    heard = []
    generate_shard(_plan_of(ckpt, results), 0, heard.append)
    middle = [p for p in heard[1:-1] if p.seconds_left is not None and p.done <= 5]
    assert middle, heard
    # right after the engine's report 2 run (3 tokens left each); right after a finish, before the engine's next
    # report, 1 runs and the one that takes its place is still queued (10 tokens)
    after = {r: [p for p in middle if p.tokens_left == r * 3 + 10 * (8 - p.done - r)] for r in (1, 2)}
    assert after[1] and after[2] and len(after[1]) + len(after[2]) == len(middle), heard


def test_progress_counts_requests_and_running_tokens_as_they_happen(streaming, monkeypatch):
    """Progress moves as each request finishes and carries the tokens of the running ones, long before the last
    (longest) request of the shard finishes; throttled to PROGRESS_S; the last report is exact."""

    ckpt, _, results = streaming
    monkeypatch.setattr(shard_runs, "PROGRESS_S", 0.0, raising=False)
    plan = _plan_of(ckpt, results)
    heard = []
    StreamingEngine.on_finish = lambda r: heard.append(("finish", r.key))
    generate_shard(plan, 0, lambda p: heard.append((p.done, p.total, p.tokens)))
    before_last = heard[:heard.index(("finish", StreamingEngine.generated[-1]))]
    reports = [h for h in before_last if h[0] != "finish"]
    assert reports[0] == (0, 8, 0)
    assert reports[1] == (0, 8, 56)                         # tokens of 8 running requests, none finished yet
    assert max(done for done, _, _ in reports) == 7         # every earlier request counted as it finished
    tokens = [t for _, _, t in reports]
    assert tokens == sorted(tokens)                         # never backwards
    assert heard[-1] == (8, 8, 80)                          # 8 requests x 10 tokens, nothing running

    monkeypatch.setattr(shard_runs, "PROGRESS_S", 3600.0, raising=False)
    heard.clear()
    StreamingEngine.on_finish = None
    generate_shard(_plan_of(ckpt, results / "again"), 0, lambda p: heard.append((p.done, p.total, p.tokens)))
    assert heard == [(0, 8, 0), (8, 8, 80)]                 # throttled: only the first and the last


def test_split_samples_are_the_whole_requests_samples_each_once(streaming, monkeypatch):
    """A plan that splits every problem's samples over the shards (vLLM, n > 1): over the shards, every (problem,
    sample) is generated once, and equals that sample of the unsplit request (a run of samples a..b is one request
    of n = b - a + 1 seeded seed + a, as vLLM seeds sample k of a request seed + k)."""
    import polars as pl

    ckpt, _, results = streaming
    whole = pl.read_parquet(generate_shard(_plan_of(ckpt, results / "a", n=4, temperature=0.7), 0))
    split = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=3, engine="vllm",
                                sampling={"n": 4, "temperature": 0.7}), results / "b")
    monkeypatch.setattr(generate, "workload", lambda shard: None)   # sizing vLLM reads a real tokenizer
    assert split.num_shards == 3 and split.sample_runs is not None
    parts = [pl.read_parquet(generate_shard(split, s)) for s in range(3)]
    keys = ["sample_id", "sample_index", "completion", "shard_index"]
    assert sorted(p.height for p in parts) == [10, 11, 11]     # runs of 2, 1, 1 samples, rotated over the shards
    assert all(p["sample_id"].n_unique() == 8 for p in parts)           # every shard holds every problem
    together = pl.concat(parts).select(keys[:3]).sort(keys[:3])
    assert together.equals(whole.select(keys[:3]).sort(keys[:3]))


def test_a_problems_samples_go_in_one_by_one_round_by_round_and_resume_to_the_whole_requests_rows(streaming,
                                                                                                  monkeypatch):
    """vLLM, n = 16: every sample is a request of its own, and each problem's samples go in 8 rounds of 2
    (evaldag.request.sharding.sample_pieces): every problem's first two before any problem's next two, each round along
    the decision order, so the finished ones are a fair sample of every problem early on, each heard as it ends. A
    shard that fails midway resumes with only the samples no chunk holds; its rows equal those of one request per
    problem (seeds per sample), and its progress counts samples."""
    from evaldag.decisions.decide import decision_order

    ckpt, _, results = streaming
    monkeypatch.setattr(generate, "workload", lambda shard: None)   # sizing vLLM reads a real tokenizer

    def vllm_plan(folder):
        return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=1, engine="vllm",
                                   sampling={"n": 16, "temperature": 0.7}), results / folder)

    plan = vllm_plan("dealt")
    seen = []
    StreamingEngine.submitted, StreamingEngine.crash_after, StreamingEngine.delay = [], 40, 0.0
    StreamingEngine.on_finish = seen.append
    with pytest.raises(ConnectionError):
        generate_shard(plan, 0)
    ids = plan.shard_inputs(0)["sample_id"].to_list()
    first = StreamingEngine.submitted[0]
    assert len(first) == 128 and {r.n for r in seen} == {1}
    # the k-th request submitted: problem of round k // 16, samples 2r and 2r + 1 of each problem in that round
    by_key = {r.key: r for r in seen}
    order = decision_order(ids, plan.sampling.seed)
    assert [ids.index(sid) for sid in order] == [stages_piece[0] for stages_piece in
                                                 [_piece_of(plan, k) for k in first[:16:2]]]
    assert all(_piece_of(plan, k)[1] // 2 == n // 16 for n, k in enumerate(first))       # round by round
    assert {(_piece_of(plan, k)[0], _piece_of(plan, k)[1]) for k in first} == {(i, s) for i in range(8)
                                                                                 for s in range(16)}
    assert all(by_key[k].seed == request_seed(plan.sampling.seed, ids[_piece_of(plan, k)[0]]) + _piece_of(plan, k)[1]
               for k in by_key)
    assert sum(_chunk_rows(plan)) == 40                     # the 40 samples that finished before the failure

    StreamingEngine.crash_after, StreamingEngine.generated, StreamingEngine.on_finish = None, [], None
    monkeypatch.setattr(shard_runs, "PROGRESS_S", 0.0, raising=False)
    heard = []
    resumed = pl.read_parquet(generate_shard(plan, 0, heard.append))
    assert len(StreamingEngine.generated) == 128 - 40       # only what no chunk held
    assert resumed.height == 8 * 16 and resumed.select("sample_id", "sample_index").is_unique().all()
    # progress counts samples, the resumed ones included, one at a time
    assert (heard[0].done, heard[0].total, heard[0].unit) == (40, 128, "samples") and heard[-1].done == 128
    assert {b.done - a.done for a, b in zip(heard, heard[1:])} <= {0, 1}
    monkeypatch.setattr(shard_runs, "splits_samples", lambda engine, n: False)    # one request of 16 per problem
    StreamingEngine.submitted = []
    whole = pl.read_parquet(generate_shard(vllm_plan("whole"), 0))
    assert len(StreamingEngine.submitted[0]) == 8
    cols = ["sample_id", "sample_index", "completion"]
    assert resumed.select(cols).equals(whole.select(cols))


def _piece_of(plan, key: int) -> tuple[int, int, int, int]:
    """The request `key` of a fresh dealt shard 0: (problem, first sample, samples, round)."""
    from evaldag.request.sharding import sample_pieces

    ids = plan.shard_inputs(0)["sample_id"].to_list()
    return missing_requests(sample_pieces(plan.shard_runs(0)), ids, set(), one_per_sample=True)[key]


def test_a_shard_resumes_per_sample_from_chunks_cut_otherwise(streaming, monkeypatch):
    """A dealt evaluation (one request per sample) fails midway; an evaluation of the same checkpoint that may stop
    early (same generation key, whole problems) then generates only the missing samples, in stretches, so every
    (problem, sample) is generated once and the merge finds each once (a check by first sample would skip a
    partly written problem's other samples, or generate its written ones again)."""
    ckpt, _, results = streaming
    monkeypatch.setattr(generate, "workload", lambda shard: None)
    dealt = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=1, engine="vllm",
                                sampling={"n": 4, "temperature": 0.7}), results)
    StreamingEngine.crash_after, StreamingEngine.delay = 13, 0.0
    with pytest.raises(ConnectionError):
        generate_shard(dealt, 0)
    assert sum(_chunk_rows(dealt)) == 13
    monkeypatch.setattr(shard_runs, "splits_samples", lambda engine, n: False)   # as an evaluation that may stop early
    StreamingEngine.crash_after, StreamingEngine.generated = None, []
    seen = []
    StreamingEngine.on_finish = seen.append
    rows = pl.read_parquet(generate_shard(dealt, 0))
    assert rows.height == 32 and rows.select("sample_id", "sample_index").is_unique().all()
    assert sum(r.n for r in seen) == 32 - 13 and any(r.n > 1 for r in seen)


def test_a_split_plan_is_refused_by_an_engine_that_samples_a_prompt_at_once(setup, monkeypatch):
    """The transformers engine draws a prompt's n samples from one generator: samples 2..3 alone would not be
    samples 2..3 of the whole request, so it refuses a split plan with an error that names the engine."""
    from evaldag.errors import ConfigError

    ckpt, _, results = setup
    split = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=4, num_shards=2, engine="vllm",
                                sampling={"n": 4, "temperature": 0.7}), results)
    monkeypatch.setattr(generate, "workload", lambda shard: None)   # sizing vLLM reads a real tokenizer
    with pytest.raises(ConfigError, match="splits problems' samples over shards.*vllm"):
        generate_shard(split, 0)


def test_a_shards_inputs_are_read_once_per_process(setup, monkeypatch):
    """A shard process loads its plan for each task (generate, grade) and reads the evaluation's inputs.parquet
    once: load_plan keeps one plan object per file and process, and the plan keeps its inputs."""
    from evaldag.request import plan as plan_module
    from evaldag.request.plan import load_plan

    ckpt, _, results = setup
    path = str(_plan(ckpt, results).path("plan.json"))
    plan_module._PLANS.clear()                       # as in a fresh shard process: nothing read yet
    reads = []
    real = plan_module.read_table
    monkeypatch.setattr(plan_module, "read_table", lambda p, schema: reads.append(str(p)) or real(p, schema))
    generate_shard(load_plan(path), 0)
    grade_shard(load_plan(path), 0)
    assert reads == [str(load_plan(path).path("inputs.parquet"))]


# ---- found by review: answer groups of split problems, the merge's check --------------------------------------

class VotingEngine(ByIndexEngine):
    """Answers by sample index: sample 0 says 7 (wrong), 1 and 2 the gold, 3 says 9 (wrong). maj@4 is then
    correct for every problem (the gold has 2 votes, each wrong answer 1)."""

    def answer(self, prompt: str, index: int) -> str:
        return {0: "7", 3: "9"}.get(index, str(int(type(self).gold[prompt])))


def _metrics(plan):
    VotingEngine.learn(plan)
    paths = []
    for s in range(plan.num_shards):
        generate_shard(plan, s)
        paths.append(grade_shard(plan, s, workers=0))
    return reduce_results(plan, paths)


def test_maj_at_k_of_a_split_plan_equals_the_unsplit_one(streaming, monkeypatch):
    """Answer groups are numbered per shard at grading; a split problem's samples come from several shards, so
    group 0 of shard A and group 0 of shard B (different answers) are counted as one answer in maj@k."""
    ckpt, _, results = streaming
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: VotingEngine())
    monkeypatch.setattr(generate, "workload", lambda shard: None)
    sampling = {"n": 4, "temperature": 0.7}
    whole = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=4, num_shards=1, engine="vllm",
                                sampling=sampling), results / "a")
    split = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=4, num_shards=2, engine="vllm",
                                sampling=sampling), results / "b")
    assert whole.sample_runs is None and split.sample_runs is not None
    m_whole, m_split = _metrics(whole), _metrics(split)
    assert m_whole["avg@4"] == m_split["avg@4"] == 0.5
    assert m_whole["maj@4"] == 1.0
    assert m_split["maj@4"] == m_whole["maj@4"]


def test_merge_chunks_refuses_a_duplicated_request_that_hides_a_missing_one(tmp_path):
    """Two writers of one shard's chunks (an object store, whose lock holds on one machine only; chunk names are
    numbered per process) can leave request a written twice and request b not at all: the row count still matches,
    so _merge_chunks' count-only check passes and the generations file is cached with a duplicate and a hole."""

    inputs = pl.DataFrame({"sample_id": ["a", "b"], "prompt": ["pa", "pb"], "gold": ["1", "2"],
                           "gold_raw": ["1", "2"], "subject": [None, None], "level": [None, None]},
                          schema={"sample_id": pl.Utf8, "prompt": pl.Utf8, "gold": pl.Utf8, "gold_raw": pl.Utf8,
                                  "subject": pl.Utf8, "level": pl.Int64})

    def rows(sid):
        return pl.DataFrame([{"sample_id": sid, "prompt": "p" + sid, "gold": "1", "gold_raw": "1", "subject": None,
                              "level": None, "sample_index": k, "shard_index": 0, "completion": "x",
                              "completion_ids": [1], "prompt_tokens": 1, "completion_tokens": 1,
                              "finish_reason": "stop", "latency_s": 0.0, "batch_size": 1} for k in range(2)],
                            schema=GENERATION_SCHEMA)

    chunks = UPath(tmp_path / "generations.chunks")
    chunks.mkdir()
    write_table(rows("a"), chunks / "requests-000001.parquet", GENERATION_SCHEMA)
    write_table(rows("a"), chunks / "requests-000002.parquet", GENERATION_SCHEMA)   # the other writer's copy
    with pytest.raises(RuntimeError):
        merge_chunks(chunks, inputs, [(0, 2), (0, 2)], 0)


def test_missing_requests_are_stretches_of_consecutive_missing_samples_only():
    """Sample 1 of problem a is written (a hole in what is missing): the requests are samples 0 and 2-3. One
    stretch 0-2 would generate sample 1 twice and sample 3 never (the merge then refuses the shard at every retry)."""
    assert missing_requests([(0, 0, 4, 0)], ["a"], {("a", 1)}, one_per_sample=False) == [(0, 0, 1, 0), (0, 2, 2, 0)]
    assert missing_requests([(0, 0, 4, 0)], ["a"], {("a", 1)}, one_per_sample=True) == \
        [(0, 0, 1, 0), (0, 2, 1, 0), (0, 3, 1, 0)]
    # consecutive samples stay apart across problems and rounds
    assert missing_requests([(0, 0, 2, 0), (0, 2, 2, 1), (1, 0, 2, 1)], ["a", "b"], set(), one_per_sample=False) == \
        [(0, 0, 2, 0), (0, 2, 2, 1), (1, 0, 2, 1)]


def test_merge_chunks_keeps_the_first_chunks_row_of_a_sample_written_twice(tmp_path):
    """Two attempts of a shard both wrote problem a (same seed, but their rows may differ: a timing, a batch size);
    the first chunk's row, in name order, is kept, whatever order the files are read in."""
    inputs = pl.DataFrame({"sample_id": ["a", "b"], "prompt": ["pa", "pb"], "gold": ["1", "2"],
                           "gold_raw": ["1", "2"], "subject": [None, None], "level": [None, None]},
                          schema={"sample_id": pl.Utf8, "prompt": pl.Utf8, "gold": pl.Utf8, "gold_raw": pl.Utf8,
                                  "subject": pl.Utf8, "level": pl.Int64})

    def rows(sid, completion, batch_size):
        return pl.DataFrame([{"sample_id": sid, "prompt": "p" + sid, "gold": "1", "gold_raw": "1", "subject": None,
                              "level": None, "sample_index": k, "shard_index": 0, "completion": f"{completion}{k}",
                              "completion_ids": [1], "prompt_tokens": 1, "completion_tokens": 1,
                              "finish_reason": "stop", "latency_s": 0.0, "batch_size": batch_size}
                             for k in range(2)], schema=GENERATION_SCHEMA)

    chunks = UPath(tmp_path / "generations.chunks")
    chunks.mkdir()
    write_table(rows("b", "b", 1), chunks / "requests-000003.parquet", GENERATION_SCHEMA)
    write_table(rows("a", "later", 2), chunks / "requests-000002.parquet", GENERATION_SCHEMA)
    write_table(rows("a", "first", 1), chunks / "requests-000001.parquet", GENERATION_SCHEMA)
    df = merge_chunks(chunks, inputs, [(0, 2), (0, 2)], 0)
    assert df["completion"].to_list() == ["first0", "first1", "b0", "b1"]
    assert df["batch_size"].to_list() == [1, 1, 1, 1]


def test_two_attempts_writing_one_shards_chunks_merge_to_every_sample_once(streaming, monkeypatch):
    """Two attempts of one shard generating at once on an object store (its lock holds on one machine; a retry
    beside a revived original): each read no chunk when it started, and they cut their chunks at other places
    (chunks are cut by count and by time). Chunk names were numbered per attempt, so the later attempt's chunks
    replaced the earlier's of the same number, and the earlier's last chunk repeated samples of the later's: the
    merge refused the shard at every retry. Now every attempt's chunks are kept and the merge takes each sample
    once, equal to an uninterrupted run's."""
    ckpt, _, results = streaming
    plan = _plan_of(ckpt, results)
    chunks = store.chunks_dir(plan.generations_path(0))
    monkeypatch.setenv("EVALDAG_CHUNK_REQUESTS", "2")
    StreamingEngine.crash_after = 5               # attempt A: 5 problems written, 2 + 2 + 1 (the last at its failure)
    with pytest.raises(ConnectionError):
        generate_shard(plan, 0)
    first = chunks.parent / "attempt-a"
    shutil.move(str(chunks), str(first))          # what attempt B saw when it started: no chunk
    monkeypatch.setenv("EVALDAG_CHUNK_REQUESTS", "3")
    StreamingEngine.crash_after = 6               # attempt B: 6 problems, 3 + 3
    with pytest.raises(ConnectionError):
        generate_shard(plan, 0)
    for p in first.iterdir():                     # A's writes, landed first: B's of the same name replace them
        if not (chunks / p.name).exists():
            shutil.copy(p, chunks / p.name)
    StreamingEngine.crash_after = None
    merged = pl.read_parquet(generate_shard(plan, 0))
    clean = pl.read_parquet(generate_shard(_plan_of(ckpt, results.parent / "clean"), 0))
    assert merged.height == 8 and merged.select("sample_id", "sample_index").is_unique().all()
    assert merged.drop("latency_s", "batch_size").equals(clean.drop("latency_s", "batch_size"))

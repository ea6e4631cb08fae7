"""Stage caching and locking, with a counting stand-in engine (the real engine runs in test_engine_hf/test_e2e):
identical evaluations at once compute once; a grading-only change re-grades without regenerating."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import pytest

from conftest import complete_checkpoint
from evaldag import engines, paths
from evaldag.engines.base import Completion, batches_one_by_one
from evaldag.plan import EvalRequest, resolve
from evaldag.stages import generate_shard, grade_shard


class CountingEngine:
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

    def generate_batches(self, batches, sampling):
        return batches_one_by_one(self, batches, sampling)

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

    from evaldag import datasets, grading

    ckpt, _, results = setup
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: BoxedSevenEngine())
    plan = _plan(ckpt, results)
    generate_shard(plan, 0)
    before = pl.read_parquet(grade_shard(plan, 0, workers=0))
    assert before["status"].to_list() == ["wrong"] * 3            # the real golds are not 7

    real = grading.normalize_gold
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

    from evaldag import grading
    from evaldag.stages import shard_done

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

    from evaldag import grading

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
                               answer_group=pl.lit(None, dtype=pl.Int64))

    monkeypatch.setattr(grading, "grade_table", graded_as_wrong)
    done: list = []
    worker = threading.Thread(target=lambda: done.append(grade_shard(plan, 0, workers=1)), daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(timeout=90)
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
        generate_shard(plan, 0, lambda *a: heard.append(a))
    assert heard == [(0, 3, 0), (2, 3, 6)]                     # 3 problems, batches of 2, 3 tokens each
    CountingEngine.crash_at = None
    heard.clear()
    generate_shard(plan, 0, lambda *a: heard.append(a))
    assert heard == [(2, 3, 0), (3, 3, 3)]                     # resumed from the first batch's chunk
    heard.clear()
    generate_shard(plan, 0, lambda *a: heard.append(a))
    assert heard == [(3, 3, 0)]                                # reused

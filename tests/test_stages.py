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
from evaldag.engines.base import Completion
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

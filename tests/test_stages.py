"""Stage caching and locking, with a counting stand-in engine (the real engine runs in test_engine_hf/test_e2e):
identical evaluations at once compute once; a grading-only change re-grades without regenerating."""

from __future__ import annotations

import json
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
    """A stand-in engine that answers "\\boxed{<n>}" slowly and counts its generate calls."""

    calls = 0

    def generate(self, prompts, sampling, progress=None):
        type(self).calls += 1
        time.sleep(0.5)     # long enough for a concurrent duplicate to arrive while this one runs
        return [[Completion(text=f"The answer is $\\boxed{{{i}}}$.", token_ids=[1, 2, 3], prompt_tokens=5,
                            completion_tokens=3, finish_reason="stop", latency_s=0.5, batch_size=len(prompts))
                 for _ in range(sampling.n)] for i, _ in enumerate(prompts)]

    def close(self):
        pass


@pytest.fixture
def setup(tmp_path, monkeypatch):
    ckpt = complete_checkpoint(tmp_path / "ckpt")
    CountingEngine.calls = 0
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: CountingEngine())
    configs = tmp_path / "configs"
    shutil.copytree(paths.REPO_ROOT / "configs", configs)
    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(configs))
    return ckpt, configs, tmp_path / "results"


def _plan(ckpt, results):
    return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=3, num_shards=1), results)


def test_identical_evaluations_at_once_generate_once(setup):
    ckpt, _, results = setup
    plan = _plan(ckpt, results)
    out = []
    threads = [threading.Thread(target=lambda: out.append(generate_shard(plan, 0))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert CountingEngine.calls == 1
    assert out[0] == out[1] and out[0].is_file()


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
    assert CountingEngine.calls == 1                  # generations reused
    assert second != first and second.is_file()       # grades recomputed into their own file
    record = json.loads(changed.cache_record_path(0).read_text())
    assert record == {"generate": "reused", "grade": "computed"}

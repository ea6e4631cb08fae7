"""The eval-loss stage of a shard and its reduce, without a model: a stand-in engine whose tokenizer is one token per
character and whose log-probability of a token is -0.01 x its code, so every problem's loss is known from its
reference text alone (computed here from the dataset file, independently of evaldag)."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest
from conftest import complete_checkpoint
from test_stages import CountingEngine

from evaldag import engines, paths
from evaldag.errors import ConfigError
from evaldag.pipeline.eval_loss import eval_loss_shard
from evaldag.request.shard_plan import shard_plan
from evaldag.pipeline.generate import generate_shard
from evaldag.pipeline.grade import grade_shard
from evaldag.pipeline.loss_files import loss_path
from evaldag.pipeline.records import shard_done
from evaldag.pipeline.reduce import reduce_results
from evaldag.request.plan import EvalRequest, resolve
from evaldag.storage import store


class _CharTokenizer:
    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


class LossEngine(CountingEngine):
    """CountingEngine that also scores given token ids (-0.01 x the id each) and counts the problems it scored."""

    tokenizer = _CharTokenizer()
    scored: list[str] = []

    def score(self, prompts, completion_ids):
        type(self).scored.extend(prompts)
        return [[-0.01 * t for t in ids] for ids in completion_ids]


@pytest.fixture
def plan_with_loss(tmp_path, monkeypatch):
    ckpt = complete_checkpoint(tmp_path / "run" / "checkpoint-100")
    LossEngine.calls, LossEngine.crash_at, LossEngine.scored = 0, None, []
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: LossEngine())
    return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=3, num_shards=1, eval_loss=True),
                   tmp_path / "res")


def _expected_losses(n: int) -> dict[str, float]:
    """Each problem's loss from the mirror itself: mean of 0.01 x code over the stripped solution's characters."""
    rows = [json.loads(line) for line in (paths.data_dir() / "aime24" / "test.jsonl").read_text().splitlines()][:n]
    return {str(r["id"]): sum(0.01 * ord(c) for c in r["solution"].strip()) / len(r["solution"].strip())
            for r in rows}


def test_a_shard_scores_its_solutions_once_and_the_reduce_logs_eval_loss(plan_with_loss):
    plan = plan_with_loss
    assert plan.eval_loss
    generate_shard(plan, 0)
    assert loss_path(plan, 0).is_file() and len(LossEngine.scored) == 3
    generate_shard(plan, 0)                          # generations and losses found: nothing scored again
    assert len(LossEngine.scored) == 3
    metrics = reduce_results(plan, [grade_shard(plan, 0, workers=0)])
    expected = _expected_losses(3)
    assert metrics["eval_loss"] == pytest.approx(sum(expected.values()) / 3, rel=1e-12)
    values = list(expected.values())
    sd = math.sqrt(sum((v - metrics["eval_loss"]) ** 2 for v in values) / 2)
    assert metrics["eval_loss_se"] == pytest.approx(sd / math.sqrt(3), rel=1e-9)
    assert metrics["eval_loss_s"] > 0 and metrics["eval_loss_problems"] == 3.0
    assert json.loads(store.as_path(plan.path("metrics.json")).read_text())["eval_loss"] == metrics["eval_loss"]
    with store.local_copy(plan.path("samples.parquet")) as local:
        samples = pl.read_parquet(local)
    got = dict(samples.select("sample_id", "eval_loss").iter_rows())
    assert got == pytest.approx(expected, rel=1e-12)


def test_a_shard_without_its_loss_file_is_not_done_and_scores_on_its_own(plan_with_loss):
    plan = plan_with_loss
    generate_shard(plan, 0)
    grade_shard(plan, 0, workers=0)
    assert shard_done(plan, 0) is not None
    loss_path(plan, 0).unlink()
    assert shard_done(plan, 0) is None
    assert eval_loss_shard(shard_plan(plan, 0)) == loss_path(plan, 0) and len(LossEngine.scored) == 6


def test_eval_loss_is_part_of_the_eval_key_only_when_on(tmp_path, monkeypatch):
    ckpt = complete_checkpoint(tmp_path / "run" / "checkpoint-100")
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: LossEngine())

    def plan(**kw):
        return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=3, num_shards=1, **kw),
                       tmp_path / "res")

    off, on = plan(eval_loss=False), plan(eval_loss=True)
    assert not off.eval_loss and off.eval_key != on.eval_key and off.generation_key == on.generation_key
    with pytest.raises(ConfigError, match="no reference solutions"):
        resolve(EvalRequest(benchmark="amc23", checkpoint=str(ckpt), limit=3, eval_loss=True), tmp_path / "res")

"""The score stage (log-probabilities under the evaluated and the reference model, for KL) without a model: a
stand-in engine that says which model scored what. The reference model is checked like the checkpoint: rewritten
or removed since planning, the shard stops before loading anything, and the launch task does not relaunch it."""

from __future__ import annotations

import shutil

import polars as pl
import pytest
from conftest import complete_checkpoint
from prefect.states import Failed
from test_stages import CountingEngine

from evaldag import engines
from evaldag.errors import CheckpointError, ConfigError
from evaldag.pipeline.generate import generate_shard
from evaldag.pipeline.score import score_shard
from evaldag.request.plan import EvalRequest, resolve
from evaldag.storage import store
from tasks.launch_shard import _relaunchable, check_models


class ScoringEngine(CountingEngine):
    """Generates like CountingEngine; scores every token with a log-probability that names the model (-1 for the
    evaluated one, -2 for the reference), and a KL of 0.5 per position."""

    vocabulary = {}      # folder name -> vocabulary fingerprint (default 7: both models share a tokenizer)

    def __init__(self, path: str):
        self.path = path
        self.value = -2.0 if "reference" in path else -1.0

    def vocabulary_fingerprint(self) -> int:
        return type(self).vocabulary.get(self.path.rsplit("/", 1)[-1], 7)

    def score(self, prompts, completion_ids):
        return [[self.value] * len(ids) for ids in completion_ids]

    def score_with_reference(self, prompts, completion_ids, reference):
        return (self.score(prompts, completion_ids), reference.score(prompts, completion_ids),
                [[0.5] * len(ids) for ids in completion_ids])


@pytest.fixture
def scored(tmp_path, monkeypatch):
    """A plan with a reference model, its shard generated (and scored, as generate_shard does), and the list of the
    folders load_engine was asked for since."""
    ckpt = complete_checkpoint(tmp_path / "run" / "checkpoint-100")
    ref = complete_checkpoint(tmp_path / "reference")
    loads: list[str] = []

    def load(name, path, *args, **kwargs):
        loads.append(str(path))
        return ScoringEngine(str(path))

    monkeypatch.setattr(engines, "load_engine", load)
    ScoringEngine.vocabulary = {}
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), reference=str(ref), limit=2, num_shards=1),
                   tmp_path / "res")
    assert plan.reference is not None and generate_shard(plan, 0).is_file()
    loads.clear()
    return plan, ckpt, ref, loads


def _logprobs(plan) -> pl.DataFrame:
    with store.local_copy(plan.logprobs_path(0)) as local:
        return pl.read_parquet(local)


def test_score_shard_writes_both_models_log_probs_per_sample_and_reuses_them(scored):
    plan, ckpt, ref, loads = scored
    plan.logprobs_path(0).unlink()
    assert score_shard(plan, 0) == plan.logprobs_path(0)
    assert sorted(loads) == sorted([str(ckpt), str(ref)])          # both models, loaded once each
    df = _logprobs(plan)
    gens = pl.read_parquet(plan.generations_path(0))
    assert df.select("sample_id", "sample_index").to_dicts() == gens.select("sample_id", "sample_index").to_dicts()
    assert df["logp"].to_list() == [[-1.0] * 3] * len(gens)          # the evaluated model's, token by token
    assert df["ref_logp"].to_list() == [[-2.0] * 3] * len(gens)      # the reference's
    assert df["kl_exact"].to_list() == [[0.5] * 3] * len(gens)
    assert store.read_json(plan.cache_record_path(0))["score"] == "computed"
    loads.clear()
    score_shard(plan, 0)                                             # already in the store: nothing is loaded
    assert loads == [] and store.read_json(plan.cache_record_path(0))["score"] == "reused"


def test_a_reference_with_another_tokenizer_is_refused(scored):
    plan, _, ref, _ = scored
    plan.logprobs_path(0).unlink()
    ScoringEngine.vocabulary = {ref.name: 8}
    with pytest.raises(ConfigError, match="different tokenizer than the evaluated model"):
        score_shard(plan, 0)
    assert not plan.logprobs_path(0).exists()


@pytest.mark.parametrize("change, says", [
    (lambda ref: (ref / "model.safetensors").write_bytes(b"new weights" * 8), "changed after this evaluation"),
    (shutil.rmtree, "is gone"),
], ids=["rewritten", "removed"])
def test_a_reference_changed_after_planning_stops_the_shard_and_is_not_relaunched(scored, change, says):
    """The reference's fingerprint is part of the evaluation's identity: scoring a rewritten reference would store
    its log-probs under the old one."""
    plan, _, ref, loads = scored
    plan.logprobs_path(0).unlink()
    change(ref)
    with pytest.raises(CheckpointError, match=f"reference model.*{says}") as e:
        score_shard(plan, 0)
    assert loads == [] and not plan.logprobs_path(0).exists()
    with pytest.raises(CheckpointError, match=f"reference model.*{says}"):
        check_models(plan)                       # what the launch task checks after a failed shard
    assert _relaunchable(None, None, Failed(data=e.value)) is False

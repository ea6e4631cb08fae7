"""Sharding and the eval_key: deterministic, balanced, and sensitive to everything that decides the output."""

from __future__ import annotations

import polars as pl
import pytest

from evaldag.engines import DEFAULT_ENGINE_ENV, default_engine
from evaldag.errors import ConfigError
from evaldag.models import resolve_model
from evaldag.plan import MIN_PROBLEMS_PER_SHARD, EvalRequest, compute_eval_key, plan_shards, resolve, shard_count


def _inputs(n: int) -> pl.DataFrame:
    return pl.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "prompt": ["x" * ((i * 37) % 101) for i in range(n)]})


def test_shards_cover_every_sample_once():
    shards = plan_shards(_inputs(103), 4)
    flat = [s for shard in shards for s in shard]
    assert sorted(flat) == sorted(f"s{i}" for i in range(103))
    assert [len(s) for s in shards] == [26, 26, 26, 25]


def test_shards_are_deterministic_and_balanced_by_length():
    df = _inputs(200)
    assert plan_shards(df, 4) == plan_shards(df, 4)
    lengths = dict(zip(df["sample_id"], df["prompt"].str.len_chars()))
    totals = [sum(lengths[s] for s in shard) for shard in plan_shards(df, 4)]
    assert max(totals) - min(totals) <= max(lengths.values())


def test_more_shards_than_samples_drops_empty_ones():
    assert len(plan_shards(_inputs(3), 8)) == 3


def test_eval_key_changes_with_any_part():
    base = {"model": "abc", "sampling": {"temperature": 0.0}, "dataset": "h1"}
    key = compute_eval_key(base)
    assert compute_eval_key(dict(base)) == key
    assert compute_eval_key({**base, "model": "abd"}) != key
    assert compute_eval_key({**base, "sampling": {"temperature": 0.1}}) != key
    assert compute_eval_key({**base, "dataset": "h2"}) != key


@pytest.mark.parametrize("n, slots, expected", [
    (4, 1, 1),          # a quick slice on one slot: one shard, one start-up
    (4, 8, 1),          # ... and on many slots: smaller than the minimum shard
    (64, 1, 1),         # never more shards than slots (they would queue behind each other)
    (64, 4, 2),         # never fewer than MIN_PROBLEMS_PER_SHARD problems a shard
    (500, 4, 4),
    (500, 64, 500 // MIN_PROBLEMS_PER_SHARD),
    (31, 2, 1),
])
def test_default_shard_count_fits_the_slots(n, slots, expected):
    assert shard_count(n, slots) == expected


def test_an_explicit_shard_count_is_honoured():
    assert shard_count(64, 1, requested=4) == 4              # the request's, even beyond the slots
    assert shard_count(64, 1, configured=3) == 3             # the benchmark config's
    assert shard_count(64, 1, requested=2, configured=3) == 2
    assert shard_count(3, 1, requested=8) == 3               # capped by the problems


def test_bad_slot_counts_are_refused():
    with pytest.raises(ConfigError, match="slots must be >= 1"):
        shard_count(10, 0)


def test_resolve_fits_a_slice_to_the_slots(tmp_path):
    one = resolve(EvalRequest(benchmark="gsm8k", limit=4), tmp_path, gpu_slots=4)
    assert one.num_shards == 1
    two = resolve(EvalRequest(benchmark="gsm8k", limit=64), tmp_path, gpu_slots=4)
    assert two.num_shards == 2 and sorted(len(s) for s in two.shards) == [32, 32]
    explicit = resolve(EvalRequest(benchmark="gsm8k", limit=4, num_shards=2), tmp_path, gpu_slots=1)
    assert explicit.num_shards == 2


def test_vllm_is_the_default_engine(monkeypatch):
    monkeypatch.delenv(DEFAULT_ENGINE_ENV, raising=False)
    assert default_engine() == "vllm"
    assert resolve_model("smollm2-135m-instruct").engine == "vllm"
    monkeypatch.setenv(DEFAULT_ENGINE_ENV, "hf")
    assert resolve_model("smollm2-135m-instruct").engine == "hf"
    monkeypatch.setenv(DEFAULT_ENGINE_ENV, "tgi")
    with pytest.raises(ConfigError, match="EVALDAG_DEFAULT_ENGINE='tgi' is not an engine"):
        default_engine()

"""Sharding and the eval_key: deterministic, balanced, and sensitive to everything that decides the output."""

from __future__ import annotations

import polars as pl

from evaldag.plan import compute_eval_key, plan_shards


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

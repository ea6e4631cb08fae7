"""The schedule simulator of bench/bench_schedule.py: its engine model, its bounds and its length model (fast)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_schedule", Path(__file__).resolve().parents[1] / "bench" / "bench_schedule.py")
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_schedule"] = bs     # dataclasses look their module up while the file executes
_spec.loader.exec_module(bs)

CURVE = bs.Curve("test", step_s=0.01, per_seq_s=0.002, cap=4, start_s=5.0)


def test_one_sequence_runs_at_single_stream_speed() -> None:
    r = bs.simulate(CURVE, 1, static=[[100]])
    assert r["makespan_s"] == pytest.approx(5.0 + 100 * 0.012)
    assert r["tokens"] == 100


def test_concurrent_sequences_share_steps_and_the_cap_queues_the_rest() -> None:
    # 2 sequences of 10 run together: 10 steps at c=2
    assert bs.simulate(CURVE, 1, static=[[10, 10]])["makespan_s"] == pytest.approx(5.0 + 10 * 0.014)
    # cap 4: the fifth sequence waits for the first to end (10 steps at c=4, then 10 at c=1)
    r = bs.simulate(CURVE, 1, static=[[10] * 5])
    assert r["makespan_s"] == pytest.approx(5.0 + 10 * 0.018 + 10 * 0.012)


def test_queue_on_one_slot_with_room_for_all_equals_static() -> None:
    lengths = [7, 30, 12, 3]
    assert (bs.simulate(CURVE, 1, queue=[[x] for x in lengths])["makespan_s"]
            == pytest.approx(bs.simulate(CURVE, 1, static=[lengths])["makespan_s"]))


def test_queue_feeds_the_slot_that_frees_up() -> None:
    # 2 slots, cap 4: a long unit on slot 0, short ones go to slot 1 as it frees, so slot 0 is not waited on twice
    r = bs.simulate(CURVE, 2, queue=[[100], [10], [10], [10]])
    assert r["makespan_s"] == pytest.approx(5.0 + 100 * 0.012, rel=0.05)


def test_bounds_never_exceed_any_schedule() -> None:
    w = bs.Workload("small", 12, 8, 2000, 700, 0.9, 0.5)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        lengths, previous = bs.draw_lengths(w, rng)
        lower = max(bs.issue_bound(CURVE, 3, lengths), bs.step_bound(CURVE, 3, lengths))
        for kwargs in bs.schedules(w, CURVE, 3, lengths, previous, rng).values():
            assert bs.simulate(CURVE, 3, **kwargs)["makespan_s"] >= lower * (1 - 1e-9)


def test_length_model_hits_its_capped_mean_and_keeps_problems_correlated() -> None:
    mu = bs.solve_mu(bs.AIME_32)
    sigma = np.hypot(bs.AIME_32.sigma_p, bs.AIME_32.sigma_s)
    assert bs.capped_lognormal_mean(mu, sigma, 32768) == pytest.approx(13664, rel=1e-6)
    big = bs.Workload("big", 2000, 32, 32768, 13664, 0.9, 0.5)
    lengths, previous = bs.draw_lengths(big, np.random.default_rng(0))
    assert lengths.mean() == pytest.approx(13664, rel=0.05)
    assert lengths.max() == 32768
    # the previous checkpoint's per-problem means predict this run's: what longest-first orderings rely on
    assert np.corrcoef(lengths.mean(axis=1), previous.mean(axis=1))[0, 1] > 0.8


def test_units_cut_samples_into_enough_units_per_slot() -> None:
    assert bs.unit_samples(32, 30, 8) == 8       # AIME x 32 on 8 slots: 120 units
    assert bs.unit_samples(32, 500, 8) == 32     # MATH-500 x 32: whole problems already give 500 units
    assert bs.unit_samples(1, 500, 4) == 1


def test_split_shards_give_every_slot_its_share_of_every_problem() -> None:
    w = bs.Workload("small", 5, 8, 2000, 700, 0.9, 0.5)
    rng = np.random.default_rng(1)
    lengths, previous = bs.draw_lengths(w, rng)
    [split] = [v["static"] for k, v in bs.schedules(w, CURVE, 3, lengths, previous, rng).items() if "split" in k]
    assert sorted(x for shard in split for x in shard) == sorted(lengths.ravel().tolist())   # every sample once
    # 8 samples over 3 slots: runs of 3, 3, 2 per problem, rotated, so every slot holds 2 or 3 of each of the 5
    assert all(10 <= len(shard) <= 15 for shard in split) and sum(map(len, split)) == 40
    for p in range(w.problems):
        mine = lengths[p].tolist()
        assert all(2 <= sum(x in mine for x in shard) for shard in split)

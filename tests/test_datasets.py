"""Every benchmark mirror loads through `datasets`, and every gold answer normalises and parses."""

from __future__ import annotations

import pytest

from evaldag.request.config import load_benchmark
from evaldag.request.datasets import load_benchmark_rows
from evaldag.errors import DatasetError
from evaldag.scoring.grading import grade_many

EXPECTED_ROWS = {"math500": 500, "aime24": 30, "gsm8k": 1319, "amc23": 40}


@pytest.mark.parametrize("name", sorted(EXPECTED_ROWS))
def test_mirror_loads_with_unique_ids_and_gradeable_golds(name):
    data = load_benchmark_rows(load_benchmark(name))
    assert data.total_rows == EXPECTED_ROWS[name] == data.inputs.height
    assert data.inputs["sample_id"].n_unique() == data.inputs.height
    assert len(data.dataset_hash) == 64
    assert data.inputs["prompt"].str.contains("boxed").all()
    # each gold must be gradeable: the gold itself, boxed, is graded correct against itself ...
    golds = data.inputs["gold"].to_list()
    items = [(f"The answer is $\\boxed{{{g}}}$", g, "stop") for g in golds]
    grades = grade_many(items, timeout_s=20, workers=2)
    bad = [(g, r.status) for g, r in zip(golds, grades) if r.status != "correct"]
    assert bad == []
    # ... and discriminating: the next problem's gold is graded wrong against it (a grader, or a gold normalisation,
    # that calls everything correct fails here). Pairs with the same gold are skipped: they are rightly correct.
    others = golds[1:] + golds[:1]
    pairs = [(g, o) for g, o in zip(golds, others) if g != o]
    assert len(pairs) >= 0.8 * len(golds)
    grades = grade_many([(f"The answer is $\\boxed{{{o}}}$", g, "stop") for g, o in pairs], timeout_s=20, workers=2)
    accepted = {(g, o) for (g, o), r in zip(pairs, grades) if r.status != "wrong"}
    assert accepted == EQUIVALENT_NEIGHBOURS.get(name, set())


# Neighbouring golds that are mathematically the same answer: an equation `x=5` answers a problem whose gold is 5.
EQUIVALENT_NEIGHBOURS = {"math500": {("5", "x=5")}}


def test_breakdown_fields_only_where_the_data_has_them():
    math = load_benchmark_rows(load_benchmark("math500"), limit=50).inputs
    assert math["subject"].null_count() == 0 and set(math["level"].unique()) <= {1, 2, 3, 4, 5}
    aime = load_benchmark_rows(load_benchmark("aime24")).inputs
    assert aime["subject"].null_count() == aime.height
    raw_with_zeros = [g for g in aime["gold_raw"] if g.startswith("0")]
    assert raw_with_zeros, "the AIME mirror stores answers such as '025'"
    assert not any(g.startswith("0") and g != "0" for g in aime["gold"])   # leading zeros normalised


def test_limit_takes_the_first_rows_in_order():
    full = load_benchmark_rows(load_benchmark("gsm8k")).inputs
    part = load_benchmark_rows(load_benchmark("gsm8k"), limit=7)
    assert part.inputs["sample_id"].to_list() == full["sample_id"].head(7).to_list()
    assert part.dataset_hash == load_benchmark_rows(load_benchmark("gsm8k")).dataset_hash


def test_missing_mirror_and_bad_limit(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match="limit must be >= 1"):
        load_benchmark_rows(load_benchmark("aime24"), limit=0)
    monkeypatch.setenv("EVALDAG_DATA_DIR", str(tmp_path))
    with pytest.raises(DatasetError, match="mirror file .*aime24/test.jsonl does not exist"):
        load_benchmark_rows(load_benchmark("aime24"))


def test_field_missing_from_data_is_named(tmp_path, monkeypatch):
    (tmp_path / "aime24").mkdir()
    (tmp_path / "aime24" / "test.jsonl").write_text('{"id": 1, "question": "q", "answer": "5"}\n')
    monkeypatch.setenv("EVALDAG_DATA_DIR", str(tmp_path))
    with pytest.raises(DatasetError, match="column 'problem' .the config's fields.problem."):
        load_benchmark_rows(load_benchmark("aime24"))

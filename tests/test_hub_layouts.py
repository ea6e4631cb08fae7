"""The hub path of the four built-in benchmarks, offline: `datasets.load_dataset(hub_id, hub_config, revision=...,
split=...)`, called as evaldag.request.datasets calls it, reads folders laid out as those hub dataset repositories
are, made at test time from the mirror (../shared/data) with the hub's columns and types. `load_dataset` takes a
repo id that names a local folder (relative to the working directory) as that folder, before it asks the hub, so the
test runs our code path and the real loader unchanged, with no network.

The layouts stand for the revision each config pins (`revision: main`), as those repositories hold it:
- HuggingFaceH4/MATH-500: test.jsonl at the root (problem, solution, answer, subject, level int, unique_id);
- HuggingFaceH4/aime_2024: data/train-00000-of-00001.parquet, one split named train (id int64, problem, solution,
  answer string with leading zeros, url);
- math-ai/amc23: data/test-00000-of-00001.parquet (id int64, problem, question, answer float64, url);
- openai/gsm8k: main/test-00000-of-00001.parquet (question, answer strings; no id column), the `main` config named
  in the README's `configs:` block as the hub repository names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from evaldag import paths
from evaldag.errors import DatasetError
from evaldag.request.config import load_benchmark
from evaldag.request.datasets import load_benchmark_rows

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: test
    path: main/test-*
---
"""


def _mirror(name: str) -> pl.DataFrame:
    return pl.read_ndjson(paths.data_dir() / name / "test.jsonl")


def _lay_out(root: Path, name: str) -> None:
    """The hub repository of benchmark `name` under root/<hub id>, its data from the mirror."""
    repo = root / load_benchmark(name).dataset.hub_id
    repo.mkdir(parents=True)
    rows = _mirror(name)
    if name == "math500":
        (repo / "test.jsonl").write_bytes((paths.data_dir() / "math500" / "test.jsonl").read_bytes())
    elif name == "aime24":
        (repo / "data").mkdir()
        rows.select(pl.col("id").cast(pl.Int64), "problem", "solution", pl.col("answer").cast(pl.Utf8), "url") \
            .write_parquet(repo / "data" / "train-00000-of-00001.parquet")
    elif name == "amc23":
        (repo / "data").mkdir()
        rows.select(pl.col("id").cast(pl.Int64), "problem", "question", pl.col("answer").cast(pl.Float64), "url") \
            .write_parquet(repo / "data" / "test-00000-of-00001.parquet")
    else:   # gsm8k: the hub has question and answer only; idx is the mirror's own
        (repo / "main").mkdir()
        rows.select("question", "answer").write_parquet(repo / "main" / "test-00000-of-00001.parquet")
        (repo / "README.md").write_text(GSM8K_README)


@pytest.mark.parametrize("name", ["math500", "aime24", "amc23", "gsm8k"])
def test_hub_layout_loads_as_the_mirror_does(name, tmp_path, monkeypatch):
    mirror = load_benchmark_rows(load_benchmark(name))
    _lay_out(tmp_path, name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVALDAG_DATA_DIR")      # no mirror: the hub path
    hub = load_benchmark_rows(load_benchmark(name))
    cfg = load_benchmark(name).dataset
    assert hub.source == f"{cfg.hub_id}@{cfg.revision}:{cfg.split}"
    assert hub.total_rows == mirror.total_rows
    # the same problems, ids (an index where the hub has no id column) and golds as the mirror's, and so the
    # same content hash: an evaluation from the hub and one from the mirror share their keys
    assert hub.inputs.equals(mirror.inputs)
    assert hub.dataset_hash == mirror.dataset_hash
    if name == "gsm8k":
        assert hub.inputs["sample_id"].head(3).to_list() == ["0", "1", "2"]


def test_unreachable_hub_names_the_mirror_setting(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.chdir(tmp_path)                  # no local folder of that name
    monkeypatch.delenv("EVALDAG_DATA_DIR")
    # what this machine is (no network), without waiting for connection attempts
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DatasetError) as e:
        load_benchmark_rows(load_benchmark("gsm8k"))
    message = str(e.value)
    assert "cannot load openai/gsm8k@main (test) from the Hugging Face hub" in message
    assert "EVALDAG_DATA_DIR" in message and "gsm8k/test.jsonl" in message


def test_the_mirror_is_the_hub_rows_plus_an_index():
    """What the layouts above assume of the mirror: gsm8k's idx is the row's index, the other columns are there."""
    gsm = _mirror("gsm8k")
    assert gsm["idx"].to_list() == list(range(gsm.height))
    assert json.loads((paths.data_dir() / "amc23" / "test.jsonl").read_text().splitlines()[0]).keys() >= \
        {"id", "problem", "question", "answer", "url"}

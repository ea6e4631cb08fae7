"""A benchmark from a file, without touching the repository: the four-line config, its data as parquet, JSON lines
or CSV, the user's config folder, `evaldag benchmarks` and `evaldag benchmarks check`, and the one message each
kind of bad input gets."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from conftest import complete_checkpoint
from evaldag import paths
from evaldag.cli import app
from evaldag.errors import ConfigError, DatasetError
from evaldag.request.config import MATH_INSTRUCTION, available, load_benchmark
from evaldag.request.datasets import load_benchmark_rows
from evaldag.request.plan import EvalPlan, EvalRequest, resolve

CONFIG = """name: mybench
dataset: {path: DATA}
fields: {problem: question, answer: final}
gold_format: number
"""


def _rows(n: int = 5) -> pl.DataFrame:
    """n GSM8K train problems with their number as `final` (what a team's own file would hold)."""
    train = pl.read_ndjson(paths.data_dir() / "gsm8k" / "train.jsonl", n_rows=n)
    return train.select("question", final=pl.col("answer").str.extract(r"####\s*(.+)$").str.replace_all(",", ""))


def _write(tmp: Path, rows: pl.DataFrame, suffix: str = ".parquet", config: str = CONFIG) -> Path:
    data = tmp / f"mybench{suffix}"
    {".parquet": rows.write_parquet, ".jsonl": rows.write_ndjson, ".csv": rows.write_csv}[suffix](data)
    cfg = tmp / "mybench.yaml"
    cfg.write_text(config.replace("DATA", data.name))   # relative: to the config file's folder
    return cfg


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".csv"])
def test_four_line_config_reads_each_format(tmp_path, suffix):
    cfg_path = _write(tmp_path, _rows(), suffix)
    cfg = load_benchmark(str(cfg_path))
    # everything else defaulted: the math instruction, greedy sampling, a grading timeout
    assert cfg.instruction == MATH_INSTRUCTION and cfg.sampling.temperature == 0 and cfg.sampling.n == 1
    assert cfg.grading_timeout_s > 0 and cfg.fields.id is None
    assert cfg.dataset.path == str(tmp_path / f"mybench{suffix}")     # made absolute for the plan
    data = load_benchmark_rows(cfg)
    assert data.inputs["sample_id"].to_list() == ["0", "1", "2", "3", "4"]    # no id column: the row's index
    assert data.inputs["gold"].to_list() == ["72", "10", "5", "42", "624"]
    assert data.inputs["prompt"][0].startswith("Natalia sold clips") and "boxed" in data.inputs["prompt"][0]
    assert data.source == str(tmp_path / f"mybench{suffix}")


def test_fsspec_url(tmp_path):
    import fsspec

    with fsspec.open("memory://team/mybench.parquet", "wb") as f:
        _rows().write_parquet(f)
    cfg = tmp_path / "mybench.yaml"
    cfg.write_text(CONFIG.replace("DATA", "memory://team/mybench.parquet"))
    data = load_benchmark_rows(load_benchmark(str(cfg)))
    assert data.total_rows == 5 and data.source == "memory://team/mybench.parquet"


def test_user_folder_adds_to_the_built_ins(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    (folder / "benchmarks").mkdir(parents=True)
    _rows().write_parquet(folder / "benchmarks" / "mybench.parquet")
    (folder / "benchmarks" / "mybench.yaml").write_text(CONFIG.replace("DATA", "mybench.parquet"))
    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(folder))
    assert available("benchmarks") == ["aime24", "amc23", "gsm8k", "math500", "mybench"]
    assert load_benchmark("mybench").dataset.path == str(folder / "benchmarks" / "mybench.parquet")
    assert load_benchmark("math500").name == "math500"
    listing = CliRunner().invoke(app, ["benchmarks"], env={"COLUMNS": "400"})
    assert listing.exit_code == 0, listing.output
    lines = {line.split()[1]: line for line in listing.output.splitlines() if line.startswith("│ ")}
    assert str(folder / "benchmarks" / "mybench.yaml") in lines["mybench"]
    assert str(folder / "benchmarks" / "mybench.parquet") in lines["mybench"]
    assert "built-in" in lines["math500"] and "HuggingFaceH4/MATH-500@main (test)" in lines["math500"]
    # `evaldag run mybench` sends the file, which the workers read without the user's EVALDAG_CONFIGS_DIR
    from evaldag.runtime.runner import benchmark_names

    assert benchmark_names("math500,mybench") == ["math500", str(folder / "benchmarks" / "mybench.yaml")]


def test_plan_carries_config_and_data_and_the_key_follows_the_file(tmp_path):
    """The plan embeds the config (with the data file's absolute path) and the rows (inputs.parquet in the result
    store), so shards read nothing of the user's folder; a changed file is another evaluation."""
    ckpt = complete_checkpoint(tmp_path / "ckpts" / "checkpoint-1")
    cfg_path = _write(tmp_path, _rows())
    request = EvalRequest(benchmark=str(cfg_path), checkpoint=str(ckpt), limit=3, num_shards=1)
    first = resolve(request, tmp_path / "results")
    assert first.benchmark.name == "mybench" and first.benchmark.dataset.path == str(tmp_path / "mybench.parquet")
    assert first.inputs()["gold"].to_list() == ["72", "10", "5"]
    assert first.result_dir.startswith(str(tmp_path / "results" / "mybench"))
    # what a shard reads: the plan file, validated again (a config from a file must survive the round trip)
    read = EvalPlan.model_validate_json(first.path("plan.json").read_text())
    assert read.benchmark == first.benchmark and read.dataset_hash == first.dataset_hash
    again = resolve(request, tmp_path / "results")
    assert again.eval_key == first.eval_key
    changed = _rows().with_columns(pl.when(pl.int_range(pl.len()) == 4).then(pl.lit("625")).otherwise("final")
                                   .alias("final"))
    _write(tmp_path, changed)               # a row past the first 3 changes: still another data set
    moved = resolve(request, tmp_path / "results")
    assert moved.dataset_hash != first.dataset_hash and moved.eval_key != first.eval_key


def test_request_takes_a_config_path_only_when_absolute():
    with pytest.raises(ConfigError, match="absolute path ending in .yaml"):
        EvalRequest.parse(benchmark="./mybench.yaml")
    assert EvalRequest.parse(benchmark="/data/mybench.yaml").benchmark == "/data/mybench.yaml"


def test_check_prints_three_rows_as_the_grader_reads_them(tmp_path):
    cfg_path = _write(tmp_path, _rows())
    result = CliRunner().invoke(app, ["benchmarks", "check", str(cfg_path)], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "benchmark mybench, 5 problems" in result.output and "every row reads" in result.output
    assert "Natalia sold clips" in result.output and "Weng earns" in result.output
    assert "Betty is saving" in result.output and "Julie is reading" not in result.output      # three rows


# The five kinds of bad input: each one message naming the file, the row and the fix, and no rows returned.
def _bad_column(tmp):
    return _write(tmp, _rows().rename({"final": "answer"})), DatasetError, [
        "column 'final' (the config's fields.answer) is not in", "mybench.parquet", "set fields.answer to one of"]


def _bad_gold(tmp):
    rows = _rows().with_columns(pl.when(pl.int_range(pl.len()) == 3).then(pl.lit("forty-two")).otherwise("final")
                                .alias("final"))
    return _write(tmp, rows), DatasetError, ["mybench.parquet row 3 (id '3')", "'forty-two'", "as format 'number'",
                                             "Fix the row, or set gold_format"]


def _empty_gold(tmp):
    rows = _rows().with_columns(pl.when(pl.int_range(pl.len()) == 2).then(pl.lit(" ")).otherwise("final")
                                .alias("final"))
    return _write(tmp, rows), DatasetError, ["mybench.parquet row 2 (id '2') has no gold answer in column 'final'",
                                             "fill it in or remove the row"]


def _duplicate_ids(tmp):
    rows = _rows().with_columns(id=pl.Series(["a", "b", "c", "b", "e"]))
    return _write(tmp, rows, config=CONFIG.replace("{problem:", "{id: id, problem:")), DatasetError, [
        "mybench.parquet rows 1 and 3 have the same id 'b' in column 'id'", "drop fields.id to number the rows"]


def _unreadable(tmp):
    cfg = _write(tmp, _rows())
    (tmp / "mybench.parquet").write_text("question,final\nnot a parquet file,1\n")
    return cfg, DatasetError, ["cannot read", "mybench.parquet as parquet", "suffix names its format"]


def _misspelt_key(tmp):
    return _write(tmp, _rows(), config=CONFIG.replace("answer: final", "answr: final")), ConfigError, [
        "mybench.yaml", "fields.answr: Extra inputs are not permitted", "did you mean 'answer'?"]


@pytest.mark.parametrize("case", [_bad_column, _bad_gold, _empty_gold, _duplicate_ids, _unreadable, _misspelt_key],
                         ids=lambda c: c.__name__.strip("_"))
def test_bad_input_gets_one_message(case, tmp_path):
    cfg_path, error, parts = case(tmp_path)
    with pytest.raises(error) as e:
        load_benchmark_rows(load_benchmark(str(cfg_path)))
    for part in parts:
        assert part in str(e.value)
    result = CliRunner().invoke(app, ["benchmarks", "check", str(cfg_path)], env={"COLUMNS": "400"})
    assert result.exit_code == 1
    out = " ".join(result.output.split())
    assert out.startswith(f"error: {cfg_path}"), out          # the config file first, then the data's row
    assert all(" ".join(part.split()) in out for part in parts), out
    assert "every row reads" not in out


def test_a_bad_row_past_the_limit_still_stops_the_evaluation(tmp_path):
    """Nothing is evaluated on a partly read set: the first 2 rows are fine, row 4 is not."""
    rows = _rows().with_columns(pl.when(pl.int_range(pl.len()) == 4).then(pl.lit("")).otherwise("final")
                                .alias("final"))
    with pytest.raises(DatasetError, match="row 4"):
        load_benchmark_rows(load_benchmark(str(_write(tmp_path, rows))), limit=2)


def test_dataset_needs_one_source(tmp_path):
    cfg = tmp_path / "b.yaml"
    cfg.write_text(CONFIG.replace("{path: DATA}", "{path: x.parquet, revision: main, split: train}"))
    with pytest.raises(ConfigError, match=r"\['revision', 'split'\] belong to a hub dataset"):
        load_benchmark(str(cfg))
    cfg.write_text(CONFIG.replace("DATA", "x.xlsx"))
    with pytest.raises(ConfigError, match="must end in one of .parquet"):
        load_benchmark(str(cfg))
    cfg.write_text(CONFIG.replace("{path: DATA}", "{hub_id: org/data}"))
    with pytest.raises(ConfigError, match="needs `revision`"):
        load_benchmark(str(cfg))
    assert json.dumps(load_benchmark("gsm8k").model_dump()["fields"]["id"]) == "null"


def test_a_trainer_event_names_a_config_file(tmp_path):
    from evaldag.events.checkpoint_event import validate_checkpoint_event
    from evaldag.events.identity import requested_benchmarks
    from evaldag.runtime.deployments import SUITE_DEPLOYMENT, evaluation_deployment

    cfg_path = str(_write(tmp_path, _rows()))
    ckpt = complete_checkpoint(tmp_path / "ckpts" / "checkpoint-3")
    event = validate_checkpoint_event({"path": str(ckpt), "step": 3, "train_run": "job",
                                       "benchmarks": ["math500", cfg_path]}, [tmp_path / "ckpts"])
    assert requested_benchmarks(event.benchmarks, ["math500"]) == ["math500", cfg_path]
    assert evaluation_deployment([cfg_path]) == SUITE_DEPLOYMENT != evaluation_deployment(["math500"])
    with pytest.raises(Exception, match="absolute path ending in .yaml"):
        validate_checkpoint_event({"path": str(ckpt), "step": 3, "train_run": "job", "benchmarks": ["mybench.yaml"]},
                                  [tmp_path / "ckpts"])

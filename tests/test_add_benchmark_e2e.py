"""docs/add-benchmark.md end to end through the stack: a 20-problem parquet made from the GSM8K train mirror, its
four-line config in a folder of the user's (nothing in the repository), `evaldag benchmarks check`, then
`evaldag run ./mybench.yaml` as typed (a few problems, few new tokens), and the result where the page says it is:
the command's table, MLflow's evaldag-mybench experiment, the result store's mybench/ folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from mlflow import MlflowClient

from evaldag import paths
from evaldag.storage import store
from evaldag.tracking.names import experiment_name

pytestmark = [pytest.mark.stack, pytest.mark.model]

EVALDAG = str(Path(sys.executable).with_name("evaldag"))
# The page's config, with the data file beside it
CONFIG = """name: mybench
dataset: {path: mybench.parquet}
fields: {problem: question, answer: final}
gold_format: number
"""


def test_add_a_benchmark_journey(live_stack, tmp_path):
    # the page's first step: 20 problems of the GSM8K train mirror, the number after '####' as `final`
    train = pl.read_ndjson(paths.data_dir() / "gsm8k" / "train.jsonl", n_rows=20)
    train.select("question", final=pl.col("answer").str.extract(r"####\s*(.+)$").str.replace_all(",", "")) \
        .write_parquet(tmp_path / "mybench.parquet")
    (tmp_path / "mybench.yaml").write_text(CONFIG)
    env = {**os.environ, "COLUMNS": "200"}

    check = subprocess.run([EVALDAG, "benchmarks", "check", "./mybench.yaml"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "benchmark mybench, 20 problems" in check.stdout and "every row reads" in check.stdout

    run = subprocess.run([EVALDAG, "run", "./mybench.yaml", "--limit", "2", "--max-new-tokens", "16",
                          "--num-shards", "1", "--step", "5"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "started eval/suite" in out and "on mybench (step 5)" in out and "MLflow UI:" in out, out

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("mybench"))
    runs = client.search_runs([exp.experiment_id], filter_string="tags.step = '000000000005'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["n_samples"] == 2 and 0 <= runs[0].data.metrics["accuracy"] <= 1
    # the result store holds the evaluation under the benchmark's name, its plan with the config and the rows
    plans = list(store.as_path(store.root()).joinpath("mybench").glob("*/plan.json"))
    assert len(plans) == 1
    plan = plans[0].read_text()
    assert str(tmp_path / "mybench.parquet") in plan and '"gold_format": "number"' in plan

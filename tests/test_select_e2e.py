"""`evaldag select` through the real stack (issue 54 item 4): a job of five checkpoints of distinct quality (the
decide demo's `arith` benchmark, which the default model can do, and copies of the model with Gaussian noise of
growing size), found in the job's folder under EVALDAG_CHECKPOINT_ROOTS. The set the command returns holds the
unnoised checkpoint (the truly best) and none of the two that noise left near 0 (clearly worse); the two mildly
noised ones may be in it or not, as 40 problems tell them apart or not. The result is on the job's MLflow parent
run and in the flow run's artifacts, and every figure replays from the rows in the store. Tokens and wall against
evaluating all five in full: bench/bench_select_real.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client

from evaldag.decisions.select import select_step
from evaldag.decisions.select_rows import CheckpointRows
from evaldag.request.plan import load_plan
from evaldag.tracking.names import JOBS_EXPERIMENT
from examples.decide_demo import arith_config, write_arith_rows, write_checkpoints

pytestmark = [pytest.mark.stack, pytest.mark.model]

EVALDAG = str(Path(sys.executable).with_name("evaldag"))
JOB = "select-e2e"
# step i: noise of NOISE[i] x each matrix's std on the default model's weights (0: the model itself, 0.55 of the
# first 20 problems right; 1 and more: noise, near 0, the decide demo's `worse`; 0.1 and 0.3 also answered none of
# the first 20 right at 48 tokens). The best is step 2; steps 0 and 3 are hopeless.
NOISE = (1.0, 0.1, 0.0, 2.0, 0.3)
BEST, HOPELESS = NOISE.index(0.0), [s for s, x in enumerate(NOISE) if x >= 1]
# 40 problems read at 20 and 40 (two looks: each look launches a shard run per surviving checkpoint), greedy
ARGS = ["--limit", "40", "--rounds", "2", "--max-new-tokens", "48", "--num-shards", "1", "--engine", "hf",
        "--margin", "0.05"]


def test_select_returns_the_best_of_five_checkpoints(live_stack, tmp_path):
    write_checkpoints(Path(os.environ["EVALDAG_CHECKPOINT_ROOTS"]).parent, NOISE, JOB)
    (tmp_path / "arith.yaml").write_text(arith_config("{path: arith.jsonl}"))
    write_arith_rows(tmp_path / "arith.jsonl", 40)

    out = subprocess.run([EVALDAG, "select", JOB, "./arith.yaml", *ARGS], cwd=tmp_path, capture_output=True,
                         text=True, timeout=1200, env={**os.environ, "COLUMNS": "200"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text

    # the job's parent run: tags, the table, the rows read
    client = MlflowClient()
    [parent] = client.search_runs([client.get_experiment_by_name(JOBS_EXPERIMENT).experiment_id],
                                  filter_string=f"tags.train_run = '{JOB}' and tags.kind = 'train_job'")
    summary = json.loads(mlflow.artifacts.load_text(f"runs:/{parent.info.run_id}/select/arith-rows.json"))
    status, chosen = summary["status"], summary["set"]
    assert BEST in chosen and not set(HOPELESS) & set(chosen), summary
    tags = parent.data.tags
    assert tags["evaldag.select.arith.status"] == status and status in text
    assert tags["evaldag.select.arith.chosen_step"] == (str(BEST) if status == "best" else "")
    assert tags["evaldag.select.arith.set"] == ",".join(map(str, chosen)), tags
    assert tags["evaldag.select.arith.alpha"] == "0.05" and tags["evaldag.select.arith.margin"] == "0.05"
    table = json.loads(mlflow.artifacts.load_text(f"runs:/{parent.info.run_id}/select/arith.json"))
    assert sorted(table["columns"]) == sorted(["step", "in_set", "problems", "mean", "dropped_round", "dropped_at",
                                               "vs", "diff", "ci_low", "ci_high", "checkpoint"])
    by_step = {c["step"]: c for c in summary["checkpoints"]}
    assert sorted(by_step) == list(range(len(NOISE)))
    assert all(by_step[s]["dropped_round"] is not None and by_step[s]["ci_high"] < 0 for s in HOPELESS)
    # spent: less than all five in full (the estimate, from the rows that exist and the prefixes' mean)
    tokens = summary["tokens"]
    assert 0 < tokens["generated"] < tokens["full_est"] and tokens["reused"] == 0, tokens
    print(f"select, 5 checkpoints, arith 40 problems: {summary['status']} {summary['set']}, tokens "
          f"{tokens['generated']} of about {tokens['full_est']} in full ({summary['tokens_ratio']:.2f}), "
          f"wall {summary['wall_s']:.0f} s")

    # every figure replays from the rows in the store (each checkpoint's plan names them)
    rows = {f"{JOB}@{s}": CheckpointRows(f"{JOB}@{s}", load_plan(c["plan"])) for s, c in by_step.items()}
    again = select_step({k: r.scores() for k, r in rows.items()}, summary["looks"], summary["alpha"],
                        summary["margin"])
    assert again.status == status and again.chosen == tuple(f"{JOB}@{s}" for s in chosen)
    for record in again.records:
        logged = by_step[int(record.checkpoint.split("@")[1])]
        assert (record.problems, record.dropped_round) == (logged["problems"], logged["dropped_round"])
        assert record.ci_high == pytest.approx(logged["ci_high"]) or logged["ci_high"] is None

    # the Prefect UI shows it: the flow run's artifact
    with get_client(sync_client=True) as prefect:
        artifacts = [a for a in prefect.read_artifacts() if a.key == "select-arith"]
    assert artifacts and f"{JOB} on arith: {status}" in artifacts[-1].data

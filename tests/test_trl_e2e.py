"""examples/train_trl.py through the real stack: TRL's SFTTrainer on the default model, two saves, each announced by
EvaldagCallback and evaluated by itself on a quick slice; the accuracy lands in the trainer's own MLflow run, beside
its training loss."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

from conftest import require_free_disk

pytestmark = [pytest.mark.stack, pytest.mark.model]

REPO = Path(__file__).resolve().parent.parent
ROOT = Path(os.environ["EVALDAG_CHECKPOINT_ROOTS"])
JOB = "trl-e2e"
SMALL = {"num_shards": 1, "sampling": {"max_new_tokens": 16}}   # the event itself asks for 2 problems


async def _set_overrides(overrides: dict | None) -> dict | None:
    async with get_client() as client:
        dep = await client.read_deployment_by_name("on-checkpoint/on-checkpoint")
        before = dep.parameters.get("eval_overrides")
        await client.update_deployment(dep.id, DeploymentUpdate(parameters={**dep.parameters,
                                                                            "eval_overrides": overrides}))
        return before


async def _evaluations() -> list:
    async with get_client() as client:
        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["gsm8k"])), limit=200)
    return [r for r in runs if r.parameters.get("train_run") == JOB]


@pytest.fixture
def small_evaluations(live_stack):
    before = asyncio.run(_set_overrides(SMALL))
    yield live_stack
    asyncio.run(_set_overrides(before))


def test_trl_checkpoints_are_evaluated_into_the_trainers_mlflow_run(small_evaluations):
    stack = small_evaluations
    out = ROOT / JOB
    require_free_disk(ROOT, 4.5, "TRL's two checkpoints of 1.6 GB (float32 weights and AdamW state)")
    env = {**os.environ, "PREFECT_API_URL": stack.settings.prefect_api_url, "MLFLOW_TRACKING_URI": stack.mlflow_url,
           "MLFLOW_EXPERIMENT_NAME": "trainers-e2e"}
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(REPO / "examples" / "train_trl.py"), "--train-run", JOB,
                               "--output-dir", str(out), "--rows", "8", "--max-steps", "2", "--save-steps", "1",
                               "--max-length", "128", "--eval-limit", "2"],
                              env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
        train_s = time.monotonic() - t0
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        print(f"train_trl.py: {train_s:.0f} s for 2 steps and 2 saves\n{done.stdout[-600:]}")

        def finished():
            runs = asyncio.run(_evaluations())
            return runs if len(runs) == 2 and all(r.state and r.state.is_final() for r in runs) else None

        end = time.monotonic() + 600
        while not (evaluations := finished()) and time.monotonic() < end:
            time.sleep(3)
        assert evaluations, "the two checkpoints' evaluations did not finish in 10 minutes"
        assert all(r.state.is_completed() for r in evaluations), [r.state.message for r in evaluations]
        assert sorted(r.parameters["step"] for r in evaluations) == [1, 2]
        print(f"saves announced -> both evaluations done: {time.monotonic() - t0 - train_s:.0f} s")

        client = MlflowClient()
        exp = client.get_experiment_by_name("trainers-e2e")
        [trainer_run] = client.search_runs([exp.experiment_id])
        assert {e.parameters["mlflow_parent_run_id"] for e in evaluations} == {trainer_run.info.run_id}
        # claimed for the job on first use (evaldag.tracking.parent_runs._claim): no other job writes into it
        assert client.get_run(trainer_run.info.run_id).data.tags.get("train_run") == JOB
        loss = client.get_metric_history(trainer_run.info.run_id, "loss")
        accuracy = client.get_metric_history(trainer_run.info.run_id, "gsm8k.limit2.tok16/accuracy")
        print("trainer run metrics (step, value):", {name: sorted((m.step, round(m.value, 4)) for m in history)
                                                     for name, history in (("loss", loss), ("accuracy", accuracy))})
        assert sorted(m.step for m in loss) == [1, 2]
        assert sorted(m.step for m in accuracy) == [1, 2] and all(0 <= m.value <= 1 for m in accuracy)
    finally:
        shutil.rmtree(out, ignore_errors=True)      # two float32 checkpoints of the default model, ~3.2 GB

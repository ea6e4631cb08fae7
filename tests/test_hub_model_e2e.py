"""A hub model with a per-evaluation engine setting, end to end through the real stack (issue 52 items 4 and 5):
`eval/math500` with checkpoint `org/name@<commit>` read from the session's hub cache (HF_HUB_CACHE, laid out as
huggingface_hub leaves it, tests/hub_cache.py) by the stack's own workers, without reaching the hub, and
`engine_settings={"dtype": "bfloat16"}` in the plan and in the MLflow run's params."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hub_cache import add_revision
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from prefect.deployments import run_deployment

from evaldag.request.plan import EvalPlan
from evaldag.tracking.names import experiment_name

pytestmark = [pytest.mark.stack, pytest.mark.model]

REPO = "evaldag-e2e/SmolLM2-135M-Instruct"


def test_a_hub_model_evaluates_with_its_own_settings(live_stack):
    from evaldag.request.checkpoint import resolve_model

    folder = resolve_model("smollm2-135m-instruct")        # the exported default model, as a plain folder
    commit = add_revision(Path(os.environ["HF_HUB_CACHE"]), REPO, Path(folder.path))
    params = {"checkpoint": f"{REPO}@{commit}", "step": 3, "limit": 2, "num_shards": 1,
              "sampling": {"max_new_tokens": 8}, "engine_settings": {"dtype": "bfloat16"}}
    fr = run_deployment("eval/math500", parameters=params, timeout=900, poll_interval=1)
    assert fr.state.is_completed(), fr.state
    summary = fr.state.result()
    run = MlflowClient().get_run(summary["mlflow_run_id"])
    p = run.data.params
    assert p["model"] == REPO and p["hub"] == f"{REPO}@{commit}" and p["dtype"] == "bfloat16"
    assert p["model_fingerprint"] == folder.fingerprint[:16]           # the snapshot's files are the folder's
    assert Path(p["checkpoint"]).parent.parent.name == f"models--{REPO.replace('/', '--')}"
    assert p["train_run"] == "evaldag-e2e-SmolLM2-135M-Instruct"
    assert run.data.metrics["n_samples"] == 2
    exp = MlflowClient().get_experiment_by_name(experiment_name("math500"))
    assert run.info.experiment_id == exp.experiment_id
    plan = EvalPlan.model_validate_json(Path(download_artifacts(run_id=run.info.run_id,
                                                               artifact_path="config/plan.json")).read_text())
    assert plan.request.engine_settings.dtype == "bfloat16" and plan.model.dtype == "bfloat16"
    assert plan.request.checkpoint == f"{REPO}@{commit}" and plan.model.hub == f"{REPO}@{commit}"

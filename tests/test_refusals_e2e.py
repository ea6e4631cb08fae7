"""A refusal reaches the trainer (issue 53): an event for a folder outside EVALDAG_CHECKPOINT_ROOTS, sent through
the real stack, fails its on-checkpoint run; the notifier warns once, naming the reason, at its next notify(), and
the job's MLflow parent run carries the refusal (tags and a table)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

from cluster_helpers import wait
from conftest import complete_checkpoint
from evaldag.client import CheckpointNotifier
from evaldag.tracking.names import JOBS_EXPERIMENT
from evaldag.tracking.refusals import LAST_REFUSAL_TAG, REFUSALS_TABLE, REFUSALS_TAG

pytestmark = [pytest.mark.stack]

REASON = "is not under an allowed checkpoint root"


def _final_checkpoint_run(path: str):
    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["on-checkpoint"])), limit=200)
    runs = [r for r in asyncio.run(read()) if r.parameters.get("event", {}).get("path") == path]
    return runs[0] if runs and runs[0].state and runs[0].state.is_final() else None


def _job_run(train_run: str):
    client = MlflowClient()
    exp = client.get_experiment_by_name(JOBS_EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.train_run = '{train_run}'") if exp else []
    return runs[0] if runs and REFUSALS_TAG in runs[0].data.tags else None


def test_a_refused_event_reaches_the_trainer_and_the_parent_run(live_stack, tmp_path, caplog):
    outside = complete_checkpoint(tmp_path / "elsewhere" / "checkpoint-5")
    notifier = CheckpointNotifier(train_run="refused-run", api_url=live_stack.settings.prefect_api_url,
                                  spool_dir=tmp_path / "spool")
    first = notifier.notify(outside, step=5)
    run = wait(lambda: _final_checkpoint_run(str(outside)), timeout=300)
    assert run.state.is_failed() and REASON in run.state.message, run.state

    # the next save hears of it: one warning, naming the event and the reason
    with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):
        notifier.notify(complete_checkpoint(tmp_path / "elsewhere" / "checkpoint-6"), step=6)
    warnings = [r.getMessage() for r in caplog.records if "server refused" in r.getMessage()]
    assert len(warnings) == 1 and first in warnings[0] and REASON in warnings[0], warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):   # said once, not at every save
        wait(lambda: _final_checkpoint_run(str(tmp_path / "elsewhere" / "checkpoint-6")), timeout=300)
        notifier.notify(complete_checkpoint(tmp_path / "elsewhere" / "checkpoint-7"), step=7)
    assert not [r for r in caplog.records if first in r.getMessage()]

    # the job's parent run carries it: a count, the latest reason, and a table row per refusal
    job = wait(lambda: _job_run("refused-run"), timeout=300)
    assert int(job.data.tags[REFUSALS_TAG]) >= 1
    assert REASON in job.data.tags[LAST_REFUSAL_TAG]
    table = MlflowClient().load_table(job.info.experiment_id, REFUSALS_TABLE, run_ids=[job.info.run_id])
    row = table[table["step"].astype(str) == "5"].iloc[0]      # read back as JSON: the step may come back a number
    assert row["path"] == str(outside) and REASON in row["reason"] and row["flow_run_id"] == str(run.id)

"""Checkpoint events the server refused, on the training job's MLflow parent run.

An `evaldag.checkpoint.saved` event that fails validation (a folder outside EVALDAG_CHECKPOINT_ROOTS, an incomplete
checkpoint, a step its folder name contradicts) fails its on-checkpoint flow run, and no evaluation starts. The
trainer's notifier hears of it at its next notify() (evaldag.client.delivery.failed_checkpoint_runs); this module
makes it visible where the job's curves are: `record_refusal`, the flow's on_failure hook, appends a row to the
parent run's table REFUSALS_TABLE and sets its tags REFUSALS_TAG (how many) and LAST_REFUSAL_TAG (the latest reason).
"""

from __future__ import annotations

import logging
import re
from datetime import datetime, timezone

from evaldag.request.rules import RUN_ID_PATTERN, TRAIN_RUN_PATTERN

log = logging.getLogger("evaldag")

REFUSALS_TABLE = "refusals.json"
REFUSALS_TAG = "evaldag.refusals"
LAST_REFUSAL_TAG = "evaldag.last_refusal"
_MAX_TAG = 5000          # MLflow's limit on a tag value is 8000 characters; a reason is a few hundred


def record_refusal(flow, flow_run, state) -> None:
    """Prefect on_failure hook of the on-checkpoint flow: put why the event was refused on the job's parent run.

    Never raises (a hook's exception would only hide the refusal's own message): a payload without a valid
    train_run has no job to put it on, and a tracking server that fails is logged."""
    payload = (flow_run.parameters or {}).get("event")
    train_run = payload.get("train_run") if isinstance(payload, dict) else None
    if not isinstance(train_run, str) or not re.fullmatch(TRAIN_RUN_PATTERN, train_run):
        log.warning("refused checkpoint event names no valid train_run; not recorded in MLflow: %s", state.message)
        return
    requested = payload.get("mlflow_parent_run_id")
    requested = requested if isinstance(requested, str) and re.fullmatch(RUN_ID_PATTERN, requested) else None
    try:
        run_id = log_refusal(train_run, str(payload.get("step")), str(payload.get("path")),
                             state.message or state.name, str(flow_run.id), requested)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("could not record the refused checkpoint event of %s in MLflow: %s", train_run, e)
        return
    log.info("refusal recorded on the MLflow parent run %s of %s", run_id, train_run)


def log_refusal(train_run: str, step: str, path: str, reason: str, flow_run_id: str,
                requested_parent: str | None = None) -> str:
    """Append one refusal to the job's parent run (get-or-create, evaldag.tracking.parent_runs); returns its id."""
    from evaldag.tracking.client import mlflow_client
    from evaldag.tracking.parent_runs import parent_run

    client = mlflow_client()
    run_id = parent_run(client, train_run, requested_parent)
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    client.log_table(run_id, data={"time": [at], "step": [step], "path": [path], "reason": [reason],
                                   "flow_run_id": [flow_run_id]}, artifact_file=REFUSALS_TABLE)
    count = int(client.get_run(run_id).data.tags.get(REFUSALS_TAG, "0")) + 1
    client.set_tag(run_id, REFUSALS_TAG, str(count))
    client.set_tag(run_id, LAST_REFUSAL_TAG, f"step {step}: {reason}"[:_MAX_TAG])
    return run_id


__all__ = ["LAST_REFUSAL_TAG", "REFUSALS_TABLE", "REFUSALS_TAG", "log_refusal", "record_refusal"]

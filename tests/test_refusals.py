"""Refused checkpoint events without a stack (the real path: tests/test_refusals_e2e.py): the notifier's one warning
per refused event, from the Prefect API's failed on-checkpoint runs, and the refusal on the job's MLflow parent run."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from evaldag.client import CheckpointNotifier
from evaldag.tracking.names import JOBS_EXPERIMENT
from evaldag.tracking.refusals import LAST_REFUSAL_TAG, REFUSALS_TABLE, REFUSALS_TAG, record_refusal

REASON = "CheckpointError: /elsewhere/checkpoint-5 is not under an allowed checkpoint root"


@pytest.fixture
def prefect_api():
    """The two routes the notifier uses: POST /api/events (204, recorded) and POST /api/flow_runs/filter, which
    answers `failed` (the failed on-checkpoint runs) and records the filter it was sent."""
    state = SimpleNamespace(events=[], filters=[], failed=[])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/api/events":
                state.events.extend(body)
                self.send_response(204)
                self.end_headers()
                return
            state.filters.append(body)
            data = json.dumps(state.failed).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_port}/api"
    yield state
    server.shutdown()


def test_a_refused_event_is_told_once_at_the_next_notify(prefect_api, tmp_path, caplog):
    notifier = CheckpointNotifier("grpo-7", api_url=prefect_api.url, spool_dir=tmp_path / "spool")
    first = notifier.notify(tmp_path / "checkpoint-5", 5)
    payload = prefect_api.events[0]["payload"]
    prefect_api.failed = [{"name": "brave-otter", "parameters": {"event": payload},
                           "state": {"type": "FAILED", "message": f"Flow run encountered an exception: {REASON}"}}]
    with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):
        notifier.notify(tmp_path / "checkpoint-6", 6)
        notifier.notify(tmp_path / "checkpoint-7", 7)                       # told once, not at every save
    told = [r.getMessage() for r in caplog.records if "server refused" in r.getMessage()]
    assert len(told) == 1 and first in told[0] and REASON in told[0] and "step 5" in told[0], told
    flow_filter = prefect_api.filters[0]
    assert flow_filter["flows"]["name"]["any_"] == ["on-checkpoint"]
    assert flow_filter["flow_runs"]["state"]["type"]["any_"] == ["FAILED", "CRASHED"]


def test_another_jobs_refusal_is_not_told(prefect_api, tmp_path, caplog):
    notifier = CheckpointNotifier("grpo-7", api_url=prefect_api.url, spool_dir=tmp_path / "spool")
    notifier.notify(tmp_path / "checkpoint-5", 5)
    prefect_api.failed = [{"name": "x", "parameters": {"event": {**prefect_api.events[0]["payload"],
                                                                  "train_run": "grpo-8"}},
                           "state": {"message": REASON}}]
    with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):
        notifier.notify(tmp_path / "checkpoint-6", 6)
    assert not [r for r in caplog.records if "server refused" in r.getMessage()]


def test_the_refusal_goes_on_the_jobs_parent_run(sqlite_mlflow):
    run = SimpleNamespace(id="fr-1", parameters={"event": {"train_run": "grpo-7", "step": 5, "path": "/elsewhere"}})
    record_refusal(None, run, SimpleNamespace(message=REASON, name="Failed"))
    record_refusal(None, SimpleNamespace(id="fr-2", parameters={"event": {"train_run": "grpo-7", "step": 6,
                                                                          "path": "/x"}}),
                   SimpleNamespace(message="another reason", name="Failed"))
    client = MlflowClient()
    [job] = client.search_runs([client.get_experiment_by_name(JOBS_EXPERIMENT).experiment_id],
                               filter_string="tags.train_run = 'grpo-7'")
    assert job.data.tags[REFUSALS_TAG] == "2" and job.data.tags[LAST_REFUSAL_TAG] == "step 6: another reason"
    table = MlflowClient().load_table(job.info.experiment_id, REFUSALS_TABLE, run_ids=[job.info.run_id])
    assert list(table["flow_run_id"]) == ["fr-1", "fr-2"] and table["reason"].iloc[0] == REASON


def test_a_payload_without_a_valid_job_is_not_recorded(sqlite_mlflow):
    record_refusal(None, SimpleNamespace(id="fr-1", parameters={"event": {"train_run": "../x"}}),
                   SimpleNamespace(message=REASON, name="Failed"))
    assert MlflowClient().get_experiment_by_name(JOBS_EXPERIMENT) is None

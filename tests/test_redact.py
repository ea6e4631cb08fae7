"""Credentials are never shown: evaldag.errors.redact_url, and the MLflow UI links built from a tracking URI, which
go into Prefect artifacts, flow logs and CLI output."""

from __future__ import annotations

import pytest

from evaldag.errors import redact_url
from evaldag.tracking.names import charts_url, run_url


@pytest.mark.parametrize("url, shown", [
    ("https://alice:MLPW123@mlflow.corp", "https://***@mlflow.corp"),
    ("https://TOKEN123@host:5000/x", "https://***@host:5000/x"),                # a token as the user name
    ("postgresql+asyncpg://u:p%40ss@w@db:5432/prefect", "postgresql+asyncpg://***@db:5432/prefect"),
    ("https://h/x?a=1&api_key=S1&X-Amz-Signature=S2&access_token=S3&sig=S4#f",
     "https://h/x?a=1&api_key=***&X-Amz-Signature=***&access_token=***&sig=***#f"),
    ("https://h/x?apikey=S1&password=S2&client_secret=S3&api%5Fkey=S4",
     "https://h/x?apikey=***&password=***&client_secret=***&api%5Fkey=***"),
    # nothing secret: kept byte for byte
    ("http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning&compareRunsMode=CHART",
     "http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning&compareRunsMode=CHART"),
    ("http://host/search?email=a@b.c&q=a%20b", "http://host/search?email=a@b.c&q=a%20b"),
    ("http://host/v1?author=me&author_id=7&design=x&passage=2&auth=S1&authorization=S2&Signature=S3",
     "http://host/v1?author=me&author_id=7&design=x&passage=2&auth=***&authorization=***&Signature=***"),
    ("s3://bucket/evals", "s3://bucket/evals"),
    ("http://[bad", "http://[bad"),
])
def test_redact_url_masks_userinfo_and_secret_parameters(url, shown):
    assert redact_url(url) == shown


def test_mlflow_links_do_not_carry_the_tracking_uris_credentials():
    uri = "https://alice:MLPW123@mlflow.corp/?token=TK456"
    link = run_url(uri, "3", "abcd")
    assert link == "https://***@mlflow.corp/?token=***/#/experiments/3/runs/abcd?workflowType=machine_learning"
    assert "MLPW123" not in charts_url(uri, "3") and "TK456" not in charts_url(uri, "3")
    assert run_url("http://127.0.0.1:5000/", "3", "abcd") == \
        "http://127.0.0.1:5000/#/experiments/3/runs/abcd?workflowType=machine_learning"

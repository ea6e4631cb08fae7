"""evaldag.tracking.run_claims without a server: how a claim reads MLflow's errors about the claimed run. Only MLflow's own
"does not exist" answer lets a claim move to its next generation (which makes a second run of the key); a 503, a
timeout or a restarting server is retried, then raised, never read as "deleted". The same against a real MLflow
server, and the writer's lease kept through long uploads, are in test_tracking.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from evaldag.tracking import run_claims


def _mlflow_error(kind: str):
    """The MlflowException the REST client raises for: a 503 without a JSON body, a timeout, a missing run."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

    if kind == "503":
        return MlflowException("API request to endpoint /api/2.0/mlflow/runs/get failed with error code 503 != 200. "
                               "Response body: 'upstream connect error'", error_code=TEMPORARILY_UNAVAILABLE)
    if kind == "timeout":   # the REST client wraps requests' Timeout without an error code: INTERNAL_ERROR
        return MlflowException("API request to http://mlflow/api/2.0/mlflow/runs/get failed with timeout exception "
                               "HTTPConnectionPool(host='mlflow', port=5000): Read timed out. (read timeout=120).")
    if kind == "missing":
        return MlflowException("Run with id=0123 not found", error_code=RESOURCE_DOES_NOT_EXIST)
    raise AssertionError(kind)


class _Server:
    """A stand-in MlflowClient holding one claim (generation 0, for run `claimed`) whose get_run fails with the
    given errors first, then answers with a live run."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        self.get_run_calls = 0
        self.claims = {}                 # claim experiment name -> the run id it names
        self.candidates: list[str] = []

    def get_experiment_by_name(self, name: str):
        if name not in self.claims:
            return None
        return SimpleNamespace(tags={run_claims.RUN_ID_TAG: self.claims[name]})

    def get_run(self, run_id: str):
        self.get_run_calls += 1
        if self.errors:
            raise _mlflow_error(self.errors.pop(0))
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, lifecycle_stage="active"))

    def create_experiment(self, name: str, tags: dict) -> str:
        self.claims[name] = tags[run_claims.RUN_ID_TAG]
        return f"exp-{len(self.claims)}"

    def delete_experiment(self, experiment_id: str) -> None:
        pass

    def make_candidate(self) -> str:
        self.candidates.append(f"candidate-{len(self.candidates)}")
        return self.candidates[-1]


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(run_claims, "ALIVE_BACKOFF_S", 0.001, raising=False)   # the waits, not the tries

    def make(errors: list[str]) -> _Server:
        s = _Server(errors)
        s.claims[run_claims.claim_name("1", "key")] = "claimed"
        return s

    return make


@pytest.mark.parametrize("errors", [["503"], ["timeout"], ["503", "timeout", "503"]])
def test_a_transient_error_reading_the_claimed_run_is_retried_not_read_as_deleted(server, errors):
    s = server(errors)
    assert run_claims.claim_run(s, "1", "key", s.make_candidate) == ("claimed", False)
    assert s.candidates == [] and len(s.claims) == 1          # no candidate run, no claim of a next generation
    assert s.get_run_calls == len(errors) + 1


def test_an_mlflow_that_keeps_failing_raises_instead_of_making_a_second_run(server):
    s = server(["503"] * 100)
    with pytest.raises(run_claims.TrackingUnavailable, match="claimed.*503"):
        run_claims.claim_run(s, "1", "key", s.make_candidate)
    assert s.candidates == [] and len(s.claims) == 1
    assert s.get_run_calls == run_claims.ALIVE_TRIES
    assert issubclass(run_claims.TrackingUnavailable, RuntimeError)   # the track task retries it (tasks/retry.py)
    assert not issubclass(run_claims.TrackingUnavailable, ValueError)


def test_a_run_that_does_not_exist_passes_the_claim_to_the_next_generation(server):
    s = server(["missing"])
    assert run_claims.claim_run(s, "1", "key", s.make_candidate) == ("candidate-0", True)
    assert s.claims[run_claims.claim_name("1", "key", 1)] == "candidate-0"
    assert s.get_run_calls == 1                                   # no retry: MLflow said it is gone

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


# ---- a failed claim leaves no candidate that looks live: a real MLflow store (SQLite) ---------------------------

class _Failing:
    """A real MlflowClient whose `fail` methods raise a 503 (an overloaded or restarting server), and whose first
    look for a claim finds none (`race`: another evaluation claims between that look and this one's claim)."""

    def __init__(self, client, fail: set[str], race: bool = False):
        self._client, self.fail, self.race = client, fail, race

    def get_experiment_by_name(self, name: str):
        if self.race and name.startswith(run_claims.CLAIM_PREFIX):
            self.race = False
            return None
        return self._client.get_experiment_by_name(name)

    def __getattr__(self, name: str):
        if name in self.fail:
            def fail(*args, **kwargs):
                raise _mlflow_error("503")
            return fail
        return getattr(self._client, name)


def _tracked_plan(tmp_path):
    from conftest import complete_checkpoint
    from evaldag.request.plan import EvalRequest, resolve

    ckpt = complete_checkpoint(tmp_path / "ckpts" / "job" / "checkpoint-10")
    return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), step=10, limit=2, num_shards=1,
                               train_run="job"), tmp_path / "results")


def _looks_live(client, exp_id: str) -> list:
    """Runs the MLflow UI shows as a live evaluation: RUNNING and tagged as one."""
    return [r for r in client.search_runs([exp_id]) if r.info.status == "RUNNING"
            and r.data.tags.get("kind") == "ckpt_eval"]


def test_a_claim_that_fails_otherwise_leaves_no_live_looking_candidate(sqlite_mlflow, configs, tmp_path, monkeypatch):
    """create_experiment (the claim) fails with a 503, not RESOURCE_ALREADY_EXISTS: the track fails and is retried,
    and the candidate it made is not left RUNNING with every tag of the evaluation's run."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from evaldag.tracking import client as tracking_client
    from evaldag.tracking.parent_runs import ensure_experiment
    from evaldag.tracking.write import track
    from evaldag.tracking.names import experiment_name

    client = MlflowClient()
    monkeypatch.setattr(tracking_client, "mlflow_client", lambda: _Failing(client, {"create_experiment"}))
    exp_id = ensure_experiment(client, experiment_name("aime24"))   # the claim's failure, not the experiment's
    with pytest.raises(MlflowException):
        track(_tracked_plan(tmp_path), {"accuracy": 0.5}, flow_run_id="flow-run-1")
    runs = client.search_runs([exp_id])
    assert len(runs) == 1 and _looks_live(client, exp_id) == []
    assert runs[0].info.status == "FAILED"


def test_a_candidate_that_lost_its_claim_and_cannot_be_deleted_is_ended(sqlite_mlflow, tmp_path):
    """Lost the race (the claim exists: RESOURCE_ALREADY_EXISTS) and delete_run fails: the winner's run is still
    the one returned, and the loser's candidate is ended, not left RUNNING."""
    from mlflow import MlflowClient

    client = MlflowClient()
    exp_id = client.create_experiment("claims")
    winner = client.create_run(exp_id).info.run_id
    client.create_experiment(run_claims.claim_name(exp_id, "key"), tags={run_claims.RUN_ID_TAG: winner})
    racing = _Failing(client, {"delete_run"}, race=True)

    def candidate() -> str:
        return client.create_run(exp_id, tags={"kind": "ckpt_eval"}).info.run_id

    assert run_claims.claim_run(racing, exp_id, "key", candidate) == (winner, False)
    loser = [r for r in client.search_runs([exp_id]) if r.info.run_id != winner]
    assert len(loser) == 1 and loser[0].info.status == "FAILED"

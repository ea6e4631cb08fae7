"""A team's own servers without starting any (issue 53; the whole path runs in tests/test_own_servers_e2e.py): which
servers `evaldag run` connects to, the MLflow the stack's workers log to, `evaldag deploy`'s refusal without a
Prefect server to register on."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from evaldag.cli import app
from evaldag.errors import StackError
from evaldag.runtime import runner
from evaldag.runtime.stack import CPU_WORKER, Stack, StackSettings, UpReport

TEAM_PREFECT = "http://prefect.team:4200/api"
TEAM_MLFLOW = "http://mlflow.team:5000"


def test_run_connects_to_the_teams_servers_without_a_local_stack(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", TEAM_PREFECT)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", TEAM_MLFLOW)
    servers = runner.point_clients_at_stack(Stack(StackSettings(home=tmp_path)))
    assert servers == runner.Servers("http://prefect.team:4200", TEAM_MLFLOW)
    assert not (tmp_path / "stack").exists()


def test_the_teams_prefect_without_its_mlflow_names_the_missing_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", TEAM_PREFECT)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(StackError, match="MLFLOW_TRACKING_URI is not"):
        runner.point_clients_at_stack(Stack(StackSettings(home=tmp_path)))


def test_nothing_set_and_no_stack_says_both_ways_in(tmp_path, monkeypatch):
    for var in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(StackError, match="start it with `evaldag up`, or set PREFECT_API_URL and MLFLOW_TRACKING_URI"):
        runner.point_clients_at_stack(Stack(StackSettings(home=tmp_path)))


def test_the_stacks_workers_log_to_the_teams_mlflow_with_its_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "team-token")
    auth = "evaldag:stack-password-123"
    env = Stack(StackSettings(home=tmp_path, tracking_uri=TEAM_MLFLOW, api_auth=auth))._desired_specs("x")[
        CPU_WORKER].env
    assert env["MLFLOW_TRACKING_URI"] == TEAM_MLFLOW and env["MLFLOW_TRACKING_TOKEN"] == "team-token"
    assert env["MLFLOW_TRACKING_PASSWORD"] == ""                        # the stack's own MLflow password stays home
    assert env["PREFECT_API_AUTH_STRING"] == auth                       # the stack's Prefect still needs its own
    own = Stack(StackSettings(home=tmp_path))._desired_specs("x")[CPU_WORKER].env
    assert own["MLFLOW_TRACKING_URI"] == StackSettings(home=tmp_path).mlflow_url


def test_up_hands_the_shells_mlflow_to_the_workers(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(Stack, "up", lambda self, deploy=True: seen.append(self.settings) or UpReport())
    monkeypatch.setattr("evaldag.runtime.stack_report.print_up", lambda *a: None)
    result = CliRunner().invoke(app, ["up", "--no-deploy"], env={"EVALDAG_HOME": str(tmp_path),
                                                                 "MLFLOW_TRACKING_URI": TEAM_MLFLOW})
    assert result.exit_code == 0, result.output
    assert seen[0].tracking_uri == TEAM_MLFLOW


def test_deploy_without_a_prefect_server_says_what_to_set(tmp_path):
    result = CliRunner().invoke(app, ["deploy"], env={"EVALDAG_HOME": str(tmp_path), "PREFECT_API_URL": ""})
    assert result.exit_code == 1 and "export PREFECT_API_URL=" in result.output, result.output

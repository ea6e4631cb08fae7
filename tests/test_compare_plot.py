"""MLflow experiments evaldag creates open as model-training experiments, and `evaldag compare --plot` draws the
jobs side by side; both against a real MLflow tracking store (SQLite, no server needed), runs logged as the track
stage logs them (tags kind/train_run/benchmark, metrics at step)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow import MlflowClient

from evaldag.tracking import compare
from evaldag.tracking.names import JOBS_EXPERIMENT, experiment_name
from evaldag.tracking.parent_runs import ensure_experiment, parent_run


def _log_eval(client, exp_id: str, job: str, step: int, acc: float, reward: float) -> None:
    run = client.create_run(exp_id, run_name=f"{job}@{step}", tags={
        "kind": "ckpt_eval", "train_run": job, "benchmark": "math500", "step": f"{step:012d}"})
    for key, value in {"accuracy": acc, "accuracy_ci_low": acc - 0.1, "accuracy_ci_high": acc + 0.1,
                       "reward/mean": reward, "step": step}.items():
        client.log_metric(run.info.run_id, key, value, step=step)
    client.set_terminated(run.info.run_id, "FINISHED")


def test_experiments_are_marked_model_training(mlflow_store):
    client = MlflowClient()
    older = client.create_experiment(experiment_name("gsm8k"))              # as an older evaldag left it
    assert ensure_experiment(client, experiment_name("gsm8k")) == older
    new = ensure_experiment(client, experiment_name("math500"))
    parent_run(client, "job-a")                                             # creates the training-jobs experiment
    for exp_id in (older, new, client.get_experiment_by_name(JOBS_EXPERIMENT).experiment_id):
        assert client.get_experiment(exp_id).tags.get("mlflow.experimentKind") == "custom_model_development"


def test_compare_plot_draws_one_line_per_job(mlflow_store, tmp_path):
    client = MlflowClient()
    exp_id = ensure_experiment(client, experiment_name("math500"))
    for step, acc in ((100, 0.2), (200, 0.3), (300, 0.35)):
        _log_eval(client, exp_id, "job-a", step, acc, acc - 0.05)
    _log_eval(client, exp_id, "job-b", 200, 0.4, 0.33)
    _log_eval(client, exp_id, "job-c", 100, 0.9, 0.9)                       # not asked for

    fig = compare.figure(compare.collect(["math500"], ["job-a", "job-b"]))
    acc_ax, rew_ax = fig.axes[0], fig.axes[1]
    acc_lines = {line.get_label(): list(line.get_xdata()) for line in acc_ax.get_lines()}
    assert acc_lines == {"job-a": [100, 200, 300], "job-b": [200]}
    rewards = {line.get_label(): list(line.get_ydata()) for line in rew_ax.get_lines()}
    assert rewards["job-a"] == pytest.approx([0.15, 0.25, 0.30]) and rewards["job-b"] == pytest.approx([0.33])
    assert len(acc_ax.collections) == 2                                     # one interval band per job

    out = tmp_path / "jobs.png"
    proc = subprocess.run([sys.executable, "-m", "evaldag.cli", "compare", "-b", "math500", "--train-run", "job-a",
                           "--train-run", "job-b", "--plot", str(out)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "job-c" not in proc.stdout and "plot written to" in proc.stdout
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 400
    assert pixels.std() > 0.05                                              # not a blank canvas


def test_plot_of_nothing_says_what_to_do(mlflow_store):
    with pytest.raises(ValueError, match="evaldag run"):
        compare.figure(compare.collect(["math500"], ["nobody"]))


def _log_curve_point(client, exp_id: str, job: str, step: int, acc: float, final_step: int | None) -> None:
    """An evaluation as track() tags it for forecasts: comparison key, sample count, the job's final step."""
    tags = {"kind": "ckpt_eval", "train_run": job, "benchmark": "math500", "step": f"{step:012d}",
            "evaldag.comparison_key": "k1"}
    if final_step:
        tags["evaldag.final_step"] = str(final_step)
    run = client.create_run(exp_id, run_name=f"{job}@{step}", tags=tags)
    for key, value in {"accuracy": acc, "reward/mean": acc, "n_samples": 500.0, "step": step}.items():
        client.log_metric(run.info.run_id, key, value, step=step)
    client.set_terminated(run.info.run_id, "FINISHED")


def test_compare_forecasts_each_job_and_flags_the_one_falling_behind(mlflow_store, tmp_path):
    from evaldag.decisions.forecast import sigmoid

    client = MlflowClient()
    exp_id = ensure_experiment(client, experiment_name("math500"))
    for step in (100, 200, 300, 400, 500, 600):
        acc = round(float(sigmoid(step, 0.7, 0.2, 300, 1.5)), 3)
        _log_curve_point(client, exp_id, "job-a", step, acc, 1200)
        _log_curve_point(client, exp_id, "job-b", step, round(acc - 0.12, 3), None)

    df = compare.collect(["math500"], ["job-a", "job-b"])
    predicted = compare.forecasts(df)
    assert predicted["train_run"].to_list() == ["job-a"]                    # job-b names no final step
    a = predicted.row(0, named=True)
    assert a["made"] and a["final_step"] == 1200 and a["low"] < sigmoid(1200, 0.7, 0.2, 300, 1.5) < a["high"]
    assert compare.forecasts(df, final_step=900)["final_step"].to_list() == [900, 900]
    flags = {d.details["job"]: d for _, d in compare.falling_behind(df)}
    assert flags["job-b"].fired and "job-b at step 600" in flags["job-b"].explanation
    assert not flags["job-a"].fired                                          # ahead is not behind

    fig = compare.figure(df, predicted)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert max(lines["job-a forecast"].get_xdata()) == 1200                 # drawn out to the final step
    assert "job-b forecast" not in lines

    out = tmp_path / "jobs.png"
    proc = subprocess.run([sys.executable, "-m", "evaldag.cli", "compare", "-b", "math500", "--plot", str(out)],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "job-a on math500: forecast at step 1200:" in proc.stdout and "falling behind" in proc.stdout
    assert "job-b at step 600" in proc.stdout

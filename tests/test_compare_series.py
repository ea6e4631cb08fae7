"""`evaldag compare` groups a job's evaluations by comparison key (issue 37 item 4): a quick slice or an evaluation
stopped early never replaces a full evaluation in a series, and the deltas, forecasts and `falling_behind` read
the job's full series. Against a real MLflow store (SQLite), runs tagged as the track stage tags them."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from evaldag.tracking import compare
from evaldag.tracking.names import experiment_name
from evaldag.tracking.parent_runs import ensure_experiment

FULL = {100: 0.30, 200: 0.42, 300: 0.50, 400: 0.55, 500: 0.58, 600: 0.60}


def _log(client, exp_id: str, job: str, step: int, acc: float, key: str, n_samples: float, **tags) -> None:
    run = client.create_run(exp_id, run_name=f"{job}@{step}", tags={
        "kind": "ckpt_eval", "train_run": job, "benchmark": "math500", "step": f"{step:012d}",
        "evaldag.comparison_key": key, "evaldag.final_step": "1200", **tags})
    for name, value in {"accuracy": acc, "reward/mean": acc, "n_samples": n_samples, "step": step}.items():
        client.log_metric(run.info.run_id, name, value, step=step)
    client.set_terminated(run.info.run_id, "FINISHED")


def test_a_slice_after_six_full_evaluations_is_another_series(mlflow_store):
    client = MlflowClient()
    exp_id = ensure_experiment(client, experiment_name("math500"))
    for step, acc in FULL.items():
        _log(client, exp_id, "job-a", step, acc, "full", 500.0)
        _log(client, exp_id, "job-b", step, acc - 0.12, "full", 500.0)
    # after the full step-600 run: a 20-problem slice (another key) and a stopped prefix of the full series
    _log(client, exp_id, "job-a", 600, 0.46, "slice20", 20.0)
    _log(client, exp_id, "job-a", 600, 0.95, "full", 40.0, **{"decide.status": "stopped"})

    df = compare.collect(["math500"], ["job-a", "job-b"])
    a = {(r["step"], r["comparison_key"]): r for r in df.filter(df["train_run"] == "job-a").iter_rows(named=True)}
    full600 = a[(600, "full")]
    assert full600["accuracy"] == pytest.approx(0.60) and not full600["stopped"]     # not the slice, not the prefix
    assert full600["delta_prev"] == pytest.approx(0.60 - 0.58)
    assert full600["delta_best"] == pytest.approx(0.60 - 0.58)                       # best so far: step 500
    assert a[(600, "slice20")]["delta_prev"] is None                                # alone in its series
    assert a[(100, "full")]["delta_best"] is None                                   # nothing before it

    predicted = {r["train_run"]: r for r in compare.forecasts(df).iter_rows(named=True)}
    assert predicted["job-a"]["made"], predicted["job-a"]["text"]                   # six points, not one
    flags = {d.details["job"]: d for _, d in compare.falling_behind(df)}
    assert flags["job-b"].fired and "job-b at step 600" in flags["job-b"].explanation

    table = compare.render(df)
    assert [c.header for c in table.columns] == ["train run", "step", "math500", "math500 [slice20]"]

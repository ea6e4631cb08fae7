"""The forecast and the falling-behind check as the track stage logs them, against a real MLflow tracking store
(SQLite, no server): the job's parent run gets the forecast at the planned final step once enough checkpoints are
evaluated, and a job far below another at the same step is flagged on its evaluation's run. Metrics are made up
(tracking logs what it is given); the curve is evaldag.decisions.forecast's own model."""

from __future__ import annotations

import json

import polars as pl
from conftest import complete_checkpoint


def _track(tmp_path, job: str, step: int, accuracy: float, final_step: int | None):
    from evaldag.request.plan import EvalRequest, resolve
    from evaldag.tracking.write import track

    ckpt = complete_checkpoint(tmp_path / "ckpts" / job / f"checkpoint-{step}")
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), step=step, limit=2, num_shards=1,
                               train_run=job, final_step=final_step), tmp_path / "results")
    pl.DataFrame({"sample_id": ["a", "b"], "correct": [True, False]}).write_parquet(plan.path("samples.parquet"))
    metrics = {"accuracy": accuracy, "reward/mean": accuracy, "reward/std": 0.5, "n_samples": 500.0}
    plan.path("metrics.json").write_text(json.dumps(metrics))
    return track(plan, metrics, flow_run_id=f"fr-{job}-{step}")


def test_parent_run_gets_the_forecast_and_a_lagging_job_is_flagged(mlflow_store, tmp_path):
    from mlflow import MlflowClient

    from evaldag.decisions.forecast import sigmoid
    from evaldag.tracking.names import FINAL_STEP_TAG, JOBS_EXPERIMENT

    steps = [100, 200, 300, 400, 500]
    for s in steps:                                                  # the leading job, no final step named
        _track(tmp_path, "lead", s, round(float(sigmoid(s, 0.7, 0.2, 300, 1.5)), 3), None)
    runs = [_track(tmp_path, "lag", s, round(float(sigmoid(s, 0.7, 0.2, 300, 1.5)) - 0.15, 3), 1000)
            for s in steps]

    client = MlflowClient()
    jobs = client.get_experiment_by_name(JOBS_EXPERIMENT).experiment_id
    [parent] = client.search_runs([jobs], filter_string="tags.train_run = 'lag'")
    key = "aime24.limit2/forecast/final_accuracy"
    history = {m.step: m.value for m in client.get_metric_history(parent.info.run_id, key)}
    assert list(history) == [500]                                    # from the 5th checkpoint on, not before
    low = client.get_metric_history(parent.info.run_id, f"{key}_low")[0].value
    high = client.get_metric_history(parent.info.run_id, f"{key}_high")[0].value
    truth = float(sigmoid(1000, 0.7, 0.2, 300, 1.5)) - 0.15
    assert low < history[500] < high and low < truth < high
    assert parent.data.tags[FINAL_STEP_TAG] == "1000"
    assert parent.data.tags["evaldag.forecast.aime24.limit2"].startswith("forecast at step 1000:")
    early = client.get_run(runs[2].run_id).data.tags["evaldag.forecast.aime24.limit2"]
    assert "needs at least 5 evaluated steps" in early and "3 so far" in early
    [lead_parent] = client.search_runs([jobs], filter_string="tags.train_run = 'lead'")
    assert not any("forecast" in k for k in lead_parent.data.metrics)   # no final step, no forecast

    behind = next(d for d in runs[-1].diagnostics if d.name == "falling_behind")
    assert behind.fired and "below lead at the same step" in behind.explanation
    assert client.get_run(runs[-1].run_id).data.tags["diagnostic.falling_behind"] == "fired"

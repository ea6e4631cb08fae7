"""What evaldag's MLflow objects are called: experiment names, metric keys, the tags runs are found by, and links
into the MLflow UI. Plain strings without MLflow, so that readers (`evaldag compare`, verdicts) need not load it."""

from __future__ import annotations

import re

from evaldag.errors import redact_url

EXPERIMENT_PREFIX = "evaldag"
# One run per training job, holding every benchmark's headline metrics at step = checkpoint step: its chart view
# draws one curve per training job against step. (MLflow nests runs only inside one experiment, so the per-benchmark
# child runs link to it with the tag evaldag.parent_run_id instead.)
JOBS_EXPERIMENT = f"{EXPERIMENT_PREFIX}-train-runs"
COMPARISON_TAG = "evaldag.comparison_key"
SETTINGS_TAG = "evaldag.settings_key"
# On an evaluation that asked for a sequential verdict (decide): the settings key of the same evaluation without it,
# under which the sweeper counts it as done for its checkpoint (evaldag.tracking.history.evaluated_checkpoints).
UNDECIDED_SETTINGS_TAG = "evaldag.settings_key_without_decide"
# An evaluation that stopped early (evaldag.decisions.decide) is tagged decide.status=stopped: its accuracy is over a
# prefix of the problems. At a step, a full evaluation supersedes it whatever their order, and it is never the job's
# best (evaldag.decisions.best).
DECIDE_STATUS_TAG = "decide.status"


def stopped_early(tags: dict) -> bool:
    """Whether a run's tags say it stopped before its last problem (a prefix evaluation)."""
    return tags.get(DECIDE_STATUS_TAG) == "stopped"


def full_first(runs: list) -> list:
    """MLflow runs with the full evaluations before those that stopped early, each group in its given order (so a
    "first run per step" rule prefers a full one)."""
    return sorted(runs, key=lambda r: stopped_early(r.data.tags))
# MLflow 3's experiment kind (the UI's "Machine learning" type): the UI opens such an experiment on its runs table and
# charts instead of the GenAI traces/evaluation view. The value is the one the MLflow 3.17 UI reads.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# The job's planned last step (evaldag.decisions.forecast) as the request named it, on the evaluation's run and the job's
# parent run; and the forecast there in words, `evaldag.forecast.<series>` (one per kind of evaluation).
FINAL_STEP_TAG = "evaldag.final_step"
FORECAST_TAG = "evaldag.forecast"
# Set on a finished run when a later computation of the same evaluation found other results (which, and by whom).
DIFFERS_TAG = "evaldag.recomputation_differs"
# The UI's global "GenAI / Model training" switch starts on GenAI in a fresh browser whatever the experiment's kind;
# links evaldag prints carry the training one so they open on runs and charts.
UI_TRAINING = "workflowType=machine_learning"


def experiment_name(benchmark: str) -> str:
    """One experiment per benchmark family, e.g. evaldag-math500."""
    return f"{EXPERIMENT_PREFIX}-{benchmark}"


def mlflow_key(name: str) -> str:
    """MLflow metric names allow [A-Za-z0-9_-. /:]; pass@4 becomes pass_at_4."""
    return re.sub(r"[^\w.\- /:]", "_", name.replace("@", "_at_"))


def run_url(uri: str, exp_id: str, run_id: str) -> str | None:
    """The MLflow UI's page of one run, or None when the tracking URI `uri` is not an http server. Credentials in
    `uri` are masked (evaldag.errors.redact_url): the link goes into Prefect artifacts, flow logs and CLI output."""
    if uri.startswith("http"):
        return f"{redact_url(uri).rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}?{UI_TRAINING}"
    return None


def charts_url(uri: str, exp_id: str) -> str:
    """The MLflow UI's chart view of an experiment: every logged metric against step, one series per run (credentials
    in `uri` masked, as in run_url)."""
    return f"{redact_url(uri).rstrip('/')}/#/experiments/{exp_id}/runs?{UI_TRAINING}&compareRunsMode=CHART"


__all__ = ["COMPARISON_TAG", "DIFFERS_TAG", "EXPERIMENT_KIND_TAG", "EXPERIMENT_PREFIX", "FINAL_STEP_TAG",
           "FORECAST_TAG", "JOBS_EXPERIMENT",
           "SETTINGS_TAG", "TRAINING_KIND", "UNDECIDED_SETTINGS_TAG", "UI_TRAINING", "charts_url", "experiment_name", "mlflow_key", "run_url"]
